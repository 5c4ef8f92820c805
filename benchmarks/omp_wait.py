"""OMP_WAIT_POLICY for a worker on the CPU: what PASSIVE (idle OpenMP threads sleep) costs one worker.

Whether a worker should set OMP_WAIT_POLICY=PASSIVE by default: on a shared machine, spinning threads of two
llama.cpp processes were measured to slow each other down by up to 100x. This measures the other side, the
cost to a single worker alone: one `nodeagent worker --burst` on SmolLM2 serves the same classifications and
extractions with PASSIVE and with the OpenMP default (the variable unset), in alternating rounds, each a fresh
process; tasks/s from the tasks' own start and end times. It would be the default only if it cost under 3 %.

Usage: python benchmarks/omp_wait.py [--rounds 4]   -> benchmarks/results/omp_wait.json and .md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nodeagent.broker.base import open_broker  # noqa: E402
from nodeagent.client import Client  # noqa: E402
from nodeagent.config import load  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402
from nodeagent.tasks.contracts import ClassifyTask, ExtractTask  # noqa: E402

SCHEMA = json.loads((ROOT / "scripts/examples/person.schema.json").read_text())
QUIET = {"NODEAGENT_GUARD_CPU_PCT": "1000", "NODEAGENT_GUARD_MEMORY_PCT": "1000"}


def one_round(model: Path, policy: str | None, folder: Path, n: int) -> float:
    url = f"sqlite://{folder / f'q-{policy}-{os.getpid()}-{len(list(folder.iterdir()))}.db'}"
    client = Client(open_broker(url, folder))
    tasks = [ClassifyTask(input=f"Review {i}: {'great, loved it' if i % 2 else 'broken on arrival'}",
                          labels=["positive", "negative", "neutral"]) for i in range(n)]
    tasks += [ExtractTask(input=f"Person {i}: Maria Lopez is {20 + i} and lives in Porto.", schema=SCHEMA)
              for i in range(n // 4)]
    ids = [client.submit(t) for t in tasks]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(QUIET, NODEAGENT_HOME=str(folder / "home"), NODEAGENT_CTX="2048")
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    subprocess.run([sys.executable, "-m", "nodeagent", "worker", "--model", str(model), "--burst", "--broker", url],
                   env=env,
                   check=True, capture_output=True)
    views = [client.broker.get(i) for i in ids]
    assert all(v.state in ("done", "dead") for v in views), "a task did not finish"  # a bad extraction is dead
    start = min(v.history[0].started_at for v in views)
    end = max(v.history[-1].ended_at for v in views)
    return len(ids) / (end - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tasks", type=int, default=40)
    args = ap.parse_args()
    model = test_model_path("smollm2-135m-instruct", load().test_models_dir)
    rates: dict[str, list[float]] = {"PASSIVE": [], "default": []}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ("PASSIVE", "default") if r % 2 == 0 else ("default", "PASSIVE")
            for policy in order:
                rate = one_round(model, None if policy == "default" else policy, Path(tmp), args.tasks)
                rates[policy].append(rate)
                print(json.dumps({"round": r, "policy": policy, "tasks_per_s": round(rate, 2)}), flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    cost = 1 - med["PASSIVE"] / med["default"]
    data = {"rounds": args.rounds, "tasks_per_round": args.tasks + args.tasks // 4, "tasks_per_s": rates,
            "median_tasks_per_s": {k: round(v, 2) for k, v in med.items()}, "passive_cost": round(cost, 4),
            "kept": cost < 0.03, "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}
    out = ROOT / "benchmarks/results"
    (out / "omp_wait.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "omp_wait.md").write_text(
        "# OMP_WAIT_POLICY=PASSIVE for one worker\n\n"
        f"One `nodeagent worker --burst` on SmolLM2-135M Q4_1 (2 threads), {data['tasks_per_round']} tasks a round "
        f"(classifications and extractions), {args.rounds} rounds alternating the order.\n\n"
        "| policy | median tasks/s | rounds |\n| --- | --- | --- |\n"
        + "".join(f"| {k} | {med[k]:.2f} | {', '.join(f'{x:.2f}' for x in v)} |\n" for k, v in rates.items())
        + f"\nPASSIVE costs this worker {100 * cost:.1f} % (a default only under 3 %): "
        f"{'set by default' if data['kept'] else 'not set by default'}. Load average before / after: {data['load_before']} / "
        f"{data['load_after']}.\n")
    print(json.dumps(data))


if __name__ == "__main__":
    main()
