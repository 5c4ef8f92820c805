"""What the benchmarks share."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` by nearest rank (0.0 for none)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))] if values else 0.0
