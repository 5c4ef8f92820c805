"""What HTTP costs: /v1/classify over a real server against calling the node core directly, same model, one run.

One `nodeagent serve` process on SmolLM2 and, in this process, a Node on the same file with the same settings.
The two take turns item by item over the same labelled texts (so both see the same machine load); latency is
measured by the caller: a round trip through httpx for the server, a `Node.classify` call for the core.
Target: HTTP adds less than 5 % at the p50.

Usage: python benchmarks/serve.py [--items 110]   -> benchmarks/results/serve.json and serve.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.results_io import write_results  # noqa: E402
from benchmarks.stats import pct  # noqa: E402
from nodeagent.config import load, resolve  # noqa: E402
from nodeagent.node import Node  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402

SETTINGS = {"NODEAGENT_CTX": "2048", "NODEAGENT_THREADS": "1"}  # one thread each: the two never share a core




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=110)
    args = ap.parse_args()
    data = json.loads((ROOT / "benchmarks/data/labelled.json").read_text())
    items = data["items"][: args.items]
    model = str(test_model_path("smollm2-135m-instruct", load().test_models_dir))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = Path(tempfile.mkdtemp())
    env = {**os.environ, **SETTINGS, "NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml")}
    server = subprocess.Popen([sys.executable, "-m", "nodeagent", "serve", "--model", model, "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(timeout=60)
    while True:
        try:
            if client.get(url + "/readyz").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    node = Node(model, config=resolve(env={k: v for k, v in env.items() if k.startswith("NODEAGENT_")}))
    node.load()
    http_s, core_s = [], []
    agree = 0
    load_before = os.getloadavg()[0]
    for item in items * 2:  # each text twice: the second pass has the prompt prefix cached on both sides
        labels = data["tasks"][item["task"]]
        t0 = time.perf_counter()
        r = client.post(url + "/v1/classify", json={"input": item["text"], "labels": labels}).json()
        http_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        c = node.classify(item["text"], labels)
        core_s.append(time.perf_counter() - t0)
        agree += r["output"]["label"] == c.output.label
    server.send_signal(signal.SIGTERM)
    server.wait(60)
    node.close()
    n = len(http_s)
    result = {
        "items": n, "model": Path(model).name, "settings": SETTINGS,
        "http": {"p50_ms": round(1000 * pct(http_s, 0.5), 2), "p95_ms": round(1000 * pct(http_s, 0.95), 2),
                 "req_per_s": round(n / sum(http_s), 2)},
        "core": {"p50_ms": round(1000 * pct(core_s, 0.5), 2), "p95_ms": round(1000 * pct(core_s, 0.95), 2),
                 "req_per_s": round(n / sum(core_s), 2)},
        "same_label": agree, "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}
    result["http_overhead_p50"] = round(result["http"]["p50_ms"] / result["core"]["p50_ms"] - 1, 4)
    write_results("serve", result, (
        "# HTTP against the core\n\n"
        f"`/v1/classify` through a `nodeagent serve` process (httpx, keep-alive) and `Node.classify` in-process, "
        f"the same model ({result['model']}) and settings ({SETTINGS}), taking turns over {n} requests.\n\n"
        "| path | p50 ms | p95 ms | requests/s |\n| --- | --- | --- | --- |\n"
        f"| HTTP | {result['http']['p50_ms']} | {result['http']['p95_ms']} | {result['http']['req_per_s']} |\n"
        f"| core | {result['core']['p50_ms']} | {result['core']['p95_ms']} | {result['core']['req_per_s']} |\n\n"
        f"HTTP adds {100 * result['http_overhead_p50']:.1f} % at the p50 (target: under 5 %). The two returned the "
        f"same label for {agree} of {n}. Load average before / after: {result['load_before']} / "
        f"{result['load_after']}.\n"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
