"""The HTTP API with a real server on a free loopback port, driven by the official `openai` package and a
real HTTP client: SmolLM2 for the model routes, the fake backend for refusals and floods; systemd's notify
protocol over a real unix datagram socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import QUIET_GUARD, cli

from nodeagent.tasks.schema import validate_output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, model: str, env: dict, *args: str, ready_status: int = 200) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "nodeagent", "serve", "--model", model, "--port",
                                      str(self.port), *args], env={**os.environ, **QUIET_GUARD, **env},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == ready_status:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stderr.read())
            time.sleep(0.1)
        raise RuntimeError("the server did not become ready")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory, smollm2_path):
    home = tmp_path_factory.mktemp("serve")
    server = Served(str(smollm2_path), {"NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml")},
                    "--ctx", "2048")
    yield server
    server.stop()


@pytest.fixture
def fake_env(tmp_path):
    return {"NODEAGENT_HOME": str(tmp_path), "NODEAGENT_CONFIG": str(tmp_path / "c.toml")}


@pytest.mark.real_model
def test_openai_client_chat_stream_and_json_schema(smol_server):
    import openai

    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused")
    [model] = [m.id for m in client.models.list().data]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens <= 12
    assert r.choices[0].finish_reason in ("stop", "length")
    pieces = []
    finish = None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                                max_tokens=12, temperature=0, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == r.choices[0].message.content and finish == r.choices[0].finish_reason
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 120}}}
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Alice is 34. Give her name and age as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}, max_tokens=64)
    value = json.loads(r.choices[0].message.content)
    assert validate_output(schema, value) is None


@pytest.mark.real_model
def test_typed_routes_and_metrics(smol_server):
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.post(smol_server.url + "/v1/classify", json={"input": "The food was cold and late.",
                                                         "labels": ["positive", "negative"]}, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["type"] == "classify.v1"
    schema = json.loads((Path(__file__).parent.parent / "scripts/examples/person.schema.json").read_text())
    r = httpx.post(smol_server.url + "/v1/extract", json={"input": "Bob Jones (52) lives in Lisbon.",
                                                        "schema": schema}, timeout=60)
    assert r.status_code == 200 and validate_output(schema, r.json()["output"]) is None
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(smol_server.url + "/metrics").text)}
    requests = {(s.labels["route"], s.labels["status"]): s.value for s in families["nodeagent_http_requests"].samples
                if s.name.endswith("_total")}
    assert requests[("/v1/classify", "200")] >= 1 and requests[("/v1/extract", "200")] >= 1
    info = families["nodeagent_plan_info"].samples[0].labels
    assert info["quant"] == "Q4_1" and info["ctx_tokens"] == "2048" and info["backend"] == "llamacpp"
    tasks = {(s.labels["type"], s.labels["status"]) for s in families["nodeagent_tasks"].samples}
    assert ("classify.v1", "ok") in tasks
    assert any(s.labels["kind"] == "planned" for s in families["nodeagent_memory_bytes"].samples)
    spec = httpx.get(smol_server.url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/extract", "/v1/classify"} <= set(spec["paths"])


def test_binding_beyond_loopback_needs_a_token(fake_env):
    proc = cli(["serve", "--model", "fake", "--host", "0.0.0.0"], fake_env, check=False)
    assert proc.returncode == 2 and "needs a bearer token" in proc.stderr and "Traceback" not in proc.stderr


def json_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "code"}
    return body["error"]


def test_refusals_are_json(fake_env):
    server = Served("fake", {**fake_env, "NODEAGENT_MAX_BODY_BYTES": "2000"}, "--token", "s3cret")
    try:
        auth = {"Authorization": "Bearer s3cret"}
        assert json_error(httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert json_error(httpx.get(server.url + "/v1/models"), 401)
        assert httpx.get(server.url + "/v1/models", headers=auth).status_code == 200
        assert httpx.get(server.url + "/healthz").status_code == 200  # probes need no token
        big = {"input": "x" * 5000, "labels": ["a", "b"]}
        assert json_error(httpx.post(server.url + "/v1/classify", json=big, headers=auth), 413)["code"] == \
            "body_too_large"
        assert json_error(httpx.get(server.url + "/no/such/route", headers=auth), 404)
        assert json_error(httpx.post(server.url + "/v1/chat/completions", json={"messages": []}, headers=auth), 400)
        too_many = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}
        assert json_error(httpx.post(server.url + "/v1/chat/completions", json=too_many, headers=auth),
                          400)["code"] == "max_tokens_too_large"
    finally:
        server.stop()


def test_a_flood_past_the_queue_gets_429(fake_env):
    server = Served("fake:latency_ms=300", {**fake_env, "NODEAGENT_SERVER_QUEUE": "2"})
    statuses: list[int] = []
    retry_after: list[str] = []

    def one() -> None:
        r = httpx.post(server.url + "/v1/classify", json={"input": "flood", "labels": ["a", "b"]}, timeout=60)
        statuses.append(r.status_code)
        if r.status_code == 429:
            retry_after.append(r.headers.get("retry-after", ""))
            assert r.json()["error"]["code"] == "queue_full"

    try:
        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.stop()
    assert statuses.count(200) >= 3 and statuses.count(429) >= 1 and set(statuses) <= {200, 429}
    assert all(v.isdigit() for v in retry_after)


def test_systemd_notify_ready_watchdog_stopping(tmp_path, fake_env):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(30)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nodeagent", "serve", "--model", "fake", "--port", str(port)],
                            env={**os.environ, **fake_env, "NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "600000"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got: list[str] = []
    try:
        while not any(m.startswith("READY=1") for m in got):
            got.append(sock.recv(4096).decode())
        watchdogs = 0
        while watchdogs < 3:  # every 0.3 s: half of WatchdogSec
            if sock.recv(4096).decode() == "WATCHDOG=1":
                watchdogs += 1
        proc.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in got:
            got.append(sock.recv(4096).decode())
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
    assert any("STATUS=serving fake" in m for m in got)


def test_a_hot_device_is_not_ready_and_says_why(tmp_path):
    """serve on a recorded Pi 5 that is hot and throttled, with a queue (so a guard decides): /readyz is 503 and
    names the heat, /metrics has the device's temperature and throttle flags."""
    from conftest import HARDWARE

    home = tmp_path / "home"
    server = Served("fake", {"NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml"),
                             "NODEAGENT_HARDWARE_FIXTURE": str(HARDWARE / "rpi5-8gb-hot.json"),
                             "NODEAGENT_GUARD_TEMP_C": "85"},
                    "--broker", f"sqlite://{tmp_path / 'queue.db'}", ready_status=503)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            r = httpx.get(server.url + "/readyz", timeout=5)
            if r.status_code == 503 and "heat" in r.json().get("why", ""):
                break
            time.sleep(0.2)
        assert r.status_code == 503 and "heat" in r.json()["why"], r.text
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
        assert "nodeagent_temperature_celsius" in metrics and "nodeagent_throttled 1.0" in metrics
    finally:
        server.stop()


@pytest.mark.parametrize("engine", ["sqlite", "redis"])
def test_serve_frees_a_key_with_its_own_verdict(fake_env, tmp_path, engine, request):
    """`serve --broker` gives a keyed request up at its deadline (NODEAGENT_GATEWAY_TIMEOUT_S) and frees the key
    with the cancel, as the gateway does: once the node is fast again (here: served anew), the retry with the key
    runs the work, instead of a 504 for a task that can no longer finish."""
    if engine == "redis":
        import redis

        queue = request.getfixturevalue("redis_server").url
        redis.Redis.from_url(queue).flushall()
    else:
        queue = f"sqlite://{tmp_path / 'q.db'}"
    env = {**fake_env, "NODEAGENT_GATEWAY_TIMEOUT_S": "2"}
    body = {"input": "keyed", "labels": ["a", "b"], "idempotency_key": "order-9"}
    slow = Served("fake:latency_ms=6000", env, "--broker", queue)
    try:
        r = httpx.post(slow.url + "/v1/classify", json=body, timeout=60)
        assert r.status_code == 504, r.text
    finally:
        slow.stop()
    fast = Served("fake", env, "--broker", queue)
    try:
        r = httpx.post(fast.url + "/v1/classify", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    finally:
        fast.stop()


def test_an_idempotent_typed_task_on_serve_goes_through_the_queue(fake_env, tmp_path):
    """`serve --broker`: a typed task with an idempotency key runs through the fleet's queue executor (the
    gateway's), so the same key again answers the first task's Result; without a queue the key is refused."""
    from nodeagent.broker.open import open_broker

    queue = f"sqlite://{tmp_path / 'q.db'}"
    server = Served("fake", fake_env, "--broker", queue)
    try:
        body = {"input": "keyed", "labels": ["a", "b"], "idempotency_key": "order-1"}
        first = httpx.post(server.url + "/v1/classify", json=body, timeout=60)
        again = httpx.post(server.url + "/v1/classify", json=body, timeout=60)
        assert first.status_code == again.status_code == 200, (first.text, again.text)
        assert first.json()["status"] == "ok" and again.json()["task_id"] == first.json()["task_id"]
        other = httpx.post(server.url + "/v1/classify", json={**body, "idempotency_key": "order-2"}, timeout=60)
        assert other.json()["status"] == "ok" and other.json()["task_id"] != first.json()["task_id"]
        broker = open_broker(queue, tmp_path)
        assert broker.get(first.json()["task_id"]).state == "done"
        assert sum(s.done for s in broker.stats()) == 2  # two keys, two tasks: the repeat ran nothing
    finally:
        server.stop()
    alone = Served("fake", {**fake_env, "NODEAGENT_HOME": str(tmp_path / "alone")})
    try:
        r = httpx.post(alone.url + "/v1/classify", json=body, timeout=60)
        assert json_error(r, 400)["code"] == "unsupported_parameter"
    finally:
        alone.stop()


# -- a client that goes away: its task stops and frees its slot (every route that runs work) ----------------------

def abandon(url: str, route: str, body: dict, n: int) -> None:
    """``n`` requests at once that their client gives up on half a second in (it closes the connection)."""
    def one() -> None:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + route, json=body, timeout=0.5)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def answered_in(url: str, route: str, body: dict) -> float:
    """The seconds a request takes to be answered 200 (a client that waits up to 30 s for it)."""
    started = time.monotonic()
    r = httpx.post(url + route, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return time.monotonic() - started


def stopped(server: Served) -> None:
    try:
        server.stop()
    except subprocess.TimeoutExpired:  # work nobody waits for held it: the test has failed already
        server.proc.kill()


def test_typed_tasks_whose_clients_went_away_stop_and_free_the_slot(fake_env):
    """Six extractions of about 10 s each (a hundred numbers, some 700 tokens at 20 ms), their clients gone after
    half a second: the one running stops at its next token and the ones waiting at the gate never start, so a small
    classification is answered at once, not after a minute of answers nobody reads."""
    server = Served("fake:token_ms=20", {**fake_env, "NODEAGENT_SERVER_QUEUE": "16"})
    long = {"input": "numbers", "schema": {"type": "object", "required": ["xs"], "properties": {
        "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 100}}}}
    try:
        abandon(server.url, "/v1/extract", long, 6)
        assert answered_in(server.url, "/v1/classify", {"input": "small", "labels": ["a", "b"]}) < 5
    finally:
        stopped(server)
    gone = [line for line in server.proc.stderr.read().splitlines() if "route=/v1/extract status=499" in line]
    assert len(gone) == 6


@pytest.mark.real_model
def test_embeddings_whose_clients_went_away_stop_and_free_the_slot(fake_env, minilm_path):
    """all-MiniLM-L6-v2: six requests of 2048 inputs each (seconds of forward batches apiece), three on
    /v1/embeddings and three on /v1/embed, their clients gone after half a second: each running one stops at its
    next forward batch, so small requests on both routes are answered at once."""
    server = Served(str(minilm_path), {**fake_env, "NODEAGENT_SERVER_QUEUE": "16"})
    texts = [f"note {i}: the quick brown fox jumps over the lazy dog" for i in range(2048)]
    try:
        threads = [threading.Thread(target=abandon, args=(server.url, route, {"input": texts}, 3))
                   for route in ("/v1/embeddings", "/v1/embed")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert answered_in(server.url, "/v1/embeddings", {"input": "small"}) < 8
        assert answered_in(server.url, "/v1/embed", {"input": ["small"]}) < 8
    finally:
        stopped(server)
