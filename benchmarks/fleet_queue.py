"""The queue, measured: nodeagent workers on SQLite and on Redis, 1, 2, 4 and 8 worker processes, with the
fake backend's 0 ms and 100 ms tasks; and, in the same run on the same Redis, RQ doing the same no-op and
100 ms jobs with the same numbers of workers.

- Throughput (tasks/s, end to end): the workers start and register first (so their start-up, staggered on
  2 cores, is not counted), then N tasks are queued at once; the clock runs from the first task's start to
  the last one's end, as each system records them.
- Dispatch latency (p50, p99): with the workers idle, tasks arrive one at a time, 10 ms apart; the latency is
  from the submission to the moment a worker starts the task.
- Scaling efficiency: throughput at N workers / (N x throughput at 1 worker).

A nodeagent "0 ms" task still runs the real task runner on the fake backend (prompt, tokens, label scores,
a typed Result): about 0.2 ms of work. The RQ job is a Python function that returns at once.

Usage: python benchmarks/fleet_queue.py [--quick] [--workers 1,2,4,8]
Writes benchmarks/results/queue.json and queue.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

# this file's name shadows the standard library's queue module (which redis-py imports): take its folder off
# the import path before anything else is imported
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import rewrite_markdown, write_results  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))

from conftest import RedisServer  # noqa: E402

from benchmarks.stats import pct  # noqa: E402
from nodeagent.broker.open import open_broker  # noqa: E402
from nodeagent.client import Client  # noqa: E402
from nodeagent.tasks.contracts import ClassifyTask  # noqa: E402

Q = "classify.v1"
QUIET = {"NODEAGENT_GUARD_CPU_PCT": "1000", "NODEAGENT_GUARD_MEMORY_PCT": "1000", "OMP_WAIT_POLICY": "PASSIVE"}




def tasks(n: int) -> list[ClassifyTask]:
    return [ClassifyTask(input=f"item {i}", labels=["yes", "no"]) for i in range(n)]


def nodeagent_workers(url: str, n: int, latency_ms: int, home: Path, burst: bool = True,
                      env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    model = f"fake:latency_ms={latency_ms}" if latency_ms else "fake"
    return [subprocess.Popen([sys.executable, "-m", "nodeagent", "worker", "--model", model, "--broker", url,
                              "--types", "classify", *(["--burst"] if burst else [])],
                             env={**os.environ, **QUIET, **(env or {}), "NODEAGENT_HOME": str(home / f"w{i}")},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(n)]


def fresh(engine: str, folder: Path, redis_url: str) -> str:
    if engine == "sqlite":
        db = folder / f"q-{time.monotonic_ns()}.db"
        return f"sqlite://{db}"
    import redis

    redis.Redis.from_url(redis_url).flushall()
    return redis_url


def nodeagent_throughput(engine: str, folder: Path, redis_url: str, n_workers: int, latency_ms: int,
                         n_tasks: int, env: dict[str, str] | None = None) -> dict:
    """``env``: settings for the workers and the producer alike (NODEAGENT_REDIS_MIN_REPLICAS)."""
    from nodeagent.config import resolve

    url = fresh(engine, folder, redis_url)
    client = Client(open_broker(url, folder, config=resolve({}, env or {})))
    procs = nodeagent_workers(url, n_workers, latency_ms, folder, burst=False, env=env)
    wait_until(lambda: sum(n.state == "ready" for n in client.broker.nodes()) >= n_workers)
    ids = [client.submit(t) for t in tasks(n_tasks)]
    wait_until(lambda: client.broker.outstanding([Q]) == 0, timeout_s=600)
    stop(procs)
    views = [client.broker.get(i) for i in ids]
    assert all(v.state == "done" for v in views), "a task was not done"
    start = min(v.history[0].started_at for v in views)
    end = max(v.history[-1].ended_at for v in views)
    nodes = {v.history[-1].node for v in views}
    client.close()
    return {"tasks": n_tasks, "seconds": round(end - start, 3), "tasks_per_s": round(n_tasks / (end - start), 1),
            "workers_that_served": len(nodes)}


def wait_until(ready, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout_s
    while not ready():
        if time.time() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.05)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(60)


def nodeagent_latency(engine: str, folder: Path, redis_url: str, n_workers: int, n_tasks: int = 100) -> dict:
    url = fresh(engine, folder, redis_url)
    client = Client(open_broker(url, folder))
    procs = nodeagent_workers(url, n_workers, 0, folder, burst=False)
    wait_until(lambda: sum(n.state == "ready" for n in client.broker.nodes()) >= n_workers)  # started, idle
    ids = []
    for t in tasks(n_tasks):
        ids.append(client.submit(t))
        time.sleep(0.01)
    waits = [client.wait(i, timeout=60).timings.queue_wait_s for i in ids]
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(60)
    client.close()
    return {"p50_ms": round(1000 * pct(waits, 0.5), 2), "p99_ms": round(1000 * pct(waits, 0.99), 2)}


def rq_workers(redis_url: str, n_workers: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-m", "rq.cli", "worker", "--url", redis_url,
                              "--worker-class", "rq.worker.SimpleWorker", "--quiet", "bench"],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n_workers)]


def rq_throughput(redis_url: str, n_workers: int, latency_ms: int, n_tasks: int) -> dict:
    import redis
    from rq import Queue, Worker

    r = redis.Redis.from_url(redis_url)
    r.flushall()
    q = Queue("bench", connection=r)
    procs = rq_workers(redis_url, n_workers)
    wait_until(lambda: len(Worker.all(connection=r)) >= n_workers)
    fn = "benchmarks.rq_jobs.sleep_ms" if latency_ms else "benchmarks.rq_jobs.noop"
    jobs = q.enqueue_many([Queue.prepare_data(fn, args=(latency_ms,) if latency_ms else ()) for _ in range(n_tasks)])
    wait_until(lambda: q.count == 0 and q.started_job_registry.count == 0, timeout_s=600)
    stop(procs)
    for j in jobs:
        j.refresh()
    assert all(j.is_finished for j in jobs), "an RQ job did not finish"
    start = min(j.started_at for j in jobs).timestamp()
    end = max(j.ended_at for j in jobs).timestamp()
    return {"tasks": n_tasks, "seconds": round(end - start, 3), "tasks_per_s": round(n_tasks / (end - start), 1)}


def rq_latency(redis_url: str, n_workers: int, n_tasks: int = 100) -> dict:
    import redis
    from rq import Queue

    r = redis.Redis.from_url(redis_url)
    r.flushall()
    q = Queue("bench", connection=r)
    from rq import Worker

    procs = rq_workers(redis_url, n_workers)
    wait_until(lambda: len(Worker.all(connection=r)) >= n_workers)
    jobs = []
    for _ in range(n_tasks):
        jobs.append(q.enqueue("benchmarks.rq_jobs.noop"))
        time.sleep(0.01)
    deadline = time.time() + 60
    for j in jobs:
        while not j.is_finished and time.time() < deadline:
            time.sleep(0.01)
            j.refresh()
    for j in jobs:
        j.refresh()  # is_finished reads the status only: the timestamps come with a refresh
    waits = [(j.started_at - j.enqueued_at).total_seconds() for j in jobs]
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(60)
    return {"p50_ms": round(1000 * pct(waits, 0.5), 2), "p99_ms": round(1000 * pct(waits, 0.99), 2)}


def wait_cost(folder: Path, rounds: int, n_tasks: int, workers: int = 4) -> dict:
    """What NODEAGENT_REDIS_MIN_REPLICAS=1 costs: a primary and one replica on loopback (AOF everysec, as
    docs/operations.md asks), 0 ms tasks, min replicas 0 and 1 taking turns in the same run; the producer's submit
    latency (one Client.submit after another) and the workers' throughput."""
    from redisha import DataNode

    from nodeagent.config import resolve

    primary = DataNode(folder / "wait-primary").start()
    replica = DataNode(folder / "wait-replica", replica_of=primary.port).start()
    import redis

    raw = redis.Redis(port=primary.port, decode_responses=True)
    wait_until(lambda: any(v.get("state") == "online" for k, v in raw.info("replication").items()
                           if k.startswith("slave")))
    url = f"redis://127.0.0.1:{primary.port}/0"
    got: dict[int, dict[str, list[float]]] = {0: {"submit": [], "tps": []}, 1: {"submit": [], "tps": []}}
    try:
        for _ in range(rounds):
            for min_replicas in (0, 1):
                env = {"NODEAGENT_REDIS_MIN_REPLICAS": str(min_replicas)}
                raw.flushall()
                client = Client(open_broker(url, folder, config=resolve({}, env)))
                for t in tasks(300):
                    start = time.perf_counter()
                    client.submit(t)
                    got[min_replicas]["submit"].append(time.perf_counter() - start)
                client.close()
                got[min_replicas]["tps"].append(
                    nodeagent_throughput("redis", folder, url, workers, 0, n_tasks, env)["tasks_per_s"])
    finally:
        primary.stop()
        replica.stop()
    out: dict = {"workers": workers, "tasks": n_tasks, "rounds": rounds}
    for mr, g in got.items():
        out[f"min_replicas_{mr}"] = {"submit_p50_ms": round(1000 * pct(g["submit"], 0.5), 3),
                                     "submit_p99_ms": round(1000 * pct(g["submit"], 0.99), 3),
                                     "tasks_per_s": round(sorted(g["tps"])[len(g["tps"]) // 2], 1),
                                     "tasks_per_s_each": g["tps"]}
    zero, one = out["min_replicas_0"], out["min_replicas_1"]
    out["submit_added_ms"] = round(one["submit_p50_ms"] - zero["submit_p50_ms"], 3)
    out["per_task_added_ms"] = round(1000 * (1 / one["tasks_per_s"] - 1 / zero["tasks_per_s"]) * workers, 3)
    out["throughput_ratio"] = round(one["tasks_per_s"] / zero["tasks_per_s"], 3)
    return out


def efficiency(rows: list[dict]) -> None:
    base = {(r["system"], r["engine"], r["task_ms"]): r["tasks_per_s"] for r in rows if r["workers"] == 1}
    for r in rows:
        one = base.get((r["system"], r["engine"], r["task_ms"]))
        r["scaling_efficiency"] = round(r["tasks_per_s"] / (r["workers"] * one), 3) if one else None


def markdown(data: dict) -> str:
    lines = ["# Queue throughput and dispatch latency", "",
             "Produced by `benchmarks/fleet_queue.py` on this machine (2 cores, shared: every process of a run, Redis "
             "included, ran on the same 2 cores). nodeagent workers run the fake backend through the real task "
             "runner; RQ runs a no-op Python function (or a 100 ms sleep) in `SimpleWorker`s, on the same Redis, "
             "in the same run.", "",
             "The workers start and register first; then the producer queues the tasks while they run (nodeagent: one "
             "`Client.submit` each; RQ: one pipelined `enqueue_many`), and the clock runs from the first task's start "
             "to the last one's end.", "",
             f"Load average before / after: {data['load_before']} / {data['load_after']}.", "",
             "| system | engine | task | workers | tasks | tasks/s | scaling efficiency | dispatch p50 ms | p99 ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["rows"]:
        lat = r.get("latency") or {}
        lines.append(f"| {r['system']} | {r['engine']} | {r['task_ms']} ms | {r['workers']} | {r['tasks']} | "
                     f"{r['tasks_per_s']} | {r['scaling_efficiency']} | {lat.get('p50_ms', '')} | "
                     f"{lat.get('p99_ms', '')} |")
    lines += ["", "Scaling efficiency: tasks/s at N workers over N times tasks/s at 1 worker. Dispatch latency: "
              "idle workers, one task every 10 ms, from submission to start."]
    w = data.get("wait")
    if w:
        zero, one = w["min_replicas_0"], w["min_replicas_1"]
        lines += ["", "## What NODEAGENT_REDIS_MIN_REPLICAS=1 costs", "",
                  f"`python benchmarks/fleet_queue.py --wait-only` ({w.get('measured_at', '')}): a primary and one "
                  "replica on loopback (AOF everysec), 0 ms tasks; min replicas 0 and 1 taking turns, "
                  f"{w['rounds']} rounds; every enqueue, finish and dead letter followed by `WAIT 1`.", "",
                  "| min replicas | submit p50 ms | submit p99 ms | tasks/s, " + f"{w['workers']} workers |",
                  "| --- | --- | --- | --- |",
                  f"| 0 | {zero['submit_p50_ms']} | {zero['submit_p99_ms']} | {zero['tasks_per_s']} |",
                  f"| 1 | {one['submit_p50_ms']} | {one['submit_p99_ms']} | {one['tasks_per_s']} |", "",
                  f"A submit waits {w['submit_added_ms']} ms more at the median; throughput x{w['throughput_ratio']} "
                  f"({w['per_task_added_ms']} ms of a worker's time more per task). On loopback a replica answers "
                  "WAIT at once: over a LAN, add a round trip to the replica to each enqueue and each finish."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--out", default="queue")
    ap.add_argument("--markdown-only", action="store_true", help="Rewrite the .md from the .json, run nothing")
    ap.add_argument("--wait-only", action="store_true", help="Measure only what min replicas 1 costs, keeping the "
                                                             "rest of the saved results")
    args = ap.parse_args()
    if args.markdown_only:
        rewrite_markdown(args.out, markdown)
        return
    if args.wait_only:
        from benchmarks.results_io import read_results

        data = read_results(args.out)
        with tempfile.TemporaryDirectory() as tmp:
            data["wait"] = {**wait_cost(Path(tmp), rounds=1 if args.quick else 3, n_tasks=500 if args.quick else 2000),
                            "measured_at": time.strftime("%Y-%m-%d")}
        write_results(args.out, data, markdown(data))
        print(markdown(data))
        return
    counts = [int(x) for x in args.workers.split(",")]
    n_fast = 500 if args.quick else 3000
    rows = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "redis").mkdir()
        server = RedisServer(folder / "redis").start()
        try:
            for task_ms in (0, 100):
                for n in counts:
                    n_tasks = n_fast if task_ms == 0 else 40 * n * (1 if args.quick else 2)
                    for engine in ("sqlite", "redis"):
                        row = {"system": "nodeagent", "engine": engine, "task_ms": task_ms, "workers": n,
                               **nodeagent_throughput(engine, folder, server.url, n, task_ms, n_tasks)}
                        if task_ms == 0:
                            row["latency"] = nodeagent_latency(engine, folder, server.url, n)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                    row = {"system": "rq", "engine": "redis", "task_ms": task_ms, "workers": n,
                           **rq_throughput(server.url, n, task_ms, n_tasks)}
                    if task_ms == 0:
                        row["latency"] = rq_latency(server.url, n)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            server.stop()
    efficiency(rows)
    data = {"rows": rows, "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(), "quick": args.quick}
    with tempfile.TemporaryDirectory() as tmp:
        data["wait"] = {**wait_cost(Path(tmp), rounds=1 if args.quick else 3, n_tasks=500 if args.quick else 2000),
                        "measured_at": time.strftime("%Y-%m-%d")}
    write_results(args.out, data, markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (apt-get install redis-server)")
    main()
