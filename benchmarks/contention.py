"""A worker on a machine that does other work: tasks/s with the cores free, and with one competing process
busy on one core, under each way of running llama.cpp's threads.

On a person's Mac or a Pi that does other work, the worker shares its cores. llama.cpp here is built with
OpenMP, whose idle threads spin before they sleep: with the default policy a thread that lost its core to
another process holds up every step. The variants, each a fresh `nodeagent worker --burst` process on SmolLM2
serving the same classifications and extractions (tasks/s from the tasks' own start and end times):

- ``default``: OMP_WAIT_POLICY unset (libgomp spins a while, then sleeps);
- ``passive``: OMP_WAIT_POLICY=PASSIVE (idle threads sleep at once);
- ``spin-N``: GOMP_SPINCOUNT=N (libgomp spins N times, then sleeps: llama.cpp's own thread-pool polling
  setting is not used in an OpenMP build, and llama-cpp-python does not reach it);
- ``threads-1``: one thread fewer than the plan's two;
- ``adaptive``: the worker's own default (NODEAGENT_THREADS_ADAPT): all threads while the cores are free,
  one thread fewer while other processes' CPU use says a core is taken.

The competing load is one process spinning in a loop, started before the worker and stopped after it. Rounds
alternate the order of the variants. The pick: the fastest variant under contention among those that cost at
most 3 % on a quiet machine, and the target is at most 2x slower under contention than quiet.

Usage: python benchmarks/contention.py [--rounds 2]   -> benchmarks/results/contention.json and .md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import read_results, write_results  # noqa: E402
from nodeagent.broker.open import open_broker  # noqa: E402
from nodeagent.client import Client  # noqa: E402
from nodeagent.config import load  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402
from nodeagent.tasks.contracts import ClassifyTask, ExtractTask  # noqa: E402

SCHEMA = json.loads((ROOT / "scripts/examples/person.schema.json").read_text())
QUIET_GUARD = {"NODEAGENT_GUARD_CPU_PCT": "1000", "NODEAGENT_GUARD_MEMORY_PCT": "1000"}
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NODEAGENT_THREADS", "NODEAGENT_THREADS_ADAPT")
VARIANTS: dict[str, dict[str, str]] = {
    "default": {"NODEAGENT_THREADS_ADAPT": "0"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "NODEAGENT_THREADS_ADAPT": "0"},
    "spin-10000": {"GOMP_SPINCOUNT": "10000", "NODEAGENT_THREADS_ADAPT": "0"},
    "threads-1": {"NODEAGENT_THREADS_ADAPT": "0"},
    "adaptive": {"NODEAGENT_THREADS_ADAPT": "1"},
}


def tasks(n: int) -> list:
    out: list = [ClassifyTask(input=f"Review {i}: {'great, loved it' if i % 2 else 'broken on arrival'}",
                              labels=["positive", "negative", "neutral"]) for i in range(n)]
    out += [ExtractTask(input=f"Person {i}: Maria Lopez is {20 + i} and lives in Porto.", schema=SCHEMA)
            for i in range(max(1, n // 4))]
    return out


def one_round(model: Path, variant: str, contended: bool, folder: Path, n: int, threads: int) -> float:
    url = f"sqlite://{folder / f'q-{variant}-{contended}-{time.monotonic_ns()}.db'}"
    client = Client(open_broker(url, folder))
    ids = [client.submit(t) for t in tasks(n)]
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env.update(QUIET_GUARD, NODEAGENT_HOME=str(folder / "home"), NODEAGENT_CTX="2048")  # the plan's threads
    env.update(VARIANTS[variant])
    if variant == "threads-1":
        env["NODEAGENT_THREADS"] = str(threads - 1)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if contended else None
    try:
        proc = subprocess.run([sys.executable, "-m", "nodeagent", "worker", "--model", str(model), "--burst",
                               "--broker", url], env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"the worker failed ({variant}, contended={contended}): {proc.stderr[-2000:]}")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    views = [client.broker.get(i) for i in ids]
    assert all(v.state in ("done", "dead") for v in views), "a task did not finish"
    start = min(v.history[0].started_at for v in views)
    end = max(v.history[-1].ended_at for v in views)
    return len(ids) / (end - start)


def analyse(rates: dict[str, dict[str, list[float]]], model: str, threads: int, rounds: int,
            per_round: int) -> dict:
    """Per variant, the medians, and two paired figures that the machine's noise moves less: its cost when
    quiet (1 - the median over rounds of its quiet rate over the default's in the same round) and its
    slowdown under contention (the median over rounds of its own quiet rate over its contended rate)."""
    med = {v: {c: statistics.median(x) for c, x in per.items()} for v, per in rates.items()}
    base = rates["default"]["quiet"]
    rows = {}
    for v, per in rates.items():
        quiet, busy = per["quiet"], per["contended"]
        rows[v] = {"quiet_tasks_per_s": round(med[v]["quiet"], 2), "contended_tasks_per_s": round(med[v]["contended"], 2),
                   "quiet_cost": round(1 - statistics.median(q / b for q, b in zip(quiet, base)), 4),
                   "contention_slowdown": round(statistics.median(q / c for q, c in zip(quiet, busy)), 2)}
    eligible = [v for v, row in rows.items() if row["quiet_cost"] <= 0.03]
    pick = max(eligible, key=lambda v: rows[v]["contended_tasks_per_s"])
    return {"model": model, "threads": threads, "rounds": rounds, "tasks_per_round": per_round,
            "tasks_per_s": rates, "variants": rows, "pick": pick,
            "pick_slowdown_under_contention": rows[pick]["contention_slowdown"],
            "target_met": rows[pick]["contention_slowdown"] <= 2.0 and rows[pick]["quiet_cost"] <= 0.03}


def markdown(data: dict) -> str:
    rows, pick = data["variants"], data["pick"]
    table = "".join(f"| {v} | {r['quiet_tasks_per_s']:.2f} | {0.0 - 100 * r['quiet_cost']:+.1f} % | "
                    f"{r['contended_tasks_per_s']:.2f} | x{r['contention_slowdown']:.2f} |\n" for v, r in rows.items())
    return (f"# A worker beside a busy core\n\n"
            f"One `nodeagent worker --burst` on {data['model']} ({data['threads']} threads on {data['threads']} "
            f"cores), {data['tasks_per_round']} tasks a round (classifications and extractions), {data['rounds']} "
            "rounds with the variants in alternating order; contended: one other process spinning on one core. The "
            "quiet change is the median over rounds of the variant's rate against the default's in the same "
            "round; the slowdown the median over rounds of its quiet rate over its contended one.\n\n"
            "| variant | median quiet tasks/s | quiet, against default | median contended tasks/s | slowdown "
            "under contention |\n| --- | --- | --- | --- | --- |\n" + table +
            f"\nThe pick (the fastest under contention among those costing at most 3 % when quiet): **{pick}**, "
            f"x{rows[pick]['contention_slowdown']:.2f} slower under contention (target at most 2x: "
            f"{'met' if data['target_met'] else 'not met'}). Load average before / after: {data.get('load_before')} / "
            f"{data.get('load_after')}.\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=16, help="classifications a round (and a quarter as many "
                                                          "extractions)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--analyse-only", action="store_true", help="Re-analyse the rates saved in "
                    "benchmarks/results/contention.json (no new measurement)")
    args = ap.parse_args()
    if args.analyse_only:
        saved = read_results("contention")
        data = analyse(saved["tasks_per_s"], saved["model"], saved["threads"], saved["rounds"],
                       saved["tasks_per_round"])
        data.update(load_before=saved.get("load_before"), load_after=saved.get("load_after"))
        write_results("contention", data, markdown(data))
        print(json.dumps(data["variants"]))
        return
    model = test_model_path("smollm2-135m-instruct", load().test_models_dir)
    threads = os.cpu_count() or 2
    names = args.variants.split(",")
    rates: dict[str, dict[str, list[float]]] = {v: {"quiet": [], "contended": []} for v in names}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for contended in (False, True):
                for variant in order:
                    rate = one_round(model, variant, contended, Path(tmp), args.tasks, threads)
                    rates[variant]["contended" if contended else "quiet"].append(rate)
                    print(json.dumps({"round": r, "variant": variant, "contended": contended,
                                      "tasks_per_s": round(rate, 2)}), flush=True)
    data = analyse(rates, model.name, threads, args.rounds, len(tasks(args.tasks)))
    data.update(load_before=round(load_before, 2), load_after=round(os.getloadavg()[0], 2))
    md = markdown(data)
    write_results("contention", data, md)
    print(json.dumps(data))


if __name__ == "__main__":
    main()
