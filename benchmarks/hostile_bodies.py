"""Request bodies as an attacker and a large upload send them: this tree against an earlier release, side by side
in one run (the machine is shared and noisy: read the ratios).

Each release runs as a real `nodeagent serve --model fake --token T --broker sqlite://...` process, from its own
source tree (``--before REF`` is unpacked with `git archive`):

- **flood**: 100 connections without the token, each announcing and sending 4 MiB - 1 byte to an open path
  (`/healthz`, `/readyz`, `/ui/login`, `/ui/static/app.js`) or to an API route; the server's RSS before, at its peak
  (sampled every 20 ms) and after, and what the connections were answered;
- **upload**: a batch input file of 20, 80 and 199 MB (under the 200 MiB limit) to `POST /v1/files` with the token,
  on loopback: the seconds until the answer, the answer, and the server's RSS growth at its peak meanwhile;
- **stall**: a 3.4 MB chat body whose 200,000 lists and strings must all be walked (its nesting and its text are
  checked), sent with the token while another client asks `/healthz` again and again: the longest probe's
  seconds, against the body's own.

Usage: python benchmarks/hostile_bodies.py [--before c75c179] -> benchmarks/results/hostile_bodies.{json,md}
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402

from benchmarks.gateway import QUIET, free_port  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402

TOKEN = "a-token-long-enough-for-a-lan-0123"
OPEN = ("/healthz", "/readyz", "/ui/login", "/ui/static/app.js", "/v1/chat/completions")
UPLOAD_MB = (20, 80, 199)


def start(tree: Path, home: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, **QUIET, "PYTHONPATH": str(tree), "NODEAGENT_HOME": str(home),
           "NODEAGENT_CONFIG": str(home / "c.toml"), "NODEAGENT_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "nodeagent", "serve", "--model", "fake", "--port", str(port),
                             "--broker", f"sqlite://{home / 'q.db'}"], env=env, cwd=tree,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"the server from {tree} did not start: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)


def send(port: int, path: str, nbytes: int, answers: list[str]) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(30)
    try:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {nbytes}\r\n\r\n".encode())
        chunk, sent = b"x" * (256 << 10), 0
        while sent < nbytes:
            s.sendall(chunk[:nbytes - sent])
            sent += len(chunk)
    except OSError:
        pass  # answered and closed before the body was all sent
    try:
        line = s.recv(200).split(b"\r\n", 1)[0].decode()
        answers.append(line.split(" ")[1] if line.startswith("HTTP/") else "closed")
    except OSError as exc:
        answers.append(type(exc).__name__)
    finally:
        s.close()


class Peak:
    """A process's RSS sampled every 20 ms while in the ``with``: before, peak, after (bytes)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.server = psutil.Process(proc.pid)
        self.done = threading.Event()

    def __enter__(self) -> "Peak":
        self.before = self.peak = self.server.memory_info().rss
        self.sampler = threading.Thread(target=self._sample)
        self.sampler.start()
        return self

    def _sample(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.server.memory_info().rss)
            time.sleep(0.02)

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.sampler.join()
        self.after = self.server.memory_info().rss

    @property
    def grew_mb(self) -> float:
        return round((self.peak - self.before) / 2**20, 1)


def flood(proc: subprocess.Popen, port: int, connections: int) -> dict:
    meter = Peak(proc).__enter__()
    before = meter.before
    answers: list[str] = []
    threads = [threading.Thread(target=send, args=(port, OPEN[i % len(OPEN)], (4 << 20) - 1, answers))
               for i in range(connections)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    took_s = time.perf_counter() - started
    time.sleep(1.0)
    meter.__exit__()
    after = meter.after
    return {"connections": connections, "rss_before_mb": round(before / 2**20, 1),
            "rss_peak_mb": round(meter.peak / 2**20, 1), "rss_after_mb": round(after / 2**20, 1),
            "grew_peak_mb": meter.grew_mb, "kept_mb": round((after - before) / 2**20, 1),
            "seconds": round(took_s, 2), "answers": {a: answers.count(a) for a in sorted(set(answers))}}


def batch_file(megabytes: int) -> bytes:
    line = json.dumps({"custom_id": "c{}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "fake", "messages": [{"role": "user", "content": "x" * 900}]}})
    lines, size, n = [], 0, 0
    while size < megabytes * 10**6:
        text = line.replace('"c{}"', f'"c{n}"') + "\n"
        lines.append(text)
        size += len(text)
        n += 1
    return "".join(lines).encode()


def upload(proc: subprocess.Popen, port: int, megabytes: int) -> dict:
    content = batch_file(megabytes)
    started = time.perf_counter()
    with Peak(proc) as meter:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/files", headers={"Authorization": f"Bearer {TOKEN}"},
                       data={"purpose": "batch"}, files={"file": ("in.jsonl", io.BytesIO(content))}, timeout=600)
    took = time.perf_counter() - started
    code = r.json().get("error", {}).get("code") if r.status_code >= 400 else None
    return {"megabytes": megabytes, "bytes": len(content), "seconds": round(took, 2), "status": r.status_code,
            "code": code, "grew_peak_mb": meter.grew_mb}


def stall(port: int) -> dict:
    """The longest /healthz while a body that must be walked is read (see the module's docstring)."""
    body = (b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "x": [' +
            b",".join([b'["\\ud83d\\ude00"]'] * 200_000) + b"]}")
    done: dict = {}

    def big() -> None:
        t0 = time.perf_counter()
        done["status"] = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=body, timeout=120,
                                    headers={"Authorization": f"Bearer {TOKEN}",
                                             "Content-Type": "application/json"}).status_code
        done["seconds"] = time.perf_counter() - t0

    probes: list[float] = []
    for _ in range(3):
        t = threading.Thread(target=big)
        t.start()
        while t.is_alive():
            t0 = time.perf_counter()
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=60)
            probes.append(time.perf_counter() - t0)
        t.join()
    return {"body_mb": round(len(body) / 10**6, 1), "body_s": round(done["seconds"], 3), "status": done["status"],
            "probes": len(probes), "longest_probe_s": round(max(probes), 3) if probes else None}


def measure(tree: Path, label: str) -> dict:
    with tempfile.TemporaryDirectory() as home:
        proc, port = start(tree, Path(home))
        try:
            out = {"release": label, "flood": flood(proc, port, 100)}
            out["stall"] = stall(port)
            out["uploads"] = [upload(proc, port, mb) for mb in UPLOAD_MB]
            out["rss_end_mb"] = round(psutil.Process(proc.pid).memory_info().rss / 2**20, 1)
        finally:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(out), file=sys.stderr)
    return out


def render(data: dict) -> str:
    before, now = data["before"], data["now"]
    rows = ["| measure | " + f"before ({before['release']}) | this tree | before / this tree |",
            "| --- | ---: | ---: | ---: |"]
    fb, fn = before["flood"], now["flood"]
    rows.append(f"| flood: RSS growth at the peak (MB) | {fb['grew_peak_mb']} | {fn['grew_peak_mb']} | "
                f"{fb['grew_peak_mb'] / max(fn['grew_peak_mb'], 0.1):.0f}x |")
    rows.append(f"| flood: RSS kept after (MB) | {fb['kept_mb']} | {fn['kept_mb']} | |")
    rows.append(f"| flood: seconds for 100 connections | {fb['seconds']} | {fn['seconds']} | |")
    rows.append(f"| flood: answers | {fb['answers']} | {fn['answers']} | |")
    sb, sn = before["stall"], now["stall"]
    rows.append(f"| stall: the longest /healthz while a {sn['body_mb']} MB body is walked (s) | "
                f"{sb['longest_probe_s']} | {sn['longest_probe_s']} | "
                f"{(sb['longest_probe_s'] or 0) / max(sn['longest_probe_s'] or 0, 0.001):.0f}x |")
    rows.append(f"| stall: the body's own answer (s, status) | {sb['body_s']} ({sb['status']}) | "
                f"{sn['body_s']} ({sn['status']}) | |")
    for ub, un in zip(before["uploads"], now["uploads"]):
        ratio = f"{ub['seconds'] / un['seconds']:.1f}x" if ub["status"] == un["status"] == 200 else "only this tree's"
        rows.append(f"| upload {un['megabytes']} MB: seconds (status) | {ub['seconds']} ({ub['status']}"
                    f"{' ' + ub['code'] if ub['code'] else ''}) | {un['seconds']} ({un['status']}) | {ratio} |")
        rows.append(f"| upload {un['megabytes']} MB: RSS growth at the peak (MB) | {ub.get('grew_peak_mb', '-')} | "
                    f"{un['grew_peak_mb']} | |")
    return (f"# Hostile bodies: the server's memory under a flood, and large uploads\n\n"
            f"`python benchmarks/hostile_bodies.py` on {data['machine']}, {data['date']}: `serve --model fake` "
            f"with a token and a SQLite broker, the earlier release and this tree side by side in one run.\n\n"
            + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="c75c179", help="the earlier release to compare with (a git ref)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "archive", args.before], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        before = measure(Path(old), args.before)
    now = measure(ROOT, "this tree")
    data = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"),
            "before": before, "now": now}
    write_results("hostile_bodies", data, render(data))
    print(render(data))


if __name__ == "__main__":
    main()
