"""Warm affinity in a fleet, simulated: 4 nodes, 20 recurring prefixes, tasks arriving at random.

Each node serves one task at a time and holds the prefixes of its last few tasks warm (``--warm-keys``, the
worker's ``WarmKeys``): a task whose prefix the node holds takes a warm task's time, any other a fresh one's. The
times are what ``benchmarks/warm_prefixes.py`` measured for the synthetic 1B model (the one whose prefill is closest
to a Pi's here) with a 1,000-token prefix: its results file is read, not copied. Tasks are claimed oldest first; a
node decides whether to leave a task to a warm node with the worker's own function (``fleet/affinity.leave_to``),
and a task it leaves goes back to the end of the queue, as the broker's release puts it. Each policy runs on the
same arrivals (seeded): no preference (bound 0) and bounds of 2, 5, 15 and 60 s (5: the default), at two loads.

What it does not model: the heartbeat's delay before a node's warm keys reach the others (instant here), the round
trips of a claim given back (milliseconds against seconds of prefill), a node's disk holding more prefixes than
its last tasks'.

Usage: python benchmarks/warm_affinity.py [--tasks 4000] [--warm-keys 5]
   -> benchmarks/results/warm_affinity.json and .md
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import read_results, write_results  # noqa: E402
from nodeagent.fleet.affinity import Peer, WarmKeys, leave_to  # noqa: E402

NODES = 4
PREFIXES = 20
BOUNDS_S = [0.0, 2.0, 5.0, 15.0, 60.0]


def service_times() -> tuple[float, float]:
    """(warm s, fresh s) of a task with the synthetic 1B's 1,000-token prefix, as measured."""
    row = next(r for r in read_results("warm_prefixes")["rows"]
               if r["model"] == "synthetic" and r["prefix_tokens"] == 1000)
    return row["warm_s"], row["fresh_s"]


def simulate(arrivals: list[tuple[float, str]], bound_s: float, warm_s: float, fresh_s: float,
             warm_keys: int) -> dict:
    """Event by event: a node that is free claims the oldest task it does not leave to a warm node."""
    held = {n: WarmKeys(warm_keys) for n in range(NODES)}
    busy_until = dict.fromkeys(range(NODES), 0.0)
    queue: list[tuple[float, int, str]] = []  # (arrival, id, key), oldest first
    events: list[tuple[float, int]] = []  # (time, kind 0: arrival / 1: a node free or a task at its bound)
    for i, (t, _) in enumerate(arrivals):
        heapq.heappush(events, (t, 0))
        heapq.heappush(events, (t + bound_s, 1))
    nxt, waits, warm_runs = 0, [], 0
    while events:
        now, kind = heapq.heappop(events)
        while nxt < len(arrivals) and arrivals[nxt][0] <= now:
            queue.append((arrivals[nxt][0], nxt, arrivals[nxt][1]))
            nxt += 1
        for n in sorted(range(NODES), key=lambda n: busy_until[n]):  # the longest free first
            if busy_until[n] > now or not queue:
                continue
            peers = [Peer(str(m), frozenset(held[m].keys())) for m in range(NODES) if m != n]
            for j, (arrived, tid, key) in enumerate(queue):
                if leave_to(key, now - arrived, held[n], peers, bound_s) is None:
                    break
            else:  # every task waiting is left to a warm node: this one waits for the next event
                continue
            arrived, tid, key = queue.pop(j)
            warm = key in held[n]
            warm_runs += warm
            waits.append(now - arrived)
            held[n].ran(key)
            busy_until[n] = now + (warm_s if warm else fresh_s)
            heapq.heappush(events, (busy_until[n], 1))
    waits.sort()

    def q(p: float) -> float:
        return round(waits[min(len(waits) - 1, int(p * len(waits)))], 2)

    return {"bound_s": bound_s, "tasks": len(waits), "warm_share": round(warm_runs / len(waits), 3),
            "wait_p50_s": q(0.50), "wait_p95_s": q(0.95), "wait_max_s": round(waits[-1], 2)}


def arrivals_at(rate_per_s: float, n: int, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append((t, f"p{rng.randrange(PREFIXES)}"))
    return out


def markdown(d: dict) -> str:
    lines = ["# Warm affinity in a fleet (simulated)", "",
             f"{NODES} nodes of one slot, {PREFIXES} recurring prefixes equally likely, Poisson arrivals; a node "
             f"holds its last {d['warm_keys']} tasks' prefixes warm. A task takes {d['warm_s']} s warm and "
             f"{d['fresh_s']} s fresh (the synthetic 1B with a 1,000-token prefix, benchmarks/warm_prefixes.py). "
             f"{d['tasks']} tasks per run, the same arrivals for every bound. Bound 0 is no preference; the wait is "
             "from arrival to the start of the task.", "",
             "| load (tasks/s) | bound s | warm share | wait p50 s | wait p95 s | wait max s |",
             "|---|---|---|---|---|---|"]
    for r in d["runs"]:
        lines.append(f"| {r['rate_per_s']} | {r['bound_s']:g} | {r['warm_share']} | {r['wait_p50_s']} | "
                     f"{r['wait_p95_s']} | {r['wait_max_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=4000)
    ap.add_argument("--warm-keys", type=int, default=5)
    args = ap.parse_args()
    warm_s, fresh_s = service_times()
    runs = []
    # the loads: a fleet that keeps up without the preference (about 2/3 busy when every task is fresh), and one
    # that would not keep up with fresh tasks alone
    for rate in (round(0.66 * NODES / fresh_s, 3), round(1.2 * NODES / fresh_s, 3)):
        arrivals = arrivals_at(rate, args.tasks, seed=7)
        for bound in BOUNDS_S:
            runs.append({"rate_per_s": rate, **simulate(arrivals, bound, warm_s, fresh_s, args.warm_keys)})
    d = {"warm_keys": args.warm_keys, "warm_s": warm_s, "fresh_s": fresh_s, "tasks": args.tasks, "runs": runs}
    write_results("warm_affinity", d, markdown(d))
    print(markdown(d))


if __name__ == "__main__":
    main()
