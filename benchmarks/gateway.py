"""The gateway against a node served directly, on this machine, with Redis as the queue: what the queue costs a
request, and what the gateway holds up to.

- **first token**: SmolLM2 streamed through `serve`, and through the gateway to a worker on the same file and
  settings, taking turns request by request; the median time to the first content chunk of each (target: the
  gateway within 30 ms of `serve`);
- **added latency**: 0 ms tasks (the fake backend), whole answers, one client, through `serve --model fake` and
  through the gateway to a fake worker, taking turns (target: p50 within 15 ms);
- **scaling**: 100 ms tasks through the gateway to 1, 2 and 4 fake workers, by as many clients as 4 times the
  workers; tasks/s and the efficiency against the one-worker rate (target: 0.9 or more);
- **many clients**: 50, then 2,000 concurrent clients (aiohttp, one process) against the gateway and 4 fake workers
  of 50 ms tasks, each client asking again as soon as it is answered (after a 429, once its Retry-After has
  passed), for 10 s of warm-up and then a measured time: every answer is a 200 or a 429 with Retry-After (no 5xx),
  the fleet's steady throughput held at 90 % or more of its 50-client rate, and the gateway's resident memory;
- **a worker killed every 10 s**: 2 minutes of whole answers (16 clients, 4 fake workers of 200 ms tasks, lease
  2 s), one worker killed with SIGKILL and started again every 10 s: the failed requests (target: 0).
- **streams that survive their node**: two real SmolLM2 workers (lease 2 s), six clients (three streaming), a
  worker killed every 15 s for 2 minutes: failed requests, streams included, and streams whose text began again
  (targets: 0 and 0); the gap between two pieces across a move to another node, p50 and p99;
- **drain handoff**: a stream whose node gets SIGTERM after its first piece, finished in place against handed to
  the other node (NODEAGENT_DRAIN_HANDOFF): the stream's time, its longest gap, the draining node's exit.

Usage: python benchmarks/gateway.py [--quick] [--phases stream_kills,handoff]
       -> benchmarks/results/gateway.json and gateway.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402

from benchmarks.results_io import read_results, write_results  # noqa: E402
from benchmarks.stats import pct  # noqa: E402
from nodeagent.config import load as load_config  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402

QUIET = {"NODEAGENT_GUARD_CPU_PCT": "1000", "NODEAGENT_GUARD_MEMORY_PCT": "1000", "NODEAGENT_LOG_LEVEL": "error",
         "NODEAGENT_ACCESS_LOG": "0"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp())
        self.port = free_port()
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class Procs:
    """nodeagent processes of one measurement, stopped together."""

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp())
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], **env: str) -> None:
        home = self.home / name
        home.mkdir(parents=True, exist_ok=True)
        (home / "node-id").write_text(name + "\n")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "nodeagent", *args],
                                            env={**os.environ, **QUIET, "NODEAGENT_HOME": str(home), **env},
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        p.send_signal(signal.SIGKILL)
        p.wait(10)

    def stop(self) -> None:
        for p in self.procs.values():
            p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.home, ignore_errors=True)


def ready(url: str, nodes: int | None = None, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            r = httpx.get(url + "/readyz", timeout=2)
            if r.status_code == 200 and (nodes is None or r.json().get("nodes", 0) >= nodes):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


def gateway(procs: Procs, broker: str) -> str:
    port = free_port()
    procs.start("gateway", ["gateway", "--broker", broker, "--port", str(port)])
    return f"http://127.0.0.1:{port}"


def first_token(url: str, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                return time.perf_counter() - t0
    raise RuntimeError("no content came")


def measure_first_token(rounds: int) -> dict:
    model = str(test_model_path("smollm2-135m-instruct", load_config().test_models_dir))
    redis, procs = Redis(), Procs()
    settings = ["--ctx", "2048", "--slots", "1", "--threads", "1"]
    try:
        sport = free_port()
        procs.start("serve", ["serve", "--model", model, "--port", str(sport), *settings])
        procs.start("worker", ["worker", "--model", model, "--broker", redis.url, "--types", "chat", *settings])
        gw = gateway(procs, redis.url)
        ready(f"http://127.0.0.1:{sport}")
        ready(gw, 1)
        name = Path(model).stem
        times: dict[str, list[float]] = {"serve": [], "gateway": []}
        for i in range(rounds + 2):
            for side, url in (("serve", f"http://127.0.0.1:{sport}"), ("gateway", gw)):
                t = first_token(url, name)
                if i >= 2:  # the first two warm both up
                    times[side].append(t)
        med = {k: pct(v, 0.5) for k, v in times.items()}
        return {"rounds": rounds, "serve_ms": round(1000 * med["serve"], 1), "gateway_ms": round(1000 * med["gateway"], 1),
                "added_ms": round(1000 * (med["gateway"] - med["serve"]), 1)}
    finally:
        procs.stop()
        redis.stop()


def measure_added_latency(n: int) -> dict:
    redis, procs = Redis(), Procs()
    try:
        sport = free_port()
        procs.start("serve", ["serve", "--model", "fake", "--port", str(sport)])
        procs.start("worker", ["worker", "--model", "fake", "--broker", redis.url, "--types", "chat"])
        gw = gateway(procs, redis.url)
        ready(f"http://127.0.0.1:{sport}")
        ready(gw, 1)
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        times: dict[str, list[float]] = {"serve": [], "gateway": []}
        with httpx.Client(timeout=30) as c:
            for i in range(n + 20):
                for side, url in (("serve", f"http://127.0.0.1:{sport}"), ("gateway", gw)):
                    t0 = time.perf_counter()
                    r = c.post(url + "/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    if i >= 20:
                        times[side].append(time.perf_counter() - t0)
        out = {"requests": n}
        for side, v in times.items():
            out[f"{side}_p50_ms"] = round(1000 * pct(v, 0.5), 2)
            out[f"{side}_p99_ms"] = round(1000 * pct(v, 0.99), 2)
        out["added_p50_ms"] = round(out["gateway_p50_ms"] - out["serve_p50_ms"], 2)
        out["added_p99_ms"] = round(out["gateway_p99_ms"] - out["serve_p99_ms"], 2)
        return out
    finally:
        procs.stop()
        redis.stop()


async def load(url: str, model: str, clients: int, seconds: float, warm_s: float = 0.0) -> dict:
    """``clients`` concurrent clients asking again as soon as answered, for ``warm_s`` and then ``seconds``:
    counts by status (all of them), and the rate and latency of the answers after the warm-up (the steady
    state, once the queue holds what the clients keep in it)."""
    import aiohttp

    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    counts: dict[str, int] = {}
    latencies: list[float] = []
    retry_missing = 0
    in_time = 0  # 200s answered within the window: the rate
    begin = time.monotonic() + warm_s
    end = begin + seconds
    connector = aiohttp.TCPConnector(limit=clients + 10)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def client() -> None:
            nonlocal retry_missing, in_time
            while time.monotonic() < end:
                t0 = time.monotonic()
                try:
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        key = str(r.status)
                        if r.status == 429:
                            if "Retry-After" not in r.headers:
                                retry_missing += 1
                            # as told: a client that comes back sooner only adds load
                            await asyncio.sleep(min(float(r.headers.get("Retry-After", "1")), max(0.0, end - time.monotonic())))
                        elif r.status == 200 and begin <= time.monotonic() < end:
                            latencies.append(time.monotonic() - t0)
                            in_time += 1
                except Exception as exc:  # noqa: BLE001  (a connection refused or reset counts as a failure)
                    key = type(exc).__name__
                counts[key] = counts.get(key, 0) + 1

        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        took = time.monotonic() - started
    return {"clients": clients, "seconds": round(took, 1), "statuses": counts, "ok_per_s": round(in_time / seconds, 1),
            "p50_s": round(pct(latencies, 0.5), 3) if latencies else None,
            "p99_s": round(pct(latencies, 0.99), 3) if latencies else None, "429_without_retry_after": retry_missing}


def rss_mb(pid: int) -> float:
    import psutil

    return round(psutil.Process(pid).memory_info().rss / (1 << 20), 1)


def measure_scaling(seconds: float) -> list[dict]:
    rows = []
    for workers in (1, 2, 4):
        redis, procs = Redis(), Procs()
        try:
            for k in range(workers):
                procs.start(f"w{k}", ["worker", "--model", "fake:latency_ms=100", "--broker", redis.url,
                                      "--types", "chat"])
            gw = gateway(procs, redis.url)
            ready(gw, workers)
            asyncio.run(load(gw, "fake:latency_ms=100", 4 * workers, 3))  # warm-up
            got = asyncio.run(load(gw, "fake:latency_ms=100", 4 * workers, seconds))
            rows.append({"workers": workers, **got})
        finally:
            procs.stop()
            redis.stop()
    one = rows[0]["ok_per_s"]
    for r in rows:
        r["efficiency"] = round(r["ok_per_s"] / (r["workers"] * one), 3) if one else None
    return rows


def measure_many_clients(seconds: float, many: int) -> list[dict]:
    redis, procs = Redis(), Procs()
    try:
        for k in range(4):
            procs.start(f"w{k}", ["worker", "--model", "fake:latency_ms=50", "--broker", redis.url, "--types", "chat"])
        gw = gateway(procs, redis.url)
        ready(gw, 4)
        pid = procs.procs["gateway"].pid
        rows = []
        for clients in (50, many):
            got = asyncio.run(load(gw, "fake:latency_ms=50", clients, seconds, warm_s=10))
            rows.append({**got, "gateway_rss_mb": rss_mb(pid)})
        return rows
    finally:
        procs.stop()
        redis.stop()


def measure_kills(seconds: float) -> dict:
    redis, procs = Redis(), Procs()
    model = "fake:latency_ms=200"
    try:
        for k in range(4):
            procs.start(f"w{k}", ["worker", "--model", model, "--broker", redis.url, "--types", "chat", "--lease", "2",
                                  "--heartbeat", "0.5"])
        gw = gateway(procs, redis.url)
        ready(gw, 4)
        killed = []

        async def killer() -> None:
            k = 0
            end = time.monotonic() + seconds
            while time.monotonic() + 10 < end:
                await asyncio.sleep(10)
                victim = f"w{k % 4}"
                procs.kill(victim)
                killed.append(victim)
                procs.start(victim, ["worker", "--model", model, "--broker", redis.url, "--types", "chat", "--lease",
                                     "2", "--heartbeat", "0.5"])
                k += 1

        async def both() -> dict:
            results = await asyncio.gather(load(gw, model, 16, seconds), killer())
            return results[0]

        got = asyncio.run(both())
        failed = sum(v for k, v in got["statuses"].items() if k != "200")
        return {**got, "kills": len(killed), "failed": failed}
    finally:
        procs.stop()
        redis.stop()


STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def smollm2() -> str:
    return str(test_model_path("smollm2-135m-instruct", load_config().test_models_dir))


def smol_worker(procs: Procs, name: str, broker: str, model: str, **env: str) -> None:
    procs.start(name, ["worker", "--model", model, "--broker", broker, "--types", "chat", "--ctx", "2048", "--slots",
                       "1", "--lease", "2", "--heartbeat", "0.5"], **env)


async def stream_once(s, url: str, model: str, max_tokens: int, on_first=None) -> dict:
    """One streamed chat request: whether it ended well as one stream (no error event, one beginning), whether
    its text began again (a second beginning), how often it moved to another node, the gaps between its pieces."""
    body = {"model": model, "messages": STORY, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    times: list[float] = []
    roles = resumed = 0
    errors: list[dict] = []
    try:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return {"ok": False, "status": r.status, "restarted": False, "resumed": 0, "gaps": []}
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    errors.append(ev["error"])
                    continue
                resumed = max(resumed, int(ev.get("nodeagent_resumed") or 0))
                for c in ev.get("choices", []):
                    delta = c.get("delta") or {}
                    roles += 1 if delta.get("role") else 0
                    if delta.get("content"):
                        times.append(time.monotonic())
                        if on_first is not None and len(times) == 1:
                            on_first()
    except Exception as exc:  # noqa: BLE001  (a broken connection is a failed request)
        errors.append({"code": type(exc).__name__})
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ok": not errors and roles == 1 and bool(times), "restarted": roles > 1, "resumed": resumed,
            "errors": [e.get("code") for e in errors], "gaps": gaps, "seconds": time.monotonic() - t0}


def measure_stream_kills(seconds: float, every_s: float = 15.0) -> dict:
    """Two real SmolLM2 workers (lease 2 s), six clients (three streaming, three asking whole answers), a worker
    killed with SIGKILL every ``every_s`` and started again: failed requests, streams that began again, and the
    gap between two pieces across a move to another node against the gaps without one."""
    import aiohttp

    redis, procs = Redis(), Procs()
    model = smollm2()
    name = Path(model).stem
    try:
        for k in range(2):
            smol_worker(procs, f"w{k}", redis.url, model)
        gw = gateway(procs, redis.url)
        ready(gw, 2)
        streams: list[dict] = []
        whole: dict[str, int] = {}
        killed: list[str] = []
        end = time.monotonic() + seconds

        async def streamer(s) -> None:
            while time.monotonic() < end:
                streams.append(await stream_once(s, gw, name, 60))

        async def asker(s) -> None:
            while time.monotonic() < end:
                body = {"model": name, "messages": STORY, "max_tokens": 60, "temperature": 0}
                try:
                    async with s.post(gw + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        key = str(r.status)
                except Exception as exc:  # noqa: BLE001
                    key = type(exc).__name__
                whole[key] = whole.get(key, 0) + 1

        async def killer() -> None:
            k = 0
            while time.monotonic() + every_s < end:
                await asyncio.sleep(every_s)
                victim = f"w{k % 2}"
                procs.kill(victim)
                killed.append(victim)
                smol_worker(procs, victim, redis.url, model)
                k += 1

        async def run() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
                await asyncio.gather(*(streamer(s) for _ in range(3)), *(asker(s) for _ in range(3)), killer())

        asyncio.run(run())
        moved = [r for r in streams if r["resumed"]]
        across = [max(r["gaps"]) for r in moved if r["gaps"]]
        others = [g for r in streams if not r["resumed"] for g in r["gaps"]]
        return {"seconds": seconds, "every_s": every_s, "kills": len(killed), "whole": whole,
                "whole_failed": sum(v for k, v in whole.items() if k != "200"),
                "streams": len(streams), "streams_failed": sum(1 for r in streams if not r["ok"]),
                "streams_restarted": sum(1 for r in streams if r["restarted"]), "streams_resumed": len(moved),
                "stream_errors": sorted({c for r in streams for c in r["errors"]}),
                "resume_gap_p50_s": round(pct(across, 0.5), 3) if across else None,
                "resume_gap_p99_s": round(pct(across, 0.99), 3) if across else None,
                "gap_p50_s": round(pct(others, 0.5), 4) if others else None,
                "gap_p99_s": round(pct(others, 0.99), 4) if others else None}
    finally:
        procs.stop()
        redis.stop()


def holder(broker) -> str | None:
    """The node that holds a leased task now (Redis)."""
    for key in broker.r.scan_iter("nodeagent:v1:task:*"):
        view = broker.get(key.decode().rsplit(":", 1)[1] if isinstance(key, bytes) else key.rsplit(":", 1)[1])
        if view is not None and view.state == "leased":
            return view.node
    return None


def measure_handoff(rounds: int) -> dict:
    """A streamed answer (SmolLM2, 120 tokens) whose node gets SIGTERM after its first piece: finished in place
    (the drain) against handed to the other node (NODEAGENT_DRAIN_HANDOFF), the modes in alternating blocks: the
    stream's time to its end and its longest gap, and how long the draining node took to exit."""
    import aiohttp

    from nodeagent.broker.open import open_broker

    model = smollm2()
    name = Path(model).stem
    out: dict[str, list[dict]] = {"in_place": [], "handoff": []}
    for block in range(2):
        for mode in ("in_place", "handoff"):
            redis, procs = Redis(), Procs()
            env = {"NODEAGENT_DRAIN_HANDOFF": "1" if mode == "handoff" else "0"}
            broker = open_broker(redis.url, procs.home)
            try:
                for k in range(2):
                    smol_worker(procs, f"w{k}", redis.url, model, **env)
                gw = gateway(procs, redis.url)
                ready(gw, 2)
                for _ in range(rounds):
                    drained: dict = {}

                    def drain() -> None:
                        node = holder(broker)
                        drained["node"], drained["at"] = node, time.monotonic()
                        procs.procs[node].send_signal(signal.SIGTERM)

                    async def one() -> dict:
                        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
                            return await stream_once(s, gw, name, 120, on_first=drain)

                    got = asyncio.run(one())
                    p = procs.procs.pop(drained["node"])
                    p.wait(60)
                    exit_s = time.monotonic() - drained["at"]
                    out[mode].append({"ok": got["ok"], "resumed": got["resumed"], "seconds": got["seconds"],
                                      "max_gap_s": max(got["gaps"], default=0.0), "exit_s": exit_s})
                    smol_worker(procs, drained["node"], redis.url, model, **env)
                    ready(gw, 2)
            finally:
                broker.close()
                procs.stop()
                redis.stop()
    summary = {}
    for mode, rows in out.items():
        summary[mode] = {"rounds": len(rows), "ok": sum(r["ok"] for r in rows),
                         "resumed": sum(1 for r in rows if r["resumed"]),
                         "stream_s_p50": round(pct([r["seconds"] for r in rows], 0.5), 3),
                         "max_gap_s_p50": round(pct([r["max_gap_s"] for r in rows], 0.5), 3),
                         "node_exit_s_p50": round(pct([r["exit_s"] for r in rows], 0.5), 3)}
    return summary


def markdown(d: dict) -> str:
    ft, al = d["first_token"], d["added_latency"]
    lines = ["# The gateway (Redis, this machine, fake workers unless said)", "",
             f"First token, SmolLM2 streamed (median of {ft['rounds']}, taking turns): `serve` {ft['serve_ms']} ms, "
             f"through the gateway {ft['gateway_ms']} ms: +{ft['added_ms']} ms (target within 30 ms: "
             f"{'met' if ft['added_ms'] <= 30 else 'not met'}).", "",
             f"Added latency, 0 ms tasks, one client, {al['requests']} requests each, taking turns: p50 `serve` "
             f"{al['serve_p50_ms']} ms, gateway {al['gateway_p50_ms']} ms (+{al['added_p50_ms']} ms; target within "
             f"15 ms: {'met' if al['added_p50_ms'] <= 15 else 'not met'}); p99 {al['serve_p99_ms']} against "
             f"{al['gateway_p99_ms']} ms.", "", "Scaling, 100 ms tasks, 4 clients per worker:", "",
             "| workers | tasks/s | efficiency | p50 s | p99 s |", "| --- | --- | --- | --- | --- |"]
    for r in d["scaling"]:
        lines.append(f"| {r['workers']} | {r['ok_per_s']} | {r['efficiency']} | {r['p50_s']} | {r['p99_s']} |")
    lines += ["", "Many clients, 4 workers of 50 ms tasks:", "",
              "| clients | answers/s | statuses | p50 s | p99 s | 429 without Retry-After | gateway RSS MiB |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in d["many_clients"]:
        lines.append(f"| {r['clients']} | {r['ok_per_s']} | {', '.join(f'{k}: {v}' for k, v in sorted(r['statuses'].items()))} "
                     f"| {r['p50_s']} | {r['p99_s']} | {r['429_without_retry_after']} | {r['gateway_rss_mb']} |")
    few, many = d["many_clients"]
    held = many["ok_per_s"] / few["ok_per_s"] if few["ok_per_s"] else 0
    fives = sum(v for k, v in many["statuses"].items() if k.startswith("5") or not k.isdigit())
    lines += ["", f"At {many['clients']} clients the fleet answered {held:.0%} of its 50-client rate (target 90 %: "
              f"{'met' if held >= 0.9 else 'not met'}), with {fives} 5xx or failed connections (target 0).", ""]
    k = d["kills"]
    lines += [f"A worker killed with SIGKILL every 10 s for {k['seconds']:.0f} s ({k['kills']} kills, 16 clients, "
              f"200 ms tasks, lease 2 s): {k['statuses'].get('200', 0)} answered, {k['failed']} failed (target 0); "
              f"p99 {k['p99_s']} s.", ""]
    sk = d.get("stream_kills")
    if sk:
        lines += [f"Streams that survive their node: two real SmolLM2 workers (lease 2 s), six clients (three streaming, "
                  f"three whole answers, 60 tokens), a worker killed with SIGKILL every {sk['every_s']:.0f} s for "
                  f"{sk['seconds']:.0f} s ({sk['kills']} kills): whole answers {sk['whole'].get('200', 0)} ok, "
                  f"{sk['whole_failed']} failed; streams {sk['streams'] - sk['streams_failed']} ok, "
                  f"{sk['streams_failed']} failed{' (' + ', '.join(sk['stream_errors']) + ')' if sk['stream_errors'] else ''}, "
                  f"{sk['streams_restarted']} that began again (target 0 and 0); {sk['streams_resumed']} continued on "
                  f"another node. The gap between two pieces across a move: p50 {sk['resume_gap_p50_s']} s, p99 "
                  f"{sk['resume_gap_p99_s']} s (lease 2 s, then a claim and the prompt read again), against p50 "
                  f"{sk['gap_p50_s']} s and p99 {sk['gap_p99_s']} s between pieces otherwise.", ""]
    ho = d.get("handoff")
    if ho:
        lines += ["A node draining (SIGTERM) after a 120-token stream's first piece, two real SmolLM2 workers, the modes "
                  "in alternating blocks:", "",
                  "| mode | rounds | ok | continued elsewhere | stream s, p50 | longest gap s, p50 | node exit s, p50 |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for mode, r in ho.items():
            lines.append(f"| {mode.replace('_', ' ')} | {r['rounds']} | {r['ok']} | {r['resumed']} | {r['stream_s_p50']} | "
                         f"{r['max_gap_s_p50']} | {r['node_exit_s_p50']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="short phases, for a smoke run")
    ap.add_argument("--clients", type=int, default=2000)
    ap.add_argument("--phases", help="only these phases (comma-separated), the others' saved figures kept")
    args = ap.parse_args()
    seconds = 5 if args.quick else 20
    phases = {"first_token": lambda: measure_first_token(5 if args.quick else 20),
              "added_latency": lambda: measure_added_latency(50 if args.quick else 300),
              "scaling": lambda: measure_scaling(seconds),
              "many_clients": lambda: measure_many_clients(seconds, args.clients),
              "kills": lambda: measure_kills(30 if args.quick else 120),
              "stream_kills": lambda: measure_stream_kills(30 if args.quick else 120),
              "handoff": lambda: measure_handoff(1 if args.quick else 3)}
    wanted = args.phases.split(",") if args.phases else list(phases)
    d = read_results("gateway") if args.phases else {}  # the phases not run keep their saved figures
    for name in wanted:
        d[name] = phases[name]()
    write_results("gateway", d, markdown(d))
    print(markdown(d))


if __name__ == "__main__":
    main()
