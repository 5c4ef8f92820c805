"""What the benchmarks share."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` by nearest rank (0.0 for none)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))] if values else 0.0


def accuracy_se(correct: int, n: int) -> tuple[float, float]:
    """The share correct and its standard error, sqrt(p (1 - p) / n)."""
    p = correct / n if n else 0.0
    return p, (p * (1 - p) / n) ** 0.5 if n else 0.0


def macro_f1(gold: list[str], predicted: list[str | None]) -> float:
    """F1 per gold label, averaged with equal weight (a prediction of None is wrong for every label)."""
    labels = sorted(set(gold))
    total = 0.0
    for label in labels:
        tp = sum(g == label and p == label for g, p in zip(gold, predicted))
        fp = sum(g != label and p == label for g, p in zip(gold, predicted))
        fn = sum(g == label and p != label for g, p in zip(gold, predicted))
        total += 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    return total / len(labels) if labels else 0.0


def expected_calibration_error(confidence: list[float], correct: list[bool], bins: int = 10) -> float:
    """ECE: over ``bins`` equal-width bins of confidence, the gap between the mean confidence and the share
    correct, weighted by the bin's share of the items (Naeini et al. 2015; Guo et al. 2017)."""
    n = len(confidence)
    if not n:
        return 0.0
    gap = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = [i for i, c in enumerate(confidence) if lo < c <= hi or (b == 0 and c == 0.0)]
        if inside:
            mean_conf = sum(confidence[i] for i in inside) / len(inside)
            share = sum(correct[i] for i in inside) / len(inside)
            gap += len(inside) / n * abs(mean_conf - share)
    return gap
