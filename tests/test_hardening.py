"""The second hardening round (issue 57), each finding held shut, as a hostile client or a curious local user would
try it, on real `serve` and `gateway` processes with a real HTTP client, raw sockets and the CLI as a user types it:

- a broker URL is read as redis-py reads it: a password holding a raw ``@`` is masked whole, and neither it nor the
  Sentinels' password reaches a unit, a plist or a command line (each goes into a file the service reads), and the
  doctor fails a service file that holds one;
- one body reader for every JSON route, whatever the content type: a form or multipart body on a JSON route is a
  415, a hostile JSON body (nested 10,000 deep, a lone surrogate, an integer of 5,000 digits, a schema 40 deep) a
  400, never a 500, on every route of both doors (a table: a new route is checked by adding a row), and a body
  walked for its nesting does not stall the server's other requests;
- the Responses fields validated (a 400 naming the field), a batch of such lines failed once; stored responses
  bounded by count and bytes, the oldest first;
- the client address is the connection's unless a trusted proxy forwards it; the right token always passes, however
  many wrong ones came from the same address; a client holds a bounded number of connections; a head must come within
  a time shorter than the idle one;
- a token on the command line is refused off loopback (unless the operator insists), the warning about a password on
  the command line comes only when it was; the page redacts common secret names and the passwords of DSNs; a session
  record holds nothing derived from the token;
- and, from a third round (section 6): a lone surrogate written as bytes (CESU-8, UTF-16, UTF-32) is a 400 as an
  escaped one is; a Content-Length beside chunked is a 400, and a body is charged by the body budget what it holds.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import cli, free_port
from test_gateway import Fleet
from test_server import Served, json_error

TOKEN = "a-token-long-enough-for-a-lan-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def env_of(home: Path, **more: str) -> dict[str, str]:
    return {"NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml"), **more}


# -- 1. broker URLs, read once as redis-py reads them -----------------------------------------------------------
RAW_AT = "redis://na:at@pw-SECRET9@queue-host:6379/0"
SENTINEL = "redis+sentinel://:p%40ss-DATA7@s1:26379,s2:26379/nodeagent/0?sentinel_password=SENT-secret-5"


def test_a_password_with_a_raw_at_is_read_and_masked_whole_as_redis_py_reads_it():
    import redis

    from nodeagent.urls import UrlParts, masked, password_of, shown, without_secrets

    assert redis.connection.parse_url(RAW_AT)["password"] == password_of(RAW_AT) == "at@pw-SECRET9"
    assert shown(RAW_AT) == "redis://na:***@queue-host:6379/0" and "SECRET9" not in shown(RAW_AT)
    assert without_secrets(RAW_AT) == "redis://na@queue-host:6379/0"
    assert "SECRET9" not in masked(f"cannot reach {RAW_AT} (password at@pw-SECRET9 refused)", RAW_AT)
    assert UrlParts.of(SENTINEL).secrets() == {"broker-password": "p@ss-DATA7",
                                               "broker-sentinel-password": "SENT-secret-5"}
    assert "SENT-secret" not in shown(SENTINEL) and "DATA7" not in shown(SENTINEL)
    assert without_secrets(SENTINEL) == "redis+sentinel://s1:26379,s2:26379/nodeagent/0"


@pytest.mark.parametrize("manager", ["systemd", "launchd"])
def test_no_broker_secret_reaches_a_unit_a_plist_or_a_command_line(tmp_path, manager):
    """`service install` keeps the data password (raw ``@`` and all) and the Sentinels' in 0600 files the service
    reads, and the unit's command line names neither; the doctor fails a unit that holds one. (Installed by an
    interpreter the unit's sandbox can see: ``test_service.service_cli``.)"""
    from test_service import service_cli

    from nodeagent.service.units import holds_secret

    env = {**env_of(tmp_path), "HOME": str(tmp_path / "home")}
    for url in (RAW_AT, SENTINEL):
        out = service_cli(["service", "install", "--role", "worker", "--model", "fake", "--broker", url, "--manager",
                           manager, "--user", "--dry-run", "--json"], env)
        shown = json.loads(out.stdout)
        unit = shown["content"]
        for secret in ("at@pw-SECRET9", "SECRET9", "p@ss-DATA7", "DATA7", "SENT-secret-5", "p%40ss-DATA7"):
            assert secret not in unit and secret not in out.stderr, (secret, url)
        assert holds_secret(unit) is None
        names = sorted(Path(f).name.rsplit(".", 1)[-1] for f in shown["secret_files"])
        assert names == (["broker-password"] if url == RAW_AT else ["broker-password", "broker-sentinel-password"])
    assert holds_secret(f"ExecStart=/usr/bin/nodeagent worker --broker {RAW_AT}") == \
        "a broker URL with its password"
    assert holds_secret("ExecStart=/x worker --broker redis+sentinel://s1:26379/m?sentinel_password=abc") == \
        "a broker URL with its Sentinels' password"


def test_the_secrets_a_service_keeps_in_files_open_its_broker(tmp_path):
    """The files `service install` writes are what the service reads back into the URL: the raw-``@`` password
    and the Sentinels' reach redis-py whole."""
    from nodeagent.urls import parse_sentinel, password_of, with_secrets, without_secrets

    assert password_of(with_secrets(without_secrets(RAW_AT), password="at@pw-SECRET9")) == "at@pw-SECRET9"
    target = parse_sentinel(with_secrets(without_secrets(SENTINEL), "p@ss-DATA7", "SENT-secret-5"))
    assert (target.password, target.sentinel_password) == ("p@ss-DATA7", "SENT-secret-5")


# -- 2. one body reader for every JSON route ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def doors(tmp_path_factory, redis_server):
    """`serve` (a token, the page's controls, a queue of its own) and a gateway in front of a fake worker: the two
    doors every JSON route of the table is tried on."""
    import redis

    home = tmp_path_factory.mktemp("doors")
    serve = Served("fake", env_of(home / "serve", NODEAGENT_TOKEN=TOKEN, NODEAGENT_RESPONSES_MAX_COUNT="5"),
                   "--ui-admin", "--broker", f"sqlite://{home / 'serve.db'}")
    redis.Redis.from_url(redis_server.url).flushall()
    fleet = Fleet(redis_server.url, home / "gw", "--token", TOKEN, "--insecure-token-on-command-line",
                  env={"NODEAGENT_RESPONSES_MAX_COUNT": "5"})
    fleet.worker("w1", "fake")
    fleet.ready(1)
    yield {"serve": serve.url, "gateway": fleet.base}
    serve.stop()
    fleet.stop()


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# every JSON route, with a body it takes (a new route: one more row)
ROUTES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "fake", "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": "fake", "input": "hi", "max_output_tokens": 4},
    "/v1/batches": {"input_file_id": "file-none", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    "/v1/extract": {"input": "Alice is 34.", "schema": {"type": "object", "properties": {"age": {"type": "integer"}}}},
    "/v1/classify": {"input": "it crashes", "labels": ["bug", "question"]},
}


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def hostile(body: dict) -> dict[str, bytes]:
    """The route's body made hostile, each way, as raw JSON text."""
    text = json.dumps(body)
    return {
        "nested 10,000 deep": text[:-1].encode() + b', "x": ' + b"[" * 10000 + b"]" * 10000 + b"}",
        "a lone surrogate": text[:-1].encode() + b', "x": "\\ud800"}',
        "an integer of 5,000 digits": text[:-1].encode() + b', "x": 1' + b"0" * 5000 + b"}",
        "a schema 40 deep": text[:-1].encode() + b', "x": ' + json.dumps(deep_schema(40)).encode() + b"}",
    }


@pytest.mark.parametrize("door", ["serve", "gateway"])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_json_route_takes_json_only_and_refuses_hostile_bodies_with_a_400(doors, door, route):
    base = doors[door]
    text = json.dumps(ROUTES[route]).encode()
    for kind in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/plain"):
        r = httpx.post(base + route, content=text, headers={**AUTH, "Content-Type": kind}, timeout=30)
        assert json_error(r, 415)["code"] == "unsupported_media_type", (kind, r.text)
    for what, body in hostile(ROUTES[route]).items():
        r = httpx.post(base + route, content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400, (what, r.status_code, r.text[:300])
        assert r.json()["error"]["code"] in ("invalid_body", "unknown_parameter", "unsupported_parameter",
                                             "invalid_request"), (what, r.text[:300])
    # and JSON under its other spellings is read as JSON
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json", None):
        headers = {**AUTH, **({"Content-Type": kind} if kind else {})}
        r = httpx.post(base + route, content=text, headers=headers, timeout=30)
        assert r.status_code in (200, 404), (kind, r.status_code, r.text[:300])  # 404: the batch's file is none


def test_a_body_walked_for_its_nesting_does_not_stall_the_other_requests(doors):
    """The body's checks run off the event loop: while a large body is walked, the server answers others."""
    nested = b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "x": [' + \
        b",".join([b'["\\ud83d\\ude00"]'] * 200_000) + b"]}"  # 3.4 MB: every list and string walked
    done: dict = {}

    def big() -> None:
        started = time.monotonic()
        done["status"] = httpx.post(doors["serve"] + "/v1/chat/completions", content=nested,
                                    headers={**AUTH, "Content-Type": "application/json"}, timeout=60).status_code
        done["s"] = time.monotonic() - started

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.05)
    probes = []
    while t.is_alive():
        started = time.monotonic()
        httpx.get(doors["serve"] + "/healthz", timeout=30)
        probes.append(time.monotonic() - started)
    t.join()
    assert done["status"] in (200, 400, 413), done
    assert probes and max(probes) < max(0.5, done["s"] / 2), (probes, done)


# -- 3. the Responses fields, and what is stored ------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("text", {"format": 5}), ("text", {"format": "json_object"}), ("tools", 5), ("tools", "get_weather"),
    ("store", "no"), ("stream", "yes"), ("metadata", "notadict"), ("metadata", {str(i): "v" for i in range(17)}),
    ("metadata", {"k" * 65: "v"}), ("metadata", {"k": "v" * 513}), ("metadata", {"k": 5}),
])
def test_each_bad_responses_field_is_a_400_that_names_it(doors, field, value):
    for door in ("serve", "gateway"):
        r = httpx.post(doors[door] + "/v1/responses", json={**ROUTES["/v1/responses"], field: value}, headers=AUTH,
                       timeout=30)
        assert json_error(r, 400)["param"].split(".")[0] == field, (door, r.text)


def test_a_batch_of_bad_responses_lines_fails_once_with_its_errors(doors):
    import openai

    client = openai.OpenAI(base_url=doors["gateway"] + "/v1", api_key=TOKEN, max_retries=0)
    lines = "".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/responses",
                                "body": {**ROUTES["/v1/responses"], **bad}}) + "\n"
                    for i, bad in enumerate(({"text": {"format": 5}}, {"tools": 5}, {"metadata": "x"})))
    f = client.files.create(file=("bad.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    deadline = time.time() + 30
    while batch.status in ("validating", "in_progress") and time.time() < deadline:
        time.sleep(0.3)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "failed" and {e.line for e in batch.errors.data} == {1, 2, 3}, batch


@pytest.mark.parametrize("door", ["serve", "gateway"])
def test_stored_responses_are_bounded_the_oldest_going_first(doors, door):
    """NODEAGENT_RESPONSES_MAX_COUNT 5 here: of eight stored responses the first three are gone."""
    ids = []
    for i in range(8):
        r = httpx.post(doors[door] + "/v1/responses", json={**ROUTES["/v1/responses"], "input": f"note {i}"},
                       headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    kept = [httpx.get(f"{doors[door]}/v1/responses/{i}", headers=AUTH, timeout=30).status_code for i in ids]
    assert kept[-5:] == [200] * 5 and kept[:3] == [404] * 3, kept


def test_a_broker_keeps_a_bounded_collection_within_its_count_and_bytes(broker):
    for i in range(10):
        broker.kv_put(f"bounded:{i}", "x" * 100, 60, bound=(6, 10_000))
    assert [broker.kv_get(f"bounded:{i}") is not None for i in range(10)] == [False] * 4 + [True] * 6
    for i in range(10, 13):
        broker.kv_put(f"bounded:{i}", "y" * 300, 60, bound=(6, 1000))  # now the bytes bind first
    kept = [i for i in range(13) if broker.kv_get(f"bounded:{i}") is not None]
    assert kept == [10, 11, 12] or kept[-3:] == [10, 11, 12] and len(kept) * 100 <= 1000, kept
    broker.kv_put("other:1", "z", 60)  # another collection is not touched
    assert broker.kv_get("other:1") == "z"


# -- 4. who the client is, tokens, connections, heads ----------------------------------------------------------------
def test_forwarded_addresses_are_believed_only_from_a_trusted_proxy(tmp_path):
    """A local client that forges X-Forwarded-For gets no address of its own choosing: the throttle counts its
    wrong tokens under its real address, and the audit log names 127.0.0.1. Behind a trusted proxy, the forwarded
    address is the client's."""
    from nodeagent.broker.open import open_broker

    queue = f"sqlite://{tmp_path / 'q.db'}"
    server = Served("fake", env_of(tmp_path / "a", NODEAGENT_TOKEN=TOKEN), "--ui-admin", "--broker", queue)
    try:
        codes = [httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong",
                                                               "X-Forwarded-For": f"10.6.6.{i}"}, timeout=10)
                 .status_code for i in range(12)]
        assert codes[:10] == [401] * 10 and codes[10:] == [429] * 2, codes  # one address: the connection's
        cookie = httpx.get(f"{server.url}/ui?token={TOKEN}", follow_redirects=False, timeout=10).cookies
        r = httpx.post(server.url + "/ui/queues/classify.v1/pause", cookies=cookie, timeout=10,
                       headers={"Sec-Fetch-Site": "same-origin", "X-Forwarded-For": "10.6.6.6"})
        assert r.status_code == 303
    finally:
        server.stop()
    broker = open_broker(queue, tmp_path)
    [event] = [e for e in broker.events() if e["kind"] == "control"]
    assert "10.6.6.6" not in json.dumps(event) and "127.0.0.1" in event["by"], event
    proxied = Served("fake", env_of(tmp_path / "b", NODEAGENT_TOKEN=TOKEN, NODEAGENT_TRUSTED_PROXIES="127.0.0.1"))
    try:
        codes = [httpx.get(proxied.url + "/v1/models", headers={"Authorization": "Bearer wrong",
                                                                "X-Forwarded-For": f"10.6.6.{i}"}, timeout=10)
                 .status_code for i in range(12)]
        assert codes == [401] * 12, codes  # twelve clients behind the proxy, one wrong token each
    finally:
        proxied.stop()


def test_the_right_token_always_passes_however_many_wrong_ones_came(doors):
    wrong = {"Authorization": "Bearer not-the-token"}
    codes = [httpx.get(doors["serve"] + "/v1/models", headers=wrong, timeout=10).status_code for _ in range(12)]
    assert codes[:10] == [401] * 10 and codes[10:] == [429, 429]
    assert httpx.get(doors["serve"] + "/v1/models", headers=AUTH, timeout=10).status_code == 200
    form = httpx.post(doors["serve"] + "/ui/login", data={"token": TOKEN, "next": "/ui"}, timeout=10)
    assert form.status_code == 303  # and the page's sign-in with it


def test_one_client_cannot_fill_the_servers_connections_and_heads_come_in_time(tmp_path):
    server = Served("fake", env_of(tmp_path, NODEAGENT_MAX_CONNECTIONS="50", NODEAGENT_MAX_CLIENT_CONNECTIONS="8",
                                   NODEAGENT_HEADER_TIMEOUT_S="1", NODEAGENT_IDLE_TIMEOUT_S="5"))
    try:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(12)]
        time.sleep(0.2)
        refused = 0
        for s in held[8:]:
            s.settimeout(2)
            refused += s.recv(200).startswith(b"HTTP/1.1 503")
        assert refused == 4  # past its eight, this client's new connections are answered 503 and closed
        other = socket.socket()
        other.bind(("127.0.0.2", 0))  # another client (the loopback network's other address)
        other.connect(("127.0.0.1", server.port))
        other.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert answer(other).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)  # the eight that never sent a head are closed after the header time (1 s)
        closed = 0
        for s in held[:8]:
            s.settimeout(1)
            try:
                closed += s.recv(100) == b""
            except (ConnectionResetError, socket.timeout):
                closed += 1
        assert closed == 8
        other.settimeout(2)  # the kept-alive one waits its idle time (5 s), longer than a head's
        other.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert answer(other).startswith(b"HTTP/1.1 200")
        for s in held + [other]:
            s.close()
    finally:
        server.stop()


def answer(sock: socket.socket) -> bytes:
    """One whole answer on a kept-alive connection: its head, then its Content-Length of body."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return data


# -- 5. what was left from the first round --------------------------------------------------------------------------
def test_a_token_on_the_command_line_is_refused_off_loopback_unless_the_operator_insists(tmp_path):
    env = env_of(tmp_path)
    refused = cli(["serve", "--model", "fake", "--host", "0.0.0.0", "--port", str(free_port()), "--token", TOKEN],
                  env, check=False)
    assert refused.returncode != 0 and "--token-file" in refused.stderr and "Traceback" not in refused.stderr
    assert "--insecure-token-on-command-line" in refused.stderr
    insist = ["--token", TOKEN, "--insecure-token-on-command-line"]
    for ok_env, args in (({"NODEAGENT_TOKEN": TOKEN}, []), ({}, insist)):
        server = Served("fake", {**env, **ok_env}, "--host", "0.0.0.0", *args)
        try:
            assert httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).status_code == 200
        finally:
            server.stop()


def test_no_warning_of_a_password_on_the_command_line_when_it_came_from_the_environment(redis_server, tmp_path):
    import subprocess
    import sys

    url = redis_server.url.replace("redis://", "redis://:unused-password@")  # redis-server takes any password
    env = {**env_of(tmp_path), "NODEAGENT_BROKER": url}
    out = subprocess.run([sys.executable, "-m", "nodeagent", "worker", "--model", "fake", "--burst", "--types",
                          "classify"], env={**__import__("os").environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert "given on the command line" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("key", ["password", "PASSWORD", "passwd", "db_pwd", "passphrase", "api_key", "apiKey",
                                 "access_token", "refresh_token", "client_secret", "secret", "authorization",
                                 "cookie", "set-cookie", "bearer", "session_id", "sessionid", "private_key",
                                 "credentials", "x-api-key"])
def test_the_page_redacts_common_secret_names(key):
    from nodeagent.config import default_of
    from nodeagent.ui.views import redact

    keys = {k.strip() for k in default_of("ui_redact").split(",")}
    assert "S3CR3T-value" not in redact({"nested": [{key: "S3CR3T-value"}], "text": "kept"}, keys, 4000)


@pytest.mark.parametrize("text", ["postgres://u:MMM-secret@h/db", "mysql://root:p@ss-MMM-secret@db:3306/x",
                                  "amqp://guest:MMM-secret@rabbit:5672/", "redis://:MMM-secret@host:6379/0",
                                  "https://api.example.com/v1?api_token=MMM-secret&q=1",
                                  "Authorization: Bearer MMM-secret-token"])
def test_the_page_masks_the_passwords_of_dsns_and_bearer_tokens_in_values(text):
    from nodeagent.ui.views import redact

    shown = redact({"input": f"connect with {text} please"}, set(), 4000)
    assert "MMM-secret" not in shown and "connect with" in shown and "please" in shown


def test_a_session_record_holds_nothing_of_the_token(tmp_path):
    from nodeagent.ui.sessions import MemoryStore, Sessions

    store = MemoryStore()
    sessions = Sessions(store, TOKEN, 60)
    sid = sessions.open("127.0.0.1")
    [(key, (value, _))] = store._values.items()
    assert sessions.valid(sid) and set(json.loads(value)) == {"who", "at"}
    assert sid not in key and TOKEN not in key and TOKEN not in value
    assert not Sessions(store, TOKEN + "-new", 60).valid(sid)  # a new token finds none of the old ones


# -- 6. the third round: surrogates written as bytes, a length beside chunked, the body budget ---------------------
LONE = "\ud800"
# each route's body with a lone surrogate in a field the route reads (a field it does not know is refused first)
SURROGATE_BODIES = {
    "/v1/chat/completions": {**CHAT, "messages": [{"role": "user", "content": f"hi {LONE}"}]},
    "/v1/completions": {**ROUTES["/v1/completions"], "prompt": f"hi {LONE}"},
    "/v1/responses": {**ROUTES["/v1/responses"], "input": f"hi {LONE}"},
    "/v1/batches": {**ROUTES["/v1/batches"], "input_file_id": f"file-{LONE}"},
}
# the encodings json detects in bytes: each holds the surrogate as bytes, with no \ud800 escape for a walk to find
ENCODED = {"CESU-8 in a UTF-8 body": "utf-8", "a UTF-16-LE body": "utf-16-le", "a UTF-32 body": "utf-32"}


@pytest.fixture(scope="module")
def own_doors(tmp_path_factory):
    """`serve` (a token, a queue of its own) and a gateway in front of a fake worker, as ``doors``, but on a Redis of
    their own: the session's is flushed by the broker tests above, which takes the worker's record from ``doors``."""
    from conftest import RedisServer

    home = tmp_path_factory.mktemp("own-doors")
    (home / "redis").mkdir()
    redis = RedisServer(home / "redis").start()
    serve = Served("fake", env_of(home / "serve", NODEAGENT_TOKEN=TOKEN), "--broker", f"sqlite://{home / 'serve.db'}")
    fleet = Fleet(redis.url, home / "gw", "--token", TOKEN, "--insecure-token-on-command-line")
    try:
        fleet.worker("w1", "fake")
        fleet.ready(1)
        yield {"serve": serve.url, "gateway": fleet.base}
    finally:
        serve.stop()
        fleet.stop()
        redis.stop()


@pytest.mark.parametrize("door", ["serve", "gateway"])
@pytest.mark.parametrize("route", sorted(SURROGATE_BODIES))
def test_a_lone_surrogate_written_as_bytes_is_a_400_in_one_line(own_doors, door, route):
    """json.loads decodes bytes with 'surrogatepass': a surrogate encoded alone reached the route as a str nothing
    could encode again (a 500 where it was stored or tokenized). The body is decoded strictly; the same request
    whole, in the same encoding, is answered."""
    base = own_doors[door]
    text = json.dumps(SURROGATE_BODIES[route], ensure_ascii=False)
    for what, encoding in ENCODED.items():
        r = httpx.post(base + route, content=text.encode(encoding, "surrogatepass"),
                       headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
        error = json_error(r, 400)
        assert error["code"] == "invalid_body" and "lone surrogate" in error["message"], (what, r.text)
        assert "\n" not in error["message"] and "Traceback" not in r.text, (what, r.text)
        good = json.dumps(ROUTES[route], ensure_ascii=False).encode(encoding)
        r = httpx.post(base + route, content=good, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
        assert r.status_code == (404 if route == "/v1/batches" else 200), (what, r.status_code, r.text[:300])
        if route == "/v1/batches":  # the request was read: the batch's file is none
            assert json_error(r, 404)["code"] == "not_found", r.text


MIB = 1 << 20
BIG_CHAT = json.dumps(CHAT).encode() + b" " * (3 * MIB - len(json.dumps(CHAT)))  # 3 MiB: the request, then spaces
FIRST_BYTES = 64 << 10  # what each connection sends before any answer: within the socket buffers


def raw_post(port: int, framing: str) -> socket.socket:
    """A connection that has sent a chat request's head and the first part of its 3 MiB body, framed as ``framing``
    says: ``length`` (Content-Length), ``chunked``, or ``both`` (Content-Length: 10 beside chunked)."""
    head = [b"POST /v1/chat/completions HTTP/1.1", b"Host: 127.0.0.1", f"Authorization: Bearer {TOKEN}".encode(),
            b"Content-Type: application/json"]
    head += [b"Transfer-Encoding: chunked"] if framing in ("chunked", "both") else []
    head += [b"Content-Length: " + (b"10" if framing == "both" else str(len(BIG_CHAT)).encode())] \
        if framing in ("length", "both") else []
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + framed(BIG_CHAT[:FIRST_BYTES], framing))
    return sock


def framed(part: bytes, framing: str) -> bytes:
    return part if framing == "length" else b"%x\r\n%s\r\n" % (len(part), part)


def status_line(sock: socket.socket, wait_s: float) -> bytes | None:
    """The answer's status line and head, or None when none came within ``wait_s``."""
    sock.settimeout(wait_s)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            got = sock.recv(4096)
            if not got:
                break
            data += got
    except (socket.timeout, ConnectionResetError):
        pass
    return data or None


def six_bodies_at_once(port: int, framing: str) -> tuple[list[bytes], list[bytes]]:
    """Six 3 MiB chat bodies from one address, all begun before any ends: (the answers that came while the bodies
    were still arriving, those of the ones the server was reading, once their bodies were whole)."""
    socks = [raw_post(port, framing) for _ in range(6)]
    early: dict[int, bytes] = {}
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and len(early) < 6:
        for i, s in enumerate(socks):
            if i not in early and (head := status_line(s, 0.05)) is not None:
                early[i] = head
    rest = framed(BIG_CHAT[FIRST_BYTES:], framing) + (b"" if framing == "length" else b"0\r\n\r\n")
    read = [s for i, s in enumerate(socks) if i not in early]
    senders = [threading.Thread(target=s.sendall, args=(rest,)) for s in read]
    for t in senders:
        t.start()
    late = [status_line(s, 30) or b"(no answer)" for s in read]
    for t in senders:
        t.join(30)
    for s in socks:
        s.close()
    return list(early.values()), late


@pytest.mark.parametrize("door", ["serve", "gateway"])
def test_a_length_beside_chunked_is_refused_and_a_body_is_charged_what_it_holds(own_doors, door):
    """The body budget (NODEAGENT_MAX_BODY_BYTES 4 MiB: 8 MiB at once per client beyond its first body) charged the
    declared Content-Length while h11 read the chunked body: six 3 MiB bodies were read at once, each charged 10 bytes.
    Both headers are a 400 now (RFC 9112 6.1), the connection closed; without the trick two are read at once and four
    are 429s, with a length (3 MiB each) or chunked (each charged its route's 4 MiB), and a chunked body is read."""
    port = int(own_doors[door].rsplit(":", 1)[1])
    early, late = six_bodies_at_once(port, "both")
    assert len(early) == 6 and late == [], ([h[:12] for h in early], [h[:12] for h in late])
    for head in early:
        assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head.lower(), head
    for framing in ("length", "chunked"):
        early, late = six_bodies_at_once(port, framing)
        assert [h[:12] for h in early] == [b"HTTP/1.1 429"] * 4, (framing, early)
        assert [h[:12] for h in late] == [b"HTTP/1.1 200"] * 2, (framing, late)
    one = httpx.post(own_doors[door] + "/v1/chat/completions", content=iter([json.dumps(CHAT).encode()]), headers=AUTH,
                     timeout=30)  # an iterator: httpx sends it chunked
    assert one.status_code == 200, one.text


def test_a_body_that_outgrows_its_charge_takes_the_rest_from_the_budget_or_is_refused():
    """However a body is framed, what is read is charged: past what was charged at its start, the rest is taken
    from the client's budget as it arrives (a 429 when the client's other bodies leave no room), and all of it is
    given back once read."""
    import asyncio

    from nodeagent.errors import HttpError
    from nodeagent.server.middleware import BodyBudget, _bounded

    def read(budget: BodyBudget, chunks: list[bytes], charged: int) -> tuple[Any, list[int]]:
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
        held: list[int] = []

        async def receive() -> dict:
            held.append(budget.held.get("c", 0))
            return messages.pop(0)

        reader = _bounded(receive, 1000, 5, "form", budget, "c", charged, {})
        try:
            return asyncio.run(reader())["body"], held
        except HttpError as exc:
            return exc, held

    alone = BodyBudget(100)
    body, held = read(alone, [b"x" * 30] * 5, charged=10)  # a first body may be as large as its route allows
    assert body == b"x" * 150 and held == [10, 30, 60, 90, 120] and alone.held == {}
    crowded = BodyBudget(100)
    crowded.take("c", 40)  # another body of the same client, being read
    refused, held = read(crowded, [b"x" * 30] * 3, charged=10)
    assert isinstance(refused, HttpError) and refused.status == 429 and refused.code == "too_many_bodies"
    assert held == [50, 70, 100] and crowded.held == {"c": 40}, (held, crowded.held)
