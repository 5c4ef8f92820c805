"""Classification in the typed-tasks benchmark (benchmarks/tasks.py): every variant and configuration of label
scoring against the JSON route on each labelled set, item by item, and the figures (accuracy and its standard
error, macro-F1, ECE, tasks/s) computed from the kept per-item probabilities; multi-label the same way."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spin-waiting threads if the machine is shared

from benchmarks.stats import pct  # noqa: E402
from benchmarks.task_inputs import (  # noqa: E402
    CONFIGS,
    RAW_DIR,
    VARIANTS,
    label_schema,
    labelled_sets,
    multi_label_items,
    variant_task,
)
from nodeagent.tasks.contracts import ClassifyTask  # noqa: E402
from nodeagent.tasks.prompts import classify_messages  # noqa: E402


def classify_sets(plan, config, path: Path, runner, llm, n_classify: int | None, set_names: list[str]) -> dict:
    """Every scoring variant and the JSON route over every set, alternating item by item (the order rotates).
    Each item's label probabilities (sum and mean, and the content-free inputs' under the same prompt) are
    kept per variant in the raw record (RAW_DIR), and the figures are computed from it (``summarise``), so a
    new way to read the same scores needs no new run (``--from-raw``)."""
    from nodeagent.node import Node
    from nodeagent.tasks.runner import _probabilities, calibrated, calibrates

    runners, nodes = {"json": runner}, []
    for v in VARIANTS:
        if v not in runners:
            nodes.append(Node(str(path), config=config, task="classify", ctx_tokens=plan.settings.n_ctx))
            runners[v] = nodes[-1].runner()
    methods = [*VARIANTS, "json_route"]
    raw: dict = {}
    for st in labelled_sets(set_names):
        items = st["items"] if n_classify is None else random.Random(3).sample(st["items"], min(n_classify,
                                                                                               len(st["items"])))
        rec = {v: {"latency_s": [], "sum": [], "mean": [], "neutral_sum": [], "neutral_mean": [], "rerun_diff": 0.0}
               for v in VARIANTS}
        naive = {"latency_s": [], "pred": [], "invalid": 0}
        for i, item in enumerate(items):
            spec = st["tasks"][item["task"]]
            for method in methods[i % len(methods):] + methods[:i % len(methods)]:
                if method == "json_route":
                    # llama-cpp-python's chat completion with a JSON response format listing the labels
                    task = variant_task("label", spec, item["text"])
                    schema = label_schema(task)
                    t0 = time.perf_counter()
                    done = llm.create_chat_completion(classify_messages(task), max_tokens=24, temperature=0,
                                                      response_format={"type": "json_object", "schema": schema})
                    naive["latency_s"].append(time.perf_counter() - t0)
                    try:
                        label = json.loads(done["choices"][0]["message"]["content"])["label"]
                    except (ValueError, KeyError, TypeError):
                        label = None
                        naive["invalid"] += 1
                    naive["pred"].append(label)
                    continue
                r, task = runners[method], variant_task(method, spec, item["text"])
                t0 = time.perf_counter()
                result = r.run(task)  # as a worker runs it: the task's own options
                rec[method]["latency_s"].append(time.perf_counter() - t0)
                assert result.status == "ok", result.error
                # every option's probabilities from one more pass over the same prompt (its KV cache reused)
                scores = r._label_scores(task, task.input, [], {}, {})
                names = spec["labels"]
                for key, norm in (("sum", False), ("mean", True)):
                    probs = _probabilities(scores, norm)
                    neutral = r._neutral_probs(task.model_copy(update={"length_norm": norm}), [])
                    rec[method][key].append([float(x) for x in probs])
                    rec[method]["neutral_" + key].append([float(x) for x in neutral])
                    if norm == task.length_norm:
                        got = calibrated(probs, neutral) if calibrates(task) else probs
                        diff = max(abs(float(got[j]) - result.output.probabilities[n_]) for j, n_ in enumerate(names))
                        rec[method]["rerun_diff"] = max(rec[method]["rerun_diff"], diff)
        raw[st["set"]] = {"meta": {k: st[k] for k in ("what", "license", "package") if k in st},
                          "gold": [it["label"] for it in items],
                          "labels": [st["tasks"][it["task"]]["labels"] for it in items],
                          "json_route": naive, "variants": rec}
        entry = summarise(raw[st["set"]])
        print(st["set"], json.dumps({v: e["configs"]["sum+calibrated"]["accuracy"] for v, e in entry["variants"].items()}),
              "json route", entry["json_route"]["accuracy"], file=sys.stderr)
    RAW_DIR.mkdir(parents=True, exist_ok=True)
    (RAW_DIR / f"tasks-{path.stem}.json").write_text(json.dumps(raw))
    for nd in nodes:
        nd.close()
    return {name: summarise(r) for name, r in raw.items()}


def summarise(raw: dict) -> dict:
    """One set's figures from its raw record: the JSON route's, and every variant's in every configuration
    (accuracy, SE, macro-F1, ECE of the top label), multi-label's per-label ECE, tasks/s."""
    from benchmarks.stats import accuracy_se, expected_calibration_error, macro_f1
    from nodeagent.tasks.runner import calibrated

    gold, naive, n = raw["gold"], raw["json_route"], len(raw["gold"])
    naive_total = sum(naive["latency_s"])
    acc, se = accuracy_se(sum(p == g for p, g in zip(naive["pred"], gold)), n)
    entry = {**raw["meta"], "items": n,
             "json_route": {"tasks_per_s": round(n / naive_total, 3), "p50_s": round(pct(naive["latency_s"], .5), 4),
                            "accuracy": round(acc, 4), "se": round(se, 4),
                            "macro_f1": round(macro_f1(gold, naive["pred"]), 4), "invalid": naive["invalid"]},
             "variants": {}}
    for v, d in raw["variants"].items():
        total = sum(d["latency_s"])
        configs = {}
        for c, (cal, norm) in CONFIGS.items():
            key = "mean" if norm else "sum"
            pred, conf = [], []
            for names, probs, neutral in zip(raw["labels"], d[key], d["neutral_" + key]):
                probs = np.array(probs)
                if cal:
                    probs = calibrated(probs, np.array(neutral))
                pred.append(names[int(probs.argmax())])
                conf.append(float(probs.max()))
            correct = [p == g for p, g in zip(pred, gold)]
            acc, se = accuracy_se(sum(correct), n)
            configs[c] = {"accuracy": round(acc, 4), "se": round(se, 4), "macro_f1": round(macro_f1(gold, pred), 4),
                          "ece": round(expected_calibration_error(conf, correct), 4)}
        # multi-label, per label: each (item, label) pair a yes/no case, the label's own probability
        multi = {"calibrated": ([], []), "uncalibrated": ([], [])}
        for names, probs, neutral, g in zip(raw["labels"], d["sum"], d["neutral_sum"], gold):
            for k, own in (("calibrated", calibrated(np.array(probs), np.array(neutral))), ("uncalibrated", probs)):
                multi[k][0].extend(map(float, own))
                multi[k][1].extend(n_ == g for n_ in names)
        entry["variants"][v] = {
            "tasks_per_s": round(n / total, 3), "p50_s": round(pct(d["latency_s"], .5), 4),
            "p95_s": round(pct(d["latency_s"], .95), 4),
            "speedup_vs_json_route": round((n / total) / (n / naive_total), 2), "configs": configs,
            "multi_label_ece_per_label": {k: round(expected_calibration_error(*pairs), 4) for k, pairs in multi.items()},
            "rerun_max_abs_diff": round(d["rerun_diff"], 6)}
    return entry


def multi_label_run(runner, n_pairs: int) -> dict:
    """The default multi-label task over ``multi_label_items``: what the runner chose, and every item's label
    shares and the content-free inputs' (the raw record ``summarise_multi`` reads)."""
    from nodeagent.tasks.runner import _probabilities, threshold

    labels, items = multi_label_items(n_pairs)
    rec: dict = {"labels": labels, "gold": [], "probs": [], "chosen": [], "latency_s": []}
    task = None
    for it in items:
        task = ClassifyTask(input=it["text"], labels=labels, multi_label=True)  # every other option its default
        t0 = time.perf_counter()
        result = runner.run(task)
        rec["latency_s"].append(time.perf_counter() - t0)
        assert result.status == "ok", result.error
        rec["chosen"].append(sorted(result.output.labels))
        rec["gold"].append(it["labels"])
        rec["probs"].append([float(x) for x in _probabilities(runner._label_scores(task, task.input, [], {}, {}),
                                                              task.length_norm)])
    rec["neutral"] = [float(x) for x in runner._neutral_probs(task, [])]
    rec["threshold"], rec["threshold_setting"], rec["calibrate"] = threshold(task), task.threshold, task.calibrate
    return rec


# multi-label's per-label forms that do not sum to 1, measured against the default on the same scores (a the
# label's share of the answer under the text, b under the content-free inputs, K labels)
PER_LABEL_FORMS = {
    # the label's odds under the text over its odds under the content-free inputs, times the odds 1 to K - 1
    # of a label that the prompt does not favour
    "odds_ratio": lambda a, b: 1 / (1 + np.exp(-(np.log(a / (1 - a)) - np.log(b / (1 - b)) - np.log(a.shape[-1] - 1)))),
    # the ratio of the shares at prior odds 1 to K - 1 (the default before this measurement)
    "share_ratio": lambda a, b: a / (a + (a.shape[-1] - 1) * b),
    "even_odds": lambda a, b: a / (a + b),  # the ratio of the shares at even odds (the one before that)
}
MULTI_THRESHOLDS = (0.2, 0.3, 0.4, 0.5)


def summarise_multi(rec: dict) -> dict:
    """Per-label ECE (each (text, label) a yes/no case), how often the chosen labels are exactly the text's, how
    often both labels of a two-label text are chosen, and the chosen labels' precision and recall: the runner's
    probabilities calibrated (its default) and uncalibrated, and the per-label forms that do not sum to 1; the
    calibrated ones also at other thresholds."""
    from benchmarks.stats import expected_calibration_error
    from nodeagent.tasks.runner import calibrated

    labels, gold = rec["labels"], rec["gold"]
    truth = np.array([[lb in g for lb in labels] for g in gold])
    pairs = np.array([len(g) == 2 for g in gold])
    out = {"texts": len(gold), "two_label_texts": int(pairs.sum()), "threshold": rec["threshold"],
           "threshold_setting": rec.get("threshold_setting", rec["threshold"]),
           "default_calibrate": rec["calibrate"],
           "tasks_per_s": round(len(gold) / sum(rec["latency_s"]), 3),
           "default_exact_match": round(float(np.mean([c == g for c, g in zip(rec["chosen"], gold)])), 4)}
    shares, neutral = np.array(rec["probs"]), np.array(rec["neutral"])
    a, b = np.clip(shares, 1e-12, 1 - 1e-12), np.clip(neutral, 1e-12, 1 - 1e-12)

    def chosen_figures(chosen: np.ndarray) -> dict:
        hits = (chosen & truth).sum()
        return {"exact_match": round(float((chosen == truth).all(axis=1).mean()), 4),
                "both_found": round(float(((chosen & truth).sum(axis=1)[pairs] == 2).mean()), 4),
                "precision": round(float(hits / max(chosen.sum(), 1)), 4), "recall": round(float(hits / truth.sum()), 4)}

    forms = {"uncalibrated": shares, "calibrated": np.array([calibrated(row, neutral) for row in shares]),
             **{k: f(a, b) for k, f in PER_LABEL_FORMS.items()}}
    for key, probs in forms.items():
        out[key] = {"ece_per_label": round(expected_calibration_error(list(map(float, probs.ravel())),
                                                                      list(truth.ravel())), 4),
                    **chosen_figures(probs >= rec["threshold"])}
    out["calibrated_by_threshold"] = {str(t): chosen_figures(forms["calibrated"] >= t) for t in MULTI_THRESHOLDS}
    out["ece_halved"] = bool(out["calibrated"]["ece_per_label"] <= out["uncalibrated"]["ece_per_label"] / 2)
    return out
