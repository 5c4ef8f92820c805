"""The route a classify task gets when it names no model, against each single route, on the same items.

One model set in process (``fleet.registration.model_set``, as ``serve --model A --model B`` builds it):
all-MiniLM-L6-v2 (F32) and SmolLM2 135M. For each set (the project's sentiment and topic texts, Rotten Tomatoes
and BBC News pinned by sha256: benchmarks/public_sets.py) and each number of worked examples a label (0, 2, 4, 8,
16; drawn once with a fixed seed from the set's other items, never an evaluated one; a count past the 64 examples
a task holds is left out), the same ``--items`` items are classified three ways through ``ModelSet.run``:

- **embeddings**: the task bound to the embedding model (centroids of the examples, or zero-shot);
- **label scoring**: bound to SmolLM2 (the examples as turns of the prompt);
- **unnamed**: no model, so the set measures the routes on the task's examples (nodeagent/classify_routes.py)
  and answers by the best (without examples, the embedding model, by default).

Reported: accuracy ± SE over the items, the top label's ECE (10 bins), tasks/s (one at a time; the unnamed route's
measurement, once per label set, reported apart in seconds, and what it chose with its held-out accuracy), and
whether the unnamed route is within one SE of the better single route.

Usage: python benchmarks/classify_routes.py [--items 40] -> benchmarks/results/classify_routes.json and .md
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

from benchmarks.embed_classify import labels_of, model_path, tasks_of  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402
from benchmarks.task_inputs import labelled_sets  # noqa: E402

SHOTS = (0, 2, 4, 8, 16)
MAX_EXAMPLES = 64  # ClassifyTask.examples' bound
ROUTES = ("embeddings", "label scoring", "unnamed")


def ece(confidence: list[float], right: list[bool], bins: int = 10) -> float:
    from nodeagent.classify_routes import ece as ece_of

    return round(ece_of(np.array(confidence), np.array(right)), 4)


def draw_examples(group: dict, per_label: int, evaluated: list[dict], seed: int = 9) -> list[dict] | None:
    """``per_label`` examples of each label from the set's items that are not evaluated; None where a label has
    fewer."""
    rng = random.Random(seed * 100 + per_label)
    texts = {it["text"] for it in evaluated}
    out = []
    for lb in group["labels"]:
        pool = [it for it in group["pool"] if it["label"] == lb and it["text"] not in texts]
        if len(pool) < per_label:
            return None
        out += [{"text": it["text"], "label": lb} for it in rng.sample(pool, per_label)]
    return out


def run_route(models, route: str, names: dict[str, str], group: dict, items: list[dict], examples: list[dict]
              ) -> dict:
    from nodeagent.node import make_task

    right, confidence, notes, errors = [], [], [], {}
    started = time.perf_counter()
    measured_s = 0.0
    for i, it in enumerate(items):
        task = make_task("classify", input=it["text"], labels=labels_of(group), examples=examples)
        t0 = time.perf_counter()
        r = models.run(task, model=names.get(route))
        if i == 0 and route == "unnamed":  # the measurement is made at the first task of a label set
            measured_s = time.perf_counter() - t0
        ok = r.status == "ok"
        if not ok:
            errors[r.error.code] = errors.get(r.error.code, 0) + 1
        right.append(ok and r.output.label == it["label"])
        confidence.append(max(r.output.probabilities.values()) if ok else 0.0)
        notes = r.notes
    elapsed = time.perf_counter() - started - measured_s
    n = len(items)
    p = sum(right) / n
    out = {"accuracy": round(p, 4), "se": round(math.sqrt(p * (1 - p) / n), 4), "ece": ece(confidence, right),
           "tasks_per_s": round((n - (1 if measured_s else 0)) / max(elapsed, 1e-9), 2), "errors": errors}
    if route == "unnamed":
        said = next((x for x in notes if x.startswith(("route measured", "route:"))), "")
        out["measured_s"] = round(measured_s, 1)
        out["chose"] = said.split("): ", 1)[1].split(" answered")[0] if said.startswith("route measured") else \
            said.split(",")[0].removeprefix("route: ") + " (by default)"
        out["note"] = said
    return out


def markdown(d: dict) -> str:
    lines = ["# The unnamed classify route against each single route", "",
             f"{d['machine']}, {d['when']}; up to {d['items']} items a set (at most half of it: the other half gives "
             "the examples), the same for every route and number of examples; "
             "all-MiniLM-L6-v2 F32 (embeddings) and SmolLM2 135M Q4_1 (label scoring) in one model set, through "
             "`ModelSet.run`. Accuracy ± SE, the top label's ECE, tasks/s (the unnamed route's: after its "
             "measurement, whose seconds are given apart). `python benchmarks/classify_routes.py`.", ""]
    for s, rows in d["table"].items():
        lines += [f"## {s}", "", "| examples a label | embeddings | label scoring | unnamed | the unnamed chose "
                  "(measured) | within one SE of the better |", "|---|---|---|---|---|---|"]
        for shots, row in rows.items():
            def cell(x: dict) -> str:
                failed = ", ".join(f"{n} {code}" for code, n in x.get("errors", {}).items())
                return (f"{x['accuracy']:.3f} ± {x['se']:.3f}, ECE {x['ece']:.3f}, {x['tasks_per_s']}/s"
                        + (f" ({failed}: counted wrong)" if failed else ""))
            u = row["unnamed"]
            lines.append(f"| {shots} | {cell(row['embeddings'])} | {cell(row['label scoring'])} | {cell(u)} | "
                         f"{u['chose']} ({u['measured_s']} s) | {'yes' if row['within_one_se'] else 'no'} |")
        lines.append("")
    met = sum(r["within_one_se"] for rows in d["table"].values() for r in rows.values())
    total = sum(len(rows) for rows in d["table"].values())
    lines.append(f"The unnamed route within one SE of the better single route: {met} of {total} rows.")
    if d.get("skipped"):
        lines += ["", "Not run: " + "; ".join(d["skipped"]) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=40, help="items of each set evaluated")
    ap.add_argument("--shots", default=",".join(map(str, SHOTS)))
    args = ap.parse_args()
    from nodeagent.config import resolve
    from nodeagent.fleet.registration import model_set
    from nodeagent.node import Node

    config = resolve(env=dict(os.environ))  # (as a node runs: the slots' cells reused between tasks)
    groups = tasks_of(labelled_sets(["rotten_tomatoes", "bbc_news"]), 200)
    emb, gen = model_path("minilm"), model_path("smollm2")
    nodes = [Node(emb, config=config, task="classify"), Node(gen, config=config, task="classify")]
    models = model_set(nodes, set(), config)
    names = {"embeddings": emb, "label scoring": gen}
    table: dict = {}
    skipped: list[str] = []
    try:
        for g in groups:
            # at most half of a set's items evaluated: the other half is where the examples come from
            items = random.Random(3).sample(g["items"], min(args.items, len(g["pool"]) // 2))
            table[g["set"]] = {}
            for shots in (int(x) for x in args.shots.split(",")):
                examples = draw_examples(g, shots, items)
                if shots * len(g["labels"]) > MAX_EXAMPLES or examples is None:
                    skipped.append(f"{g['set']} at {shots} a label ("
                                   + ("past the 64 examples a task holds" if examples is not None else
                                      "a label has fewer items left") + ")")
                    continue
                row = {route: run_route(models, route, names, g, items, examples) for route in ROUTES}
                better = max((row["embeddings"], row["label scoring"]), key=lambda x: x["accuracy"])
                row["within_one_se"] = row["unnamed"]["accuracy"] >= better["accuracy"] - better["se"]
                table[g["set"]][str(shots)] = row
                print(g["set"], shots, {k: (v["accuracy"], v.get("chose")) for k, v in row.items()
                                        if isinstance(v, dict)}, flush=True)
    finally:
        models.close()
    d = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "when": time.strftime("%Y-%m-%d"),
         "items": args.items, "evaluated": {s: len(random.Random(3).sample(g["items"], min(args.items, len(g["pool"])
                                                                                          // 2)))
                                            for g in groups for s in [g["set"]]},
         "table": table, "skipped": skipped}
    write_results("classify_routes", d, markdown(d))
    print(markdown(d))


if __name__ == "__main__":
    main()
