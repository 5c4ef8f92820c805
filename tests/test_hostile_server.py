"""The HTTP door under a hostile probe, with a real server and a real HTTP client: bad client input is a 400,
never a 500; every stream ends; a 405 says what is allowed; clients that drip are cut off; logs stay JSON;
a catastrophic pattern does not stall the probes; and `serve --broker` survives a dropped connection and tells
a broker outage on /readyz."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from conftest import QUIET_GUARD, RedisServer, cli
from test_hostile_fleet import CATASTROPHIC
from test_server import Served, json_error

from nodeagent.broker.open import open_broker
from nodeagent.client import Client
from nodeagent.tasks.contracts import ClassifyTask

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("hostile")
    server = Served("fake:fail=[boom]", {"NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml"),
                                         "NODEAGENT_CLIENT_TIMEOUT_S": "1", "NODEAGENT_HEADER_TIMEOUT_S": "1",
                                         "NODEAGENT_TASK_TIMEOUT_S": "3"})
    yield server
    server.stop()


def post_raw(server, path: str, text: str) -> httpx.Response:
    return httpx.post(server.url + path, content=text.encode(), headers={"Content-Type": "application/json"},
                      timeout=30)


def test_bad_client_input_is_a_400_never_a_500(fake_server):
    surrogate = '{"messages": [{"role": "user", "content": "hi \\ud800"}]}'
    assert json_error(post_raw(fake_server, CHAT, surrogate), 400)["code"] == "invalid_body"
    label = '{"input": "x", "labels": ["a\\udc00", "b"]}'
    assert json_error(post_raw(fake_server, "/v1/classify", label), 400)
    schema: dict = {"type": "object"}
    for _ in range(150):
        schema = {"type": "object", "properties": {"a": schema}}
    assert json_error(httpx.post(fake_server.url + "/v1/extract", json={"input": "x", "schema": schema}), 400)
    deep = '{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + "[" * 3000 + "]" * 3000 + "}"
    assert json_error(post_raw(fake_server, CHAT, deep), 400)
    seeded = httpx.post(fake_server.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}], "seed": -1,
                                                      "max_tokens": 4}, timeout=30)
    assert seeded.status_code == 200, seeded.text  # -1: a random seed, as llama.cpp takes it


def test_a_backend_error_is_a_503_and_every_stream_ends(fake_server):
    body = {"messages": [{"role": "user", "content": "this fails [boom]"}], "max_tokens": 8}
    assert json_error(httpx.post(fake_server.url + CHAT, json=body, timeout=30), 503)["code"] == "backend_error"
    with httpx.stream("POST", fake_server.url + CHAT, json={**body, "stream": True}, timeout=30) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["code"] == "backend_error"


def test_a_405_says_which_methods_are_allowed(fake_server):
    r = httpx.get(fake_server.url + CHAT)
    assert r.status_code == 405 and "POST" in r.headers.get("allow", "")
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_clients_that_drip_are_cut_off(fake_server):
    port = fake_server.port
    heads = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        heads.append(s)
    body = socket.create_connection(("127.0.0.1", port))
    body.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{")
    deadline = time.time() + 4
    while time.time() < deadline:  # drip a byte every 0.2 s: no request ever completes
        for s in heads + [body]:
            try:
                s.sendall(b"X")
            except OSError:
                pass
        time.sleep(0.2)
    closed = 0
    for s in heads:
        s.settimeout(2)
        try:
            closed += s.recv(100) == b""
        except (ConnectionResetError, BrokenPipeError):
            closed += 1
        s.close()
    assert closed == 20
    body.settimeout(2)
    answer = body.recv(1000)
    body.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert httpx.get(fake_server.url + "/healthz").status_code == 200


def test_probes_answer_while_a_catastrophic_pattern_is_validated(fake_server):
    got: dict = {}

    def extract() -> None:
        got["r"] = httpx.post(fake_server.url + "/v1/extract", json={"input": "the code", "schema": CATASTROPHIC},
                              timeout=60)

    t = threading.Thread(target=extract)
    started = time.time()
    t.start()
    probes = []
    while t.is_alive() and time.time() - started < 20:
        try:
            probes.append(httpx.get(fake_server.url + "/healthz", timeout=1).status_code)
        except httpx.HTTPError as exc:
            probes.append(repr(exc))
        time.sleep(0.2)
    t.join(30)
    result = got["r"].json()
    assert result["status"] == "error" and result["error"]["code"] == "timeout"
    assert time.time() - started < 3 + 3  # the 3 s limit, validation included
    assert len(probes) >= 5 and all(p == 200 for p in probes), probes


def test_a_blank_token_is_refused(tmp_path):
    env = {"NODEAGENT_HOME": str(tmp_path), "NODEAGENT_CONFIG": str(tmp_path / "c.toml")}
    proc = cli(["serve", "--model", "fake", "--host", "0.0.0.0", "--token", "  "], env, check=False)
    assert proc.returncode == 2 and "blank" in proc.stderr and "Traceback" not in proc.stderr


def test_logs_stay_json_lines(tmp_path):
    env = {"NODEAGENT_HOME": str(tmp_path), "NODEAGENT_CONFIG": str(tmp_path / "c.toml"),
           "NODEAGENT_LOG_FORMAT": "json", "NODEAGENT_LOG_LEVEL": "info"}
    server = Served("fake", env)
    try:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")  # uvicorn itself logs this one
        s.recv(1000)
        s.close()
        httpx.get(server.url + "/v1/models")
    finally:
        server.stop()
    lines = [line for line in server.proc.stderr.read().splitlines() if line.strip()]
    bad = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            bad.append(line)
    assert lines and not bad, bad
    assert any("Invalid HTTP request" in json.loads(line)["msg"] for line in lines)


def test_serve_with_a_broker_survives_a_dropped_connection_and_tells_an_outage(tmp_path):
    import redis

    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(folder, appendonly=True).start()
    env = {"NODEAGENT_HOME": str(tmp_path / "home"), "NODEAGENT_CONFIG": str(tmp_path / "c.toml"),
           **QUIET_GUARD, "NODEAGENT_LEASE_S": "2", "NODEAGENT_HEARTBEAT_S": "0.5"}
    web = Served("fake", env, "--broker", server.url)
    try:
        client = Client(open_broker(server.url, tmp_path))
        first = client.submit(ClassifyTask(input="one", labels=["a", "b"]))
        assert client.wait(first, timeout=30).status == "ok"
        redis.Redis.from_url(server.url).execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        second = client.submit(ClassifyTask(input="two", labels=["a", "b"]))
        assert client.wait(second, timeout=30).status == "ok"
        assert httpx.get(web.url + "/readyz").status_code == 200
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        deadline = time.time() + 20
        while time.time() < deadline and httpx.get(web.url + "/readyz").status_code == 200:
            time.sleep(0.2)
        ready = httpx.get(web.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["queue"] == "broker unreachable"
        assert httpx.get(web.url + "/healthz").status_code == 200  # alive all the same
        assert httpx.post(web.url + "/v1/classify", json={"input": "direct", "labels": ["a", "b"]},
                          timeout=30).json()["status"] == "ok"  # the model still serves HTTP
        server.start()
        client = Client(open_broker(server.url, tmp_path))
        third = client.submit(ClassifyTask(input="three", labels=["a", "b"]))
        assert client.wait(third, timeout=60).status == "ok"
        deadline = time.time() + 20
        while time.time() < deadline and httpx.get(web.url + "/readyz").status_code != 200:
            time.sleep(0.2)
        assert httpx.get(web.url + "/readyz").status_code == 200
        assert web.proc.poll() is None
    finally:
        web.stop()
        server.stop()
    err = web.proc.stderr.read()
    assert "Traceback" not in err, err
