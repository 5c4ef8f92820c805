"""The Batch API against the client's own fan-out: a 2,000-line classify batch through `/v1/files` and
`/v1/batches` (the official openai client, a real server) against the same tasks through `Client.map`, on the
same 4 worker processes (fake backend, 50 ms a task), on SQLite and on Redis, rounds taking turns.

- batch: from the upload's start to the moment a poll (every 0.1 s) sees the batch completed: upload, the
  whole file's validation, the expansion into queue tasks, the run, the finalization;
- map: from the first submission to `Client.map` returning with every result (it polls every 0.02 s);
- download: the 2,000-line output file through `files.content`, made from the results as it streams.

Targets (issue 20): the batch within 5 % of `Client.map`; the output file in under 1 s.

Usage: python benchmarks/batch.py [--lines 2000] [--rounds 2]   -> benchmarks/results/batch.json and batch.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import RedisServer  # noqa: E402

from benchmarks.results_io import write_results  # noqa: E402
from nodeagent.broker.open import open_broker  # noqa: E402
from nodeagent.client import Client  # noqa: E402
from nodeagent.tasks.contracts import ClassifyTask  # noqa: E402

QUIET_GUARD = {"NODEAGENT_GUARD_CPU_PCT": "1000", "NODEAGENT_GUARD_MEMORY_PCT": "1000"}
WORKERS = 4


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], home: Path) -> subprocess.Popen:
    env = {**os.environ, **QUIET_GUARD, "NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml")}
    return subprocess.Popen([sys.executable, "-m", "nodeagent", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(60)


def rows(n: int) -> list[dict]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/classify",
             "body": {"input": f"item {i}: the parcel came late and damaged", "labels": ["complaint", "praise"]}}
            for i in range(n)]


def one_engine(url: str, n: int, rounds: int, folder: Path) -> list[dict]:
    import httpx
    import openai

    broker = open_broker(url, folder)
    workers = [start(["worker", "--model", "fake:latency_ms=50", "--broker", url], folder / f"w{i}")
               for i in range(WORKERS)]
    port = free_port()
    server = start(["serve", "--model", "fake", "--broker", url, "--port", str(port), "--types", "chat"],
                   folder / "server")
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.time() + 120
        while time.time() < end and len([x for x in broker.nodes() if x.state == "ready"]) < WORKERS + 1:
            time.sleep(0.1)
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        data = "".join(json.dumps(r) + "\n" for r in rows(n)).encode()
        out = []
        for r in range(rounds):
            for side in (("batch", "map") if r % 2 == 0 else ("map", "batch")):
                if side == "batch":
                    t0 = time.perf_counter()
                    f = client.files.create(file=("input.jsonl", data), purpose="batch")
                    b = client.batches.create(input_file_id=f.id, endpoint="/v1/classify", completion_window="24h")
                    while b.status not in ("completed", "failed", "expired", "cancelled"):
                        time.sleep(0.1)
                        b = client.batches.retrieve(b.id)
                    seconds = time.perf_counter() - t0
                    assert b.status == "completed" and b.request_counts.completed == n, b
                    t1 = time.perf_counter()
                    text = client.files.content(b.output_file_id).content
                    download = time.perf_counter() - t1
                    assert text.count(b"\n") == n
                    out.append({"round": r, "side": side, "s": seconds, "download_s": download,
                                "output_bytes": len(text)})
                else:
                    tasks = [ClassifyTask(**x["body"]) for x in rows(n)]  # new ids each round
                    t0 = time.perf_counter()
                    fan = Client(broker).map(tasks, max_in_flight=64, timeout=600)
                    seconds = time.perf_counter() - t0
                    assert len(fan.ok) == n, (len(fan.ok), len(fan.failed))
                    out.append({"round": r, "side": side, "s": seconds})
        return out
    finally:
        stop([*workers, server])


def markdown(data: dict) -> str:
    lines = [f"# Batch API against Client.map ({data['lines']} classify lines, {WORKERS} workers, fake backend "
             f"50 ms, {data['rounds']} rounds taking turns)", "",
             "| engine | batch s (median) | map s (median) | batch / map | output download s (max) |",
             "| --- | --- | --- | --- | --- |"]
    for engine, s in data["summary"].items():
        lines.append(f"| {engine} | {s['batch_s']:.2f} | {s['map_s']:.2f} | x{s['ratio']:.3f} | "
                     f"{s['download_s_max']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import statistics

    results: dict[str, list[dict]] = {}
    folder = Path(tempfile.mkdtemp())
    results["sqlite"] = one_engine(f"sqlite://{folder / 'queue.db'}", args.lines, args.rounds, folder / "sqlite")
    redis = RedisServer(folder).start()
    try:
        results["redis"] = one_engine(redis.url, args.lines, args.rounds, folder / "redis")
    finally:
        redis.stop()
    summary = {}
    for engine, rs in results.items():
        b = statistics.median(x["s"] for x in rs if x["side"] == "batch")
        m = statistics.median(x["s"] for x in rs if x["side"] == "map")
        summary[engine] = {"batch_s": b, "map_s": m, "ratio": b / m,
                           "download_s_max": max(x["download_s"] for x in rs if x["side"] == "batch")}
    data = {"lines": args.lines, "rounds": args.rounds, "workers": WORKERS, "summary": summary, "runs": results}
    write_results("batch", data, markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
