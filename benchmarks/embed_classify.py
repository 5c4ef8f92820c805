"""Classification by embeddings against label scoring, on the same items: which is right more often, how fast.

Sets: the project's own labelled texts (sentiment, 3 labels; topic, 5) and two public sets pinned by sha256
(benchmarks/public_sets.py: rotten_tomatoes, 2 labels; bbc_news, 5 topics), ``--items`` of each public set drawn
with a fixed seed. Every label has the one-line description the sets carry.

Routes, each through the node as a user runs it (``Node.classify``, the task's defaults):
- **label scoring** on SmolLM2 135M and Gemma 3 270M (the LLM route: the labels scored after the prompt, with
  their descriptions, calibrated);
- **embeddings, zero-shot** on all-MiniLM-L6-v2 (the test model, F32): the text against each label's
  description;
- **embeddings, few-shot**: 2, 4, 8 and 16 worked examples per label (``examples``), drawn from the set's other
  items, ``--draws`` times each; each draw's examples are left out of its evaluation.

Reported per set and route: accuracy with its standard error (over the items; for few-shot, the mean over the
draws with the SE of that mean), tasks/s (one task at a time, after a warm-up), and the node's memory (its
plan's total and its process's resident set after the run). Two studies on the zero-shot vectors (the same
vectors the node computes, ``Node.embed``): the label template (name alone, ``name: description``, a sentence)
and the softmax's temperature (the one that minimises the log-loss over every set's items), which set
tasks/embedding.py's ``LABEL_TEMPLATE`` and ``TEMPERATURE``.

Usage: python benchmarks/embed_classify.py [--items 200] [--draws 5] [--llm-items 100]
   -> benchmarks/results/embed_classify.json and .md
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import write_results  # noqa: E402
from benchmarks.task_inputs import labelled_sets  # noqa: E402

SHOTS = (2, 4, 8, 16)
MAX_EXAMPLES = 64  # ClassifyTask.examples' bound
TEMPLATES = {"name": "{name}", "name: description": "{name}: {description}",
             "sentence": "A text about {name}: {description}."}
TEMPERATURES = (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.2)


def model_path(key: str) -> str:
    from nodeagent.config import resolve
    from nodeagent.store.pkgindex import test_model_path

    ids = {"smollm2": ("smollm2-135m-instruct", None), "gemma": ("gemma-3-270m-it", None),
           "minilm": ("all-minilm-l6-v2", "F32")}
    model_id, quant = ids[key]
    return str(test_model_path(model_id, Path(resolve(env=dict(os.environ))["test_models_dir"]), quant))


def tasks_of(sets: list[dict], n_public: int) -> list[dict]:
    """Each set's task as one group: its labels (with descriptions) and its items (text, label)."""
    out = []
    for st in sets:
        for name, spec in st["tasks"].items():
            items = [it for it in st["items"] if it["task"] == name]
            if st["set"] != "project":
                items = random.Random(5).sample(items, min(n_public, len(items)))
            out.append({"set": st["set"] if st["set"] != "project" else f"project {name}", "labels": spec["labels"],
                        "descriptions": spec["descriptions"], "items": items, "pool": [
                            it for it in st["items"] if it["task"] == name]})
    return out


def labels_of(group: dict) -> list[dict]:
    return [{"name": n, "description": group["descriptions"][n]} for n in group["labels"]]


def accuracy(right: list[bool]) -> tuple[float, float]:
    n = len(right)
    p = sum(right) / n
    return round(p, 4), round(math.sqrt(p * (1 - p) / n), 4)


def rss_mb() -> float:
    import psutil

    return round(psutil.Process().memory_info().rss / 1e6, 1)


def timed_rate(node, group: dict, n: int = 40, **task) -> float:
    """Tasks per second, one at a time, after two to warm up."""
    items = group["items"][:n + 2]
    for it in items[:2]:
        node.classify(it["text"], labels_of(group), **task)
    started = time.perf_counter()
    for it in items[2:]:
        node.classify(it["text"], labels_of(group), **task)
    return round((len(items) - 2) / (time.perf_counter() - started), 2)


def label_scoring(key: str, groups: list[dict], n_items: int, config) -> dict:
    from nodeagent.node import Node

    out = {}
    with Node(model_path(key), config=config, task="classify") as node:
        for g in groups:
            items = g["items"][:n_items]
            right = []
            for it in items:
                r = node.classify(it["text"], labels_of(g))
                right.append(r.status == "ok" and r.output.label == it["label"])
            acc, se = accuracy(right)
            out[g["set"]] = {"items": len(items), "accuracy": acc, "se": se, "tasks_per_s": timed_rate(node, g, 20)}
        memory = {"plan_mb": round(node.plan.memory.total_bytes / 1e6, 1), "rss_mb": rss_mb()}
    return {"sets": out, "memory": memory}


def template_study(node, groups: list[dict]) -> dict:
    """Zero-shot accuracy of each label template, from the node's own vectors; and the temperature that
    minimises the log-loss of the chosen template's probabilities over every set's items."""
    from nodeagent.tasks.embedding import unit

    def vectors(texts: list[str]) -> np.ndarray:
        return unit(np.array(node.embed(texts).output.vectors(), dtype=np.float32))

    found: dict = {"templates": {}, "temperature": {}}
    sims: dict[str, list] = {}
    for tname, template in TEMPLATES.items():
        per_set = {}
        for g in groups:
            labels = vectors([template.format(name=n, description=g["descriptions"][n]) for n in g["labels"]])
            texts = vectors([it["text"] for it in g["items"]])
            s = texts @ labels.T
            gold = np.array([g["labels"].index(it["label"]) for it in g["items"]])
            per_set[g["set"]] = accuracy(list(s.argmax(1) == gold))[0]
            sims.setdefault(tname, []).append((s, gold))
        found["templates"][tname] = {**per_set, "mean": round(float(np.mean(list(per_set.values()))), 4)}
    best = max(found["templates"], key=lambda t: found["templates"][t]["mean"])
    for temp in TEMPERATURES:
        losses = []
        for s, gold in sims[best]:
            z = s / temp
            z = z - z.max(1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(1, keepdims=True))
            losses.extend(-logp[np.arange(len(gold)), gold])
        found["temperature"][str(temp)] = round(float(np.mean(losses)), 4)
    found["best_template"] = best
    found["best_temperature"] = float(min(found["temperature"], key=lambda t: found["temperature"][t]))
    return found


def embeddings(groups: list[dict], draws: int, config) -> dict:
    from nodeagent.node import Node

    out: dict = {"zero_shot": {}, "few_shot": {}}
    with Node(model_path("minilm"), config=config) as node:
        study = template_study(node, groups)
        for g in groups:
            right = []
            for it in g["items"]:
                r = node.classify(it["text"], labels_of(g))
                right.append(r.status == "ok" and r.output.label == it["label"])
            acc, se = accuracy(right)
            out["zero_shot"][g["set"]] = {"items": len(right), "accuracy": acc, "se": se,
                                          "tasks_per_s": timed_rate(node, g)}
        for g in groups:
            per_k = {}
            for k in SHOTS:
                by_label = {n: [it for it in g["pool"] if it["label"] == n] for n in g["labels"]}
                if min(len(v) for v in by_label.values()) <= k:
                    per_k[str(k)] = {"skipped": f"a label has {min(len(v) for v in by_label.values())} items"}
                    continue
                if k * len(g["labels"]) > MAX_EXAMPLES:
                    per_k[str(k)] = {"skipped": f"{k * len(g['labels'])} examples: a classify.v1 task holds at most "
                                                f"{MAX_EXAMPLES}"}
                    continue
                accs = []
                for d in range(draws):
                    rng = random.Random(1000 * k + d)
                    shown = [it for n in g["labels"] for it in rng.sample(by_label[n], k)]
                    held = {id(it) for it in shown}
                    examples = [{"text": it["text"], "label": it["label"]} for it in shown]
                    evaluated = [it for it in g["items"] if id(it) not in held]
                    right = []
                    for it in evaluated:
                        r = node.classify(it["text"], labels_of(g), examples=examples)
                        right.append(r.status == "ok" and r.output.label == it["label"])
                    accs.append(sum(right) / len(right))
                rate = timed_rate(node, g, examples=examples)
                per_k[str(k)] = {"draws": draws, "accuracy": round(float(np.mean(accs)), 4),
                                 "se": round(float(np.std(accs, ddof=1) / math.sqrt(draws)), 4) if draws > 1 else None,
                                 "items": len(evaluated), "tasks_per_s": rate}
            out["few_shot"][g["set"]] = per_k
        out["memory"] = {"plan_mb": round(node.plan.memory.total_bytes / 1e6, 1), "rss_mb": rss_mb()}
    out["study"] = study
    return out


def markdown(d: dict) -> str:
    lines = ["# Classification by embeddings against label scoring", "",
             f"{d['machine']}, {d['when']}. Accuracy ± SE (one task at a time through the node, its defaults); "
             "tasks/s one task at a time. Few-shot: the mean of "
             f"{d['draws']} draws of examples per label, ± the SE of that mean.", "",
             "| set | " + " | ".join(d["routes"]) + " |", "|---|" + "---|" * len(d["routes"])]
    for s in d["sets"]:
        cells = []
        for route in d["routes"]:
            r = d["table"][s].get(route)
            cells.append("-" if not r else f"- ({r['skipped']})" if "skipped" in r else "-" if "accuracy" not in r else
                         f"{r['accuracy']:.3f} ± {r['se'] if r.get('se') is not None else '-'} ({r['tasks_per_s']}/s)")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    st = d["embeddings"]["study"]
    lines += ["", "Label templates, zero-shot (accuracy from the node's vectors): " + "; ".join(
        f"{t}: {v['mean']:.3f}" for t, v in st["templates"].items()) + f". Chosen: {st['best_template']}.",
        "Softmax temperature (mean log-loss over every item): " + "; ".join(
            f"{t}: {v}" for t, v in st["temperature"].items()) + f". Chosen: {st['best_temperature']:g}.", "",
        "Memory: " + "; ".join(f"{k}: plan {v['plan_mb']} MB, resident {v['rss_mb']} MB"
                               for k, v in d["memory"].items()), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=200, help="items of each public set")
    ap.add_argument("--llm-items", type=int, default=100, help="items of each set for label scoring")
    ap.add_argument("--draws", type=int, default=5)
    ap.add_argument("--llms", default="smollm2,gemma")
    args = ap.parse_args()
    from nodeagent.config import resolve

    config = resolve(env={**os.environ, "NODEAGENT_DETERMINISTIC": "1"})
    groups = tasks_of(labelled_sets(["rotten_tomatoes", "bbc_news"]), args.items)
    emb = embeddings(groups, args.draws, config)
    llms = {key: label_scoring(key, groups, args.llm_items, config) for key in args.llms.split(",") if key}
    routes = [f"label scoring, {k}" for k in llms] + ["embeddings, zero-shot"] + [f"embeddings, {k}-shot"
                                                                                  for k in SHOTS]
    table = {}
    for g in groups:
        s = g["set"]
        table[s] = {f"label scoring, {k}": v["sets"][s] for k, v in llms.items()}
        table[s]["embeddings, zero-shot"] = emb["zero_shot"][s]
        for k in SHOTS:
            table[s][f"embeddings, {k}-shot"] = emb["few_shot"][s][str(k)]
    d = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "when": time.strftime("%Y-%m-%d"),
         "draws": args.draws, "sets": [g["set"] for g in groups], "routes": routes, "table": table,
         "embeddings": emb, "llms": llms,
         "memory": {**{k: v["memory"] for k, v in llms.items()}, "all-MiniLM-L6-v2": emb["memory"]}}
    write_results("embed_classify", d, markdown(d))
    print(markdown(d))


if __name__ == "__main__":
    main()
