"""The queue across a failover of its broker: a Redis primary, one replica and three Sentinels on loopback, two
worker processes and an orchestrator on a ``redis+sentinel://`` URL. Tasks are submitted at a steady rate, each
with its own idempotency key (a submit that raises is sent again with the same key); a third of the way in the
primary is killed with SIGKILL, the Sentinels promote the replica, and the old primary is started again 3 s later
(as its service manager would: it comes back as a replica). Optionally the replica lags first: its link to the
primary (a TCP proxy, ``tests/tcpproxy.py``) stops passing the replication stream on for ``lag_s`` before the kill,
as a slow or cut link would, so the writes the primary acknowledged meanwhile are on no replica when it dies.

Measured per NODEAGENT_REDIS_MIN_REPLICAS (0: the primary's word; 1: WAIT for the replica): tasks the client was
told were enqueued that are gone (lost), keys with two tasks, tasks done, the done counter (each task counted once),
dead letters, whether the workers kept running, submits that raised, and the time to resume: from the kill to the
first submit that went through, and to the first task done.

Usage: python benchmarks/failover.py [--tasks 300] [--rate 10]   -> benchmarks/results/failover.json and .md
(tests/test_failover.py runs the same scenario with min replicas 1, and asserts on it.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

QUIET = {"NODEAGENT_GUARD_CPU_PCT": "1000", "NODEAGENT_GUARD_MEMORY_PCT": "1000", "NODEAGENT_GUARD_TEMP_C": "1000",
         "NODEAGENT_ON_BATTERY": "serve", "NODEAGENT_GUARD_PSI_SOME_PCT": "1000",
         "NODEAGENT_GUARD_PSI_FULL_PCT": "1000"}


class Processes:
    """The nodeagent processes of one run (each with a home of its own and its log there), stopped together."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder, self.env = folder, env
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Any] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        home = self.folder / name
        home.mkdir(parents=True, exist_ok=True)
        (home / "node-id").write_text(f"{name}\n")
        self.logs.append(open(home / "log", "w"))
        self.procs.append(subprocess.Popen([sys.executable, "-m", "nodeagent", *args], stdout=subprocess.DEVNULL,
                                           stderr=self.logs[-1], env={**os.environ, **QUIET, **self.env,
                                                                      "NODEAGENT_HOME": str(home)}))
        return self.procs[-1]

    def running(self) -> int:
        return sum(1 for p in self.procs if p.poll() is None)

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in self.logs:
            f.close()


def scenario(folder: Path, min_replicas: int, tasks: int = 300, rate_per_s: float = 10.0, lag_s: float = 0.0,
             workers: int = 2, task_ms: int = 50, restart_after_s: float = 3.0, settle_s: float = 120.0,
             lease_s: float = 10.0) -> dict[str, Any]:
    """One run (see the module's docstring); the figures, and ``keys``: each key's task ids."""
    from redisha import SentinelFleet

    from nodeagent.broker.open import open_broker
    from nodeagent.config import resolve
    from nodeagent.fleet.client import Client
    from nodeagent.tasks.contracts import ClassifyTask

    folder.mkdir(parents=True, exist_ok=True)
    fleet = SentinelFleet(folder / "redis").start()
    settings = {"NODEAGENT_REDIS_MIN_REPLICAS": str(min_replicas), "NODEAGENT_REDIS_WAIT_TIMEOUT_S": "1",
                "NODEAGENT_BROKER_RETRY_S": "30", "NODEAGENT_LEASE_S": str(lease_s), "NODEAGENT_HEARTBEAT_S": "1"}
    procs = Processes(folder, {**settings, "NODEAGENT_LOG_LEVEL": "warning"})
    try:
        for i in range(workers):
            procs.start(f"w{i}", ["worker", "--model", f"fake:latency_ms={task_ms}", "--broker", fleet.url, "--types",
                                  "classify"])
        config = resolve({}, {**settings, "NODEAGENT_HOME": str(folder / "client")})
        broker = open_broker(fleet.url, folder / "client", config=config)
        client = Client(broker)
        keys: dict[str, list[str]] = {}
        raised: list[str] = []
        done_times: list[float] = []
        stop = threading.Event()
        killed_at: list[float] = []

        def watch_done() -> None:  # when the done counter first moves after the kill
            last = 0
            while not stop.is_set():
                try:
                    n = int(broker.r.get("nodeagent:v1:done:classify.v1") or 0)
                    if killed_at and n > last and not done_times:
                        done_times.append(time.monotonic())
                    last = n
                except Exception:  # noqa: BLE001  (the broker is failing over)
                    pass
                stop.wait(0.05)

        watcher = threading.Thread(target=watch_done, daemon=True)
        watcher.start()
        first_ok_after_kill: float | None = None

        def kill() -> None:  # beside the submits, which go on at their rate
            if lag_s:  # the replica falls behind: what the primary acknowledges now is on no replica
                fleet.lag()
                time.sleep(lag_s)
            old = fleet.kill_primary()
            killed_at.append(time.monotonic())
            threading.Timer(restart_after_s, old.start).start()

        start = time.monotonic()
        threading.Timer(tasks / 3 / rate_per_s - lag_s, kill).start()
        for i in range(tasks):
            time.sleep(max(0.0, start + i / rate_per_s - time.monotonic()))
            key = f"k-{i}"
            task = ClassifyTask(input=f"ticket {i}: the app crashes on start", labels=["bug", "question"])
            deadline = time.monotonic() + 120
            while True:
                try:
                    keys.setdefault(key, []).append(client.submit(task, idempotency_key=key))
                    if killed_at and first_ok_after_kill is None:
                        first_ok_after_kill = time.monotonic()
                    break
                except Exception as exc:  # noqa: BLE001  (the orchestrator sends it again, with the same key)
                    raised.append(f"{type(exc).__name__}: {exc}"[:200])
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        submitted_at = time.monotonic()
        ids = sorted({i for v in keys.values() for i in v})
        states: dict[str, str] = {}
        still = (0, time.monotonic())  # (tasks ended, since when): lost tasks never end, so stop once none moves
        while time.monotonic() < submitted_at + settle_s:
            try:
                states = broker.states(ids)
            except Exception:  # noqa: BLE001
                time.sleep(0.5)
                continue
            ended = sum(1 for s in states.values() if s in ("done", "dead", "cancelled"))
            if ended == len(ids) or (ended == len(states) and time.monotonic() - still[1] > 15):
                break
            if ended != still[0]:
                still = (ended, time.monotonic())
            time.sleep(0.5)
        settled_s = time.monotonic() - submitted_at
        stop.set()
        done = sum(1 for s in states.values() if s == "done")
        return {"min_replicas": min_replicas, "lag_s": lag_s, "tasks": tasks, "rate_per_s": rate_per_s,
                "workers": workers, "task_ms": task_ms,
                "lost": sum(1 for i in ids if i not in states), "two_tasks_for_a_key": sum(
                    1 for v in keys.values() if len(set(v)) > 1), "done": done,
                "done_counter": int(broker.r.get("nodeagent:v1:done:classify.v1") or 0),
                "dead": sum(1 for s in states.values() if s == "dead"),
                "other": sorted({s for s in states.values() if s not in ("done", "dead")}),
                "submits_raised": len(raised), "raised_sample": raised[:3],
                "workers_running": procs.running(),
                "resume_submit_s": None if first_ok_after_kill is None else
                round(first_ok_after_kill - killed_at[0], 2),
                "resume_done_s": round(done_times[0] - killed_at[0], 2) if done_times else None,
                "settled_s": round(settled_s, 1), "keys": keys}
    finally:
        procs.stop()
        fleet.stop()


def gateway_scenario(folder: Path, seconds: float = 120.0, clients: int = 6, min_replicas: int = 1,
                     workers: int = 2, task_ms: int = 100, restart_after_s: float = 3.0,
                     request_timeout_s: float = 60.0) -> dict[str, Any]:
    """The gateway across a failover: ``clients`` clients (half streaming) asking the gateway, on a Sentinel URL,
    for ``seconds``, the primary killed a third of the way in. A client asks again (up to 3 times) after a
    retryable answer (429, 503, 504, a broken stream) or a dropped connection. Counts requests ok at once, ok after
    a retry, failed for good, and hung (no answer within the client's timeout)."""
    import httpx
    from redisha import SentinelFleet

    folder.mkdir(parents=True, exist_ok=True)
    fleet = SentinelFleet(folder / "redis").start()
    procs = Processes(folder, {"NODEAGENT_REDIS_MIN_REPLICAS": str(min_replicas),
                               "NODEAGENT_REDIS_WAIT_TIMEOUT_S": "1", "NODEAGENT_BROKER_RETRY_S": "30",
                               "NODEAGENT_LEASE_S": "5", "NODEAGENT_HEARTBEAT_S": "1", "NODEAGENT_LOG_LEVEL": "warning",
                               "NODEAGENT_ACCESS_LOG": "0"})
    model = f"fake:latency_ms={task_ms}"

    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    try:
        for i in range(workers):
            procs.start(f"w{i}", ["worker", "--model", model, "--broker", fleet.url, "--types", "chat"])
        gateway = procs.start("gateway", ["gateway", "--broker", fleet.url, "--port", str(port)])
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=2).json().get("nodes", 0) >= workers:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway and its workers did not become ready")
            time.sleep(0.2)
        outcomes: list[tuple[str, float, str]] = []  # (ok | retried | failed | hung, seconds, why)
        lock = threading.Lock()
        end = time.monotonic() + seconds

        def ask(stream: bool) -> tuple[bool, str]:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "stream": stream}
            headers = {"x-stainless-timeout": str(int(request_timeout_s))}
            if not stream:
                r = httpx.post(base + "/v1/chat/completions", json=body, headers=headers,
                               timeout=request_timeout_s + 10)
                return r.status_code == 200, f"{r.status_code} {r.text[:120]}"
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers,
                              timeout=request_timeout_s + 10) as r:
                if r.status_code != 200:
                    return False, f"{r.status_code} {r.read()[:120]!r}"
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            errors = [line for line in lines if '"error"' in line]
            return (not errors and lines[-1:] == ["data: [DONE]"]), (errors[0][:160] if errors else "no [DONE]")

        def client(n: int) -> None:
            while time.monotonic() < end:
                started = time.monotonic()
                tries, why = 0, ""
                while True:
                    tries += 1
                    try:
                        ok, why = ask(stream=n % 2 == 1)
                    except httpx.TimeoutException:
                        with lock:
                            outcomes.append(("hung", time.monotonic() - started, "no answer in time"))
                        break
                    except httpx.HTTPError as exc:
                        ok, why = False, f"{type(exc).__name__}: {exc}"
                    if ok or tries >= 4:
                        with lock:
                            outcomes.append(("ok" if ok and tries == 1 else "retried" if ok else "failed",
                                             time.monotonic() - started, why))
                        break
                    time.sleep(0.5 * tries)

        threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
        for t in threads:
            t.start()
        time.sleep(seconds / 3)
        old = fleet.kill_primary()
        killed = time.monotonic()
        threading.Timer(restart_after_s, old.start).start()
        for t in threads:
            t.join(seconds + request_timeout_s * 5)
        counts = {k: sum(1 for o in outcomes if o[0] == k) for k in ("ok", "retried", "failed", "hung")}
        slow = sorted(o[1] for o in outcomes)
        return {"seconds": seconds, "clients": clients, "streaming_clients": clients // 2, "workers": workers,
                "task_ms": task_ms, "min_replicas": min_replicas, **counts, "requests": len(outcomes),
                "longest_s": round(slow[-1], 2) if slow else None,
                "p50_s": round(slow[len(slow) // 2], 3) if slow else None,
                "failed_why": sorted({o[2] for o in outcomes if o[0] in ("failed", "retried")})[:5],
                "gateway_running": gateway.poll() is None,
                "workers_running": procs.running() - (gateway.poll() is None),
                "killed_after_s": round(killed - (end - seconds), 1)}
    finally:
        procs.stop()
        fleet.stop()


def markdown(data: dict[str, Any]) -> str:
    runs, g = data["runs"], data["gateway"]
    rows = ["| min replicas | replica lag before the kill | tasks | lost | keys with two tasks | done | done counter | "
            "dead | submits that raised | submits resumed after | first task done after | all settled after |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        rows.append(f"| {r['min_replicas']} | {r['lag_s']:g} s | {r['tasks']} | {r['lost']} | "
                    f"{r['two_tasks_for_a_key']} | {r['done']} | {r['done_counter']} | {r['dead']} | "
                    f"{r['submits_raised']} | {r['resume_submit_s']} s | {r['resume_done_s']} s | {r['settled_s']} s |")
    return ("# The queue across a failover of its broker\n\n"
            "`python benchmarks/failover.py`: a Redis primary, one replica and three Sentinels (down-after 1 s) on "
            "loopback; two fake workers (50 ms tasks) and an orchestrator on a `redis+sentinel://` URL; tasks "
            f"submitted at {runs[0]['rate_per_s']:g}/s, each with its own idempotency key, resubmitted with the same "
            "key when a submit raises; the primary killed with SIGKILL a third of the way in and started again 3 s "
            "later (it comes back as a replica). With a lag, the replica's link to the primary held the replication "
            "stream back for that long before the kill (a proxy), so what the primary acknowledged meanwhile was on no "
            "replica when it died.\n\n"
            "- lost: tasks the client was told were enqueued that the new primary does not have;\n"
            "- done counter: `nodeagent:v1:done:classify.v1`, one per task moved to done;\n"
            "- resumed after: from the kill to the first submit that went through, and to the first task done.\n\n"
            + "\n".join(rows) + "\n\n"
            "## The gateway across a failover\n\n"
            f"{g['clients']} clients ({g['streaming_clients']} streaming) on `nodeagent gateway` (a Sentinel URL, min "
            f"replicas {g['min_replicas']}), {g['workers']} fake workers ({g['task_ms']} ms tasks), for "
            f"{g['seconds']:g} s; the primary killed with SIGKILL after {g['killed_after_s']} s and started again 3 s "
            "later. A client asks again (up to 3 times) after a retryable answer or a dropped connection.\n\n"
            "| requests | ok | ok after a retry | failed | hung | p50 | longest |\n"
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
            f"| {g['requests']} | {g['ok']} | {g['retried']} | {g['failed']} | {g['hung']} | {g['p50_s']} s | "
            f"{g['longest_s']} s |\n")


def main() -> None:
    from benchmarks.results_io import write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--gateway-s", type=float, default=120.0, help="How long the gateway's run lasts")
    args = parser.parse_args()
    runs = []
    for lag_s in (0.0, 1.0):
        for min_replicas in (0, 1):
            folder = Path(tempfile.mkdtemp(prefix="failover-"))
            try:
                run = scenario(folder, min_replicas, tasks=args.tasks, rate_per_s=args.rate, lag_s=lag_s)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            run.pop("keys")
            print({k: v for k, v in run.items() if k != "raised_sample"}, flush=True)
            runs.append(run)
    folder = Path(tempfile.mkdtemp(prefix="failover-gateway-"))
    try:
        gateway = gateway_scenario(folder, seconds=args.gateway_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(gateway, flush=True)
    data = {"runs": runs, "gateway": gateway, "measured_at": time.strftime("%Y-%m-%d")}
    write_results("failover", data, markdown(data))


if __name__ == "__main__":
    main()
