"""A fleet at steady mixed load for minutes, with retention settings short enough that a week of turnover fits in
the run: what the broker holds (Redis's keys and memory, the SQLite queue's file) and the processes' resident memory
must level off, not grow with the requests served.

One gateway and two workers (the fake backend, 5 ms answers, a context of 320,000 tokens) and a worker of the real embedding model
(all-MiniLM-L6-v2, from ``nodeagent models fetch-test``) on a queue, and eight clients asking without pause: whole and
streamed chat, typed extractions with idempotency keys (a fifth of them a key used before), classifications,
Responses stored (``store``, some answered with ``previous_response_id``; some with a 300 KB input), Responses over
the input limit (3.9 MB: refused), embeddings of 64 texts a request (a result of about 130 KB for a 3 KB request),
and orchestrator submits through ``Client``. The settings: results and finished tasks kept 30 s (NODEAGENT_RESULT_RETENTION_S), stored responses
30 s (NODEAGENT_RESPONSES_KEEP_S), the history 0.002 days (about 3 minutes), a request's limit 30 s (its event log
is kept 90 s). Sampled every 10 s: the keys and memory Redis reports (DBSIZE, used_memory), the SQLite files' size
(the database and its WAL), the resident memory of the gateway and the workers, the requests answered and failed.

It levels off when the last third of the run's samples is within 10 % of the middle third (keys, broker memory or
file, every process's memory), against the requests, which grow throughout. Run on Redis and on SQLite in turn.

Usage: python benchmarks/soak.py [--minutes 9] [--engines redis,sqlite]
       -> benchmarks/results/soak.json and soak.md
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402

from benchmarks.gateway import Procs, Redis, free_port, ready  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402

SETTINGS = {"NODEAGENT_RESULT_RETENTION_S": "30", "NODEAGENT_RESPONSES_KEEP_S": "30", "NODEAGENT_HISTORY_DAYS": "0.002",
            "NODEAGENT_GATEWAY_TIMEOUT_S": "30", "NODEAGENT_HEARTBEAT_S": "2", "NODEAGENT_LEASE_S": "10"}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}}}
CLIENTS = 8
FAKE = "fake:latency_ms=5,ctx=320000"  # a context that holds BIG_INPUT (one token a character)
BIG_INPUT = "a long note " * 25_000  # 300 KB, under the input limit (1 MiB)
BIG_REFUSED = "word " * 780_000  # 3.9 MB: over it
EMBEDDER = "all-MiniLM-L6-v2.F32"
SAMPLE_S = 10.0
LEVEL = 0.10  # the last third of the samples within this of the middle third: levelled off


class Load:
    """The clients: each asks again as soon as it is answered, a request drawn from the mix."""

    def __init__(self, base: str, url: str, home: Path) -> None:
        self.base, self.url, self.home = base, url, home
        self.ok = self.failed = 0
        self.kinds: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.responses: list[str] = []

    def run(self, seconds: float) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        return threads

    def _client(self, i: int) -> None:
        import os

        from nodeagent.client import Client
        from nodeagent.tasks.contracts import ClassifyTask

        os.environ.update({"NODEAGENT_HOME": str(self.home / f"client-{i}"), **SETTINGS})
        client = Client(self.url)
        rng = random.Random(i)
        http = httpx.Client(base_url=self.base, timeout=60)
        n = 0
        while not self.stop.is_set():
            n += 1
            kind = rng.choices(["chat", "stream", "extract", "classify", "responses", "big_responses", "refused",
                                "embed", "submit"], [30, 15, 15, 10, 12, 3, 1, 8, 15])[0]
            try:
                good = self._one(http, client, rng, kind, i, n, ClassifyTask)
            except Exception as exc:  # noqa: BLE001  (counted: a failed request is what this measures)
                good, kind = False, f"{kind}: {type(exc).__name__}"
            with self.lock:
                self.kinds[kind] = self.kinds.get(kind, 0) + 1
                if good:
                    self.ok += 1
                else:
                    self.failed += 1
                    self.errors[kind] = self.errors.get(kind, 0) + 1
        client.close()

    def _one(self, http: httpx.Client, client, rng: random.Random, kind: str, i: int, n: int, task) -> bool:  # noqa: ANN001
        chat = {"model": FAKE, "messages": [{"role": "user", "content": f"hello {i}-{n}"}],
                "max_tokens": 12}
        if kind == "chat":
            return http.post("/v1/chat/completions", json=chat).status_code == 200
        if kind == "stream":
            with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
                text = "".join(r.iter_text())
            return r.status_code == 200 and "[DONE]" in text and '"error"' not in text
        if kind == "extract":
            key = f"order-{i}-{rng.randrange(n)}" if rng.random() < 0.2 else f"order-{i}-{n}"
            r = http.post("/v1/extract", json={"input": f"Alice is {n % 90}.", "schema": SCHEMA,
                                               "idempotency_key": key})
            return r.status_code == 200 and r.json()["status"] == "ok"
        if kind == "classify":
            r = http.post("/v1/classify", json={"input": f"ticket {n}: it crashes", "labels": ["bug", "question"]})
            return r.status_code == 200 and r.json()["status"] == "ok"
        if kind == "refused":  # over the input limit: refused at the door, keeping nothing
            r = http.post("/v1/responses", json={"model": FAKE, "input": BIG_REFUSED})
            return r.status_code == 413
        if kind == "embed":
            r = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": [f"text {n} number {k} of {i}"
                                                                              for k in range(64)]})
            return r.status_code == 200 and len(r.json()["data"]) == 64
        if kind in ("responses", "big_responses"):
            body = {"model": FAKE, "input": BIG_INPUT if kind == "big_responses" else f"note {i}-{n}",
                    "max_output_tokens": 12, "metadata": {"client": str(i)}}
            with self.lock:
                earlier = self.responses[-1] if self.responses and rng.random() < 0.3 else None
            if earlier:
                body["previous_response_id"] = earlier
            r = http.post("/v1/responses", json=body)
            if r.status_code == 400 and earlier:  # the earlier one expired meanwhile (kept 30 s): asked afresh
                r = http.post("/v1/responses", json={k: v for k, v in body.items() if k != "previous_response_id"})
            if r.status_code == 200:
                with self.lock:
                    self.responses = [*self.responses[-50:], r.json()["id"]]
            return r.status_code == 200
        task_id = client.submit(task(input=f"ticket {n}", labels=["bug", "question"]),
                                idempotency_key=f"submit-{i}-{n}")
        return client.wait(task_id, timeout=60).status == "ok"


def embedder_path() -> Path:
    """The embedding model's GGUF, as ``nodeagent models fetch-test`` built it."""
    from nodeagent.config import load
    from nodeagent.store.pkgindex import test_model_path

    return test_model_path("all-minilm-l6-v2", load().test_models_dir, "F32")


def broker_reading(engine: str, url: str, db: Path | None) -> dict[str, float]:
    if engine == "redis":
        import redis

        r = redis.Redis.from_url(url)
        info = r.info("memory")
        return {"keys": r.dbsize(), "broker_mib": info["used_memory"] / 2**20}
    size = sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.exists())
    import sqlite3

    con = sqlite3.connect(db, timeout=30)
    try:
        rows = sum(con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                   for t in ("tasks", "results", "logs", "kv", "history", "events", "nodes", "documents"))
    finally:
        con.close()
    return {"keys": rows, "broker_mib": size / 2**20}


def rss_mib(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return float("nan")


def soak(engine: str, minutes: float) -> dict:
    home = Path(tempfile.mkdtemp(prefix=f"soak-{engine}-"))
    redis_server = Redis() if engine == "redis" else None
    db = home / "queue.db"
    url = redis_server.url if redis_server else f"sqlite://{db}"
    procs = Procs()
    port = free_port()
    try:
        procs.start("gateway", ["gateway", "--broker", url, "--port", str(port)], **SETTINGS)
        for i in range(2):
            procs.start(f"w{i}", ["worker", "--model", FAKE, "--broker", url, "--types",
                                  "chat,completion,extract,classify"], **SETTINGS)
        procs.start("embedder", ["worker", "--model", str(embedder_path()), "--broker", url, "--types", "embed"],
                    **SETTINGS)
        gateway = procs.procs["gateway"]
        workers = [procs.procs["w0"], procs.procs["w1"], procs.procs["embedder"]]
        base = f"http://127.0.0.1:{port}"
        ready(base, 3)
        load = Load(base, url, home)
        threads = load.run(minutes * 60)
        samples = []
        start = time.monotonic()
        while time.monotonic() - start < minutes * 60:
            time.sleep(SAMPLE_S)
            with load.lock:
                ok, failed = load.ok, load.failed
            samples.append({"t_s": round(time.monotonic() - start, 1), "requests": ok + failed, "failed": failed,
                            **{k: round(v, 3) for k, v in broker_reading(engine, url, db).items()},
                            "gateway_rss_mib": round(rss_mib(gateway.pid), 1),
                            "worker_rss_mib": round(max(rss_mib(w.pid) for w in workers), 1)})
            print(engine, samples[-1], flush=True)
        load.stop.set()
        for t in threads:
            t.join(60)
        return {"engine": engine, "minutes": minutes, "samples": samples, "kinds": load.kinds,
                "errors": load.errors, "ok": load.ok, "failed": load.failed, "levels": levels(samples)}
    finally:
        procs.stop()
        if redis_server:
            redis_server.stop()


def levels(samples: list[dict]) -> dict:
    """Each measure's middle-third and last-third means, and whether the last is within LEVEL of the middle."""
    third = len(samples) // 3
    middle, last = samples[third:2 * third], samples[2 * third:]
    out = {}
    for key in ("keys", "broker_mib", "gateway_rss_mib", "worker_rss_mib", "requests"):
        a, b = statistics.fmean(s[key] for s in middle), statistics.fmean(s[key] for s in last)
        out[key] = {"middle": round(a, 2), "last": round(b, 2), "growth": round(b / a - 1, 4) if a else None,
                    "level": bool(a) and b <= a * (1 + LEVEL)}
    return out


def render(data: dict) -> str:
    lines = ["# Soak: a fleet at steady mixed load, with a week of turnover in minutes", "",
             "`python benchmarks/soak.py` (one gateway, two fake workers and an embedding worker, eight clients, "
             "embeddings and large Responses bodies in the mix; results and responses kept 30 s, the history about 3 minutes: see the script's docstring). On this machine (2 cores), "
             f"{data['date']}. Levelled off: the last third of the samples within {LEVEL:.0%} of the middle "
             "third.", ""]
    for run in data["runs"]:
        lv = run["levels"]
        lines += [f"## {run['engine']}: {run['minutes']:g} minutes, {run['ok']:,} requests answered, "
                  f"{run['failed']} failed", "",
                  "| measure | middle third | last third | growth | levelled off |",
                  "| --- | ---: | ---: | ---: | --- |"]
        names = {"keys": "Redis keys" if run["engine"] == "redis" else "rows in the queue's tables",
                 "broker_mib": "Redis used_memory, MiB" if run["engine"] == "redis" else "the queue's files, MiB",
                 "gateway_rss_mib": "gateway resident memory, MiB", "worker_rss_mib": "worker resident memory, MiB",
                 "requests": "requests answered so far (for scale)"}
        for key, name in names.items():
            v = lv[key]
            lines.append(f"| {name} | {v['middle']:,} | {v['last']:,} | {v['growth']:+.1%} | "
                         f"{'yes' if v['level'] else 'no'} |" if key != "requests" else
                         f"| {name} | {v['middle']:,} | {v['last']:,} | {v['growth']:+.1%} | (grows) |")
        lines += ["", "| t (s) | requests | failed | keys | broker MiB | gateway MiB | worker MiB |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {s['t_s']:g} | {s['requests']:,} | {s['failed']} | {s['keys']:,} | {s['broker_mib']:.1f} | "
                  f"{s['gateway_rss_mib']:.1f} | {s['worker_rss_mib']:.1f} |" for s in run["samples"]]
        if run["errors"]:
            lines += ["", "Failed requests by kind: " + ", ".join(f"{k} {v}" for k, v in run["errors"].items())]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=9.0)
    ap.add_argument("--engines", default="redis,sqlite")
    args = ap.parse_args()
    runs = [soak(e, args.minutes) for e in args.engines.split(",")]
    data = {"date": time.strftime("%Y-%m-%d"), "settings": SETTINGS, "clients": CLIENTS, "runs": runs}
    write_results("soak", data, render(data))
    print(render(data))


if __name__ == "__main__":
    main()
