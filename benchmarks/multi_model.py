"""Several models on one node, measured: SmolLM2 (Q4_1) and Gemma 3 270M (Q4_K_M) as one model set, each phase
in a fresh process.

- memory, together: both loaded in one process, a classification and an extraction on each, then each
  context filled; the peak (VmHWM) against the set's plan (the process overhead once, each model its plan
  less it), and, in the same run, each model alone against its own plan;
- memory, a budget for one: alternating tasks A, B, A, B with room for one model at a time, so every task
  loads its model and evicts the other; the peak against the larger single plan, and every label the same as
  the model gave without swapping (again under NODEAGENT_DETERMINISTIC, where a greedy answer does not depend
  on what ran before it);
- time to the first result of a model not yet loaded, against one already loaded;
- throughput of alternating classifications across both models when both fit, against two plain nodes (one
  a model) in the same process, rounds taking turns (target: within 5 %); and with room for one (reported,
  with the number of swaps).

Usage: python benchmarks/multi_model.py [--tasks 200] [--rounds 3]  -> benchmarks/results/multi_model.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import write_results  # noqa: E402

CTX = 2048
SCHEMA = {"type": "object", "required": ["name", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 40}}}


def models() -> list[str]:
    from nodeagent.config import load
    from nodeagent.store.pkgindex import test_model_path

    d = load().test_models_dir
    return [str(test_model_path("smollm2-135m-instruct", d)), str(test_model_path("gemma-3-270m-it", d))]


def items(n: int) -> list[tuple[str, list[str]]]:
    data = json.loads((ROOT / "benchmarks/data/labelled.json").read_text())
    return [(x["text"], data["tasks"][x["task"]]) for x in data["items"]][:n]


def make_set(paths: list[str], budget_bytes: int | None = None):  # noqa: ANN201
    from nodeagent.config import resolve
    from nodeagent.fleet.registration import routing_names
    from nodeagent.modelset import Member, ModelSet
    from nodeagent.node import Node

    config = resolve(env={**os.environ, "NODEAGENT_CTX": str(CTX)})
    nodes = [Node(p, config=config) for p in paths]
    members = [Member(name=p, node=n, names=set(routing_names(n))) for p, n in zip(paths, nodes)]
    return ModelSet(members, budget_bytes=budget_bytes, keep_alive_s=3600, wait_s=60)


def fill(node) -> None:  # noqa: ANN001
    """Every cell of the context written once (the KV cache's pages touched), as the planner charges them."""
    s = node.runner().session
    vocab = s.n_vocab
    tokens = [(i * 7919) % (vocab - 300) + 256 for i in range(s.ctx_per_slot - 8)]
    s.truncate(0)
    s.prefill(tokens)  # the logits of the last token only
    s.truncate(0)


# -- the phases (each in a fresh process) ------------------------------------------------------------------
def phase_memory(which: str) -> dict:
    from nodeagent.planner.modelset import plan_set
    from nodeagent.procmem import process_memory
    from nodeagent.tasks.contracts import ClassifyTask, ExtractTask

    paths = models()
    chosen = paths if which == "together" else [paths[int(which)]]
    s = make_set(chosen)
    for m in s.members:
        s.acquire(m)
        s.release(m)
    text, labels = items(1)[0]
    for m in s.members:
        assert s.run(ClassifyTask(input=text, labels=labels), model=m.name).status == "ok"
        assert s.run(ExtractTask(input="Ana Lima lives in Porto.", schema=SCHEMA), model=m.name).status == "ok"
        fill(m.node)
    planned = plan_set([m.name for m in s.members], [m.node.plan for m in s.members]).total_bytes
    peak = process_memory().peak_rss_bytes
    return {"phase": f"memory-{which}", "planned_bytes": planned, "peak_bytes": peak, "ratio": planned / peak}


def phase_swaps(n: int) -> dict:
    from nodeagent.planner.modelset import added_bytes
    from nodeagent.procmem import process_memory
    from nodeagent.tasks.contracts import ClassifyTask

    paths = models()
    s = make_set(paths)
    single = max(m.node.plan.memory.total_bytes for m in s.members)
    budget = s.overhead_bytes + max(added_bytes(m.node.plan) for m in s.members)  # room for one, not both
    s.budget_bytes = budget
    work = items(n)
    labels: dict[tuple[int, str], str] = {}
    t0 = time.perf_counter()
    for i, (text, names) in enumerate(work):
        m = s.members[i % 2]
        r = s.run(ClassifyTask(input=text, labels=names), model=m.name)
        labels[(i, m.name)] = r.output.label
    seconds = time.perf_counter() - t0
    peak = process_memory().peak_rss_bytes
    swaps = sum(m.loads for m in s.members)
    s.close()
    # the same tasks with both loaded: a swap must not change an answer
    both = make_set(paths)
    same = sum(both.run(ClassifyTask(input=text, labels=names), model=both.members[i % 2].name).output.label
               == labels[(i, both.members[i % 2].name)] for i, (text, names) in enumerate(work))
    return {"phase": "swaps", "tasks": n, "loads": swaps, "seconds": seconds, "peak_bytes": peak,
            "single_plan_bytes": single, "budget_bytes": budget, "peak_over_single_plan": peak / single,
            "labels_same_as_without_swaps": same}


def phase_first_result() -> dict:
    from nodeagent.tasks.contracts import ClassifyTask

    paths = models()
    s = make_set(paths)
    text, names = items(1)[0]
    out = {}
    for m in s.members:
        t0 = time.perf_counter()
        s.run(ClassifyTask(input=text, labels=names), model=m.name)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        s.run(ClassifyTask(input=text, labels=names), model=m.name)
        warm = time.perf_counter() - t0
        out[Path(m.name).name] = {"not_loaded_s": cold, "loaded_s": warm}
    return {"phase": "first-result", "models": out}


def phase_throughput(n: int, rounds: int) -> dict:
    from nodeagent.config import resolve
    from nodeagent.node import Node
    from nodeagent.tasks.contracts import ClassifyTask

    paths = models()
    s = make_set(paths)
    config = resolve(env={**os.environ, "NODEAGENT_CTX": str(CTX)})
    plain = [Node(p, config=config) for p in paths]
    work = items(n)
    runs = []
    for r in range(rounds):
        for side in (("set", "plain") if r % 2 == 0 else ("plain", "set")):
            t0 = time.perf_counter()
            for i, (text, names) in enumerate(work):
                task = ClassifyTask(input=text, labels=names)
                if side == "set":
                    s.run(task, model=s.members[i % 2].name)
                else:
                    plain[i % 2].run(task)
            runs.append({"round": r, "side": side, "seconds": time.perf_counter() - t0})
    set_s = sorted(x["seconds"] for x in runs if x["side"] == "set")[rounds // 2]
    plain_s = sorted(x["seconds"] for x in runs if x["side"] == "plain")[rounds // 2]
    return {"phase": "throughput", "tasks": n, "runs": runs, "set_s": set_s, "plain_s": plain_s,
            "ratio": set_s / plain_s}


def child(args: list[str], env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(data: dict) -> str:
    r = {p["phase"]: p for p in data["phases"]}
    t, sw, fr = r["memory-together"], r["swaps"], r["first-result"]["models"]
    lines = [f"# Two models on one node: SmolLM2 and Gemma 3 (ctx {CTX}), each phase in a fresh process", "",
             "| phase | planned | peak | planned / peak |", "| --- | --- | --- | --- |"]
    for key in ("memory-0", "memory-1", "memory-together"):
        p = r[key]
        lines.append(f"| {key} | {p['planned_bytes'] / 2**20:.0f} MiB | {p['peak_bytes'] / 2**20:.0f} MiB | "
                     f"x{p['ratio']:.3f} |")
    lines += ["", f"Budget for one: {sw['tasks']} alternating tasks, {sw['loads']} loads, peak "
                  f"{sw['peak_bytes'] / 2**20:.0f} MiB against the larger single plan of "
                  f"{sw['single_plan_bytes'] / 2**20:.0f} MiB (x{sw['peak_over_single_plan']:.3f}), labels the same "
                  f"as without swaps {sw['labels_same_as_without_swaps']}/{sw['tasks']}, {sw['seconds']:.1f} s; "
                  f"under NODEAGENT_DETERMINISTIC {r['swaps-deterministic']['labels_same_as_without_swaps']}/"
                  f"{sw['tasks']}.", "",
              "| model | first result, not loaded | loaded |", "| --- | --- | --- |"]
    for name, v in fr.items():
        lines.append(f"| {name} | {v['not_loaded_s']:.3f} s | {v['loaded_s']:.3f} s |")
    tp = r["throughput"]
    lines += ["", f"{tp['tasks']} alternating classifications, both loaded: the set x{tp['ratio']:.3f} the time of two "
                  f"plain nodes (median of {len(tp['runs']) // 2} rounds each, taking turns; target within 5 %)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--swaps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs="+")
    ap.add_argument("--ctx", type=int, default=CTX, help="Context per model (memory_accuracy.py runs the together "
                                                         "case at each of its contexts)")
    args = ap.parse_args()
    globals()["CTX"] = args.ctx
    if args.child:
        kind, *rest = args.child
        fn = {"memory": lambda: phase_memory(rest[0]), "swaps": lambda: phase_swaps(int(rest[0])),
              "first": phase_first_result, "throughput": lambda: phase_throughput(int(rest[0]), int(rest[1]))}[kind]
        print(json.dumps(fn()))
        return
    # the swaps again under NODEAGENT_DETERMINISTIC: tells a label changed by the swap from one changed by
    # what ran before it (cells and batch shapes of earlier tasks)
    exact = {**child(["swaps", str(args.swaps)], {"NODEAGENT_DETERMINISTIC": "1"}), "phase": "swaps-deterministic"}
    phases = [child(["memory", "0"]), child(["memory", "1"]), child(["memory", "together"]),
              child(["swaps", str(args.swaps)]), exact, child(["first"]),
              child(["throughput", str(args.tasks), str(args.rounds)])]
    data = {"ctx": CTX, "phases": phases}
    write_results("multi_model", data, markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
