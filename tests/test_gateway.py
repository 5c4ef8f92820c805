"""The fleet as one endpoint: `nodeagent gateway` in a process of its own, in front of worker processes on a
Redis or a SQLite queue, driven by the clients orchestrators use (the openai package, LangChain, LiteLLM).

First two real workers, one on SmolLM2 and one on Gemma 3, each request routed by the model it names; then fake
workers whose answers take their time, for what the fleet must survive: a worker killed (SIGKILL) while it holds
a request, whole or streamed, before its first piece and after it; a client that goes away; a refused request
(it never reaches the queue)."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from conftest import free_port, spawn

from nodeagent.broker.open import open_broker
from nodeagent.tasks.schema import validate_output

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                            "parameters": {"type": "object", "required": ["city"], "properties": {
                                                "city": {"type": "string"}}}}}


@contextlib.contextmanager
def on_redis(tmp_path: Path, workers: dict[str, list[str]], env: dict | None = None) -> Iterator["Fleet"]:
    """A real Redis, a gateway (``env`` its settings) and ``workers`` (node id: its arguments, the models first)
    ready behind it; everything stopped after."""
    from conftest import RedisServer

    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    fleet = Fleet(redis.url, tmp_path, env=env)
    try:
        for name, args in workers.items():
            fleet.workers[name] = spawn(["worker", *args, "--broker", redis.url, "--heartbeat", "0.5"],
                                        {"NODEAGENT_HOME": str(tmp_path / name)}, name)
        fleet.ready(len(workers))
        yield fleet
    finally:
        fleet.stop()
        redis.stop()


class Fleet:
    """A queue, its workers (by node id) and a gateway in front of them."""

    def __init__(self, url: str, home: Path, *gateway_args: str, env: dict | None = None) -> None:
        self.url, self.home = url, home
        self.broker = open_broker(url, home)
        self.workers: dict[str, object] = {}
        self.port = free_port()
        self.gateway = spawn(["gateway", "--broker", url, "--port", str(self.port), *gateway_args],
                             {"NODEAGENT_HOME": str(home / "gateway"), "NODEAGENT_HEARTBEAT_S": "0.5", **(env or {})})
        self.base = f"http://127.0.0.1:{self.port}"

    def worker(self, node_id: str, model: str, *extra: str, env: dict | None = None) -> None:
        self.workers[node_id] = spawn(["worker", "--model", model, "--broker", self.url, "--types",
                                       "chat,completion,extract,classify", "--heartbeat", "0.5", *extra],
                                      {"NODEAGENT_HOME": str(self.home / node_id), **(env or {})}, node_id)

    def ready(self, nodes: int, timeout_s: float = 180) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                r = httpx.get(self.base + "/readyz", timeout=2)
                if r.status_code == 200 and r.json()["nodes"] >= nodes:
                    return
            except httpx.HTTPError:
                pass
            for name, p in [("gateway", self.gateway), *self.workers.items()]:
                assert p.poll() is None, (name, p.stderr.read()[-3000:])
            time.sleep(0.2)
        raise AssertionError("the fleet did not become ready")

    def up(self, timeout_s: float = 60) -> None:
        """The gateway answers (/healthz), whether or not a node stands behind it."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if httpx.get(self.base + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.gateway.poll() is None, self.gateway.stderr.read()[-3000:]
            time.sleep(0.1)
        raise AssertionError("the gateway did not start")

    def kill(self, node_id: str) -> None:
        p = self.workers.pop(node_id)
        p.send_signal(signal.SIGKILL)
        p.wait(10)

    def kill_holder(self, task_id: str, timeout_s: float = 60) -> str:
        """SIGKILL the worker that holds ``task_id`` as soon as one does; its node id."""
        deadline = time.time() + timeout_s
        holder = None
        while time.time() < deadline and holder is None:
            view = self.broker.get(task_id)
            holder = view.node if view.state == "leased" else None
            time.sleep(0.02)
        assert holder in self.workers, "no worker took the task"
        self.kill(holder)
        return holder

    def stop(self) -> None:
        for p in [self.gateway, *self.workers.values()]:
            p.send_signal(signal.SIGTERM)
        for p in [self.gateway, *self.workers.values()]:
            try:
                p.wait(60)
            except Exception:  # noqa: BLE001
                p.kill()
        self.broker.close()


def engine_url(request, tmp_path_factory) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path_factory.mktemp('gw-sqlite') / 'queue.db'}"
    import redis

    server = request.getfixturevalue("redis_server")
    redis.Redis.from_url(server.url).flushall()
    return server.url


# -- two real models behind one endpoint --------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["redis", "sqlite"])
def real(request, tmp_path_factory, smollm2_path, gemma3_path):
    fleet = Fleet(engine_url(request, tmp_path_factory), tmp_path_factory.mktemp("gw-real"))
    for node_id, path in (("smol", smollm2_path), ("gemma", gemma3_path)):
        # every prompt read afresh: a streamed answer is compared with the same request answered whole
        fleet.worker(node_id, str(path), "--ctx", "4096", "--slots", "1", env={"NODEAGENT_DETERMINISTIC": "1"})
    fleet.ready(2)
    fleet.names = {"smol": Path(smollm2_path).stem, "gemma": Path(gemma3_path).stem}
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def client(real):
    import openai

    return openai.OpenAI(base_url=real.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.real_model
def test_models_lists_the_fleet(real):
    listed = httpx.get(real.base + "/v1/models", timeout=10).json()["data"]
    by_id = {m["id"]: m for m in listed}
    for node_id, name in real.names.items():
        assert [n["id"] for n in by_id[name]["nodes"]] == [node_id] and by_id[name]["nodes"][0]["free_slots"] >= 0
        assert httpx.get(real.base + f"/v1/models/{name}", timeout=10).json()["id"] == name
    missing = httpx.get(real.base + "/v1/models/no-such-model", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.real_model
def test_chat_is_routed_by_model_whole_and_streamed(real, client):
    for node_id, name in real.names.items():
        raw = client.chat.completions.with_raw_response.create(
            model=name, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0)
        r = raw.parse()
        assert raw.headers["x-nodeagent-node"] == node_id and raw.headers["x-nodeagent-attempts"] == "1"
        assert r.choices[0].message.content and r.usage.completion_tokens <= 12
        pieces, finish = [], None
        for chunk in client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Count to 5."}],
                                                    max_tokens=16, temperature=0, stream=True):
            for c in chunk.choices:
                pieces.append(c.delta.content or "")
                finish = c.finish_reason or finish
        assert "".join(pieces) and finish in ("stop", "length")


@pytest.mark.real_model
def test_tools_required_and_completions_through_the_gateway(real, client):
    name = real.names["smol"]
    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and validate_output(WEATHER["function"]["parameters"],
                                                                   json.loads(call.function.arguments)) is None
    streamed = {}
    with client.chat.completions.stream(model=name, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        tools=[WEATHER], tool_choice="required", temperature=0,
                                        max_tokens=60) as stream:
        list(stream)
        final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls[0].function
    assert streamed.name == "get_weather" and json.loads(streamed.arguments)["city"]
    text = client.completions.create(model=real.names["gemma"], prompt="Once upon a time", max_tokens=8,
                                     temperature=0)
    assert text.choices[0].text and text.model == real.names["gemma"]


@pytest.mark.real_model
def test_langchain_and_litellm_pointed_at_the_gateway(real):
    import litellm
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=40)
        age: int = Field(ge=0, le=130)

    chat = ChatOpenAI(model=real.names["smol"], base_url=real.base + "/v1", api_key="unused", temperature=0,
                      max_retries=0)
    person = chat.with_structured_output(Person).invoke("Extract the person. Text: Alice Martin is 34.")
    assert isinstance(person, Person) and person.name

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    ai = chat.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Lyon?")
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    r = litellm.completion(model=f"openai/{real.names['gemma']}", api_base=real.base + "/v1", api_key="unused",
                           messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
    assert r.choices[0].message.content


@pytest.mark.real_model
def test_the_responses_api_through_the_gateway(real):
    """The Responses door's client checks (test_responses.py) against the fleet: stored in its broker, so a
    continuation and GET work on any gateway. On Redis (the fleet's broker) SmolLM2 with no budget, and Gemma 3 at
    one (test_responses.py takes every budget through serve: the door is the same code); on SQLite, which serves
    the same door, SmolLM2 at one (the store is another)."""
    from test_responses import agents_checks, langchain_checks, openai_checks, pydantic_ai_checks

    on_redis = real.url.startswith("redis")
    runs = [(real.names["smol"], None if on_redis else 60)]
    runs += [(real.names["gemma"], 60)] if on_redis else []
    for model, max_tokens in runs:
        openai_checks(real.base, model, max_tokens, stored=True)
        agents_checks(real.base, model, max_tokens)
        pydantic_ai_checks(real.base, model, max_tokens)
        langchain_checks(real.base, model, max_tokens)


def test_typed_routes_through_the_gateway(real):
    got = httpx.post(real.base + "/v1/classify", json={"input": "The app crashes on start",
                                                       "labels": ["bug", "question"]}, timeout=120).json()
    assert got["status"] == "ok" and got["output"]["label"] in ("bug", "question"), got
    got = httpx.post(real.base + "/v1/extract", json={"input": "Alice is 34.", "schema": {
        "type": "object", "required": ["age"], "properties": {"age": {"type": "integer"}}}}, timeout=120).json()
    assert got["status"] == "ok" and isinstance(got["output"]["age"], int), got


@pytest.mark.real_model
def test_a_refused_request_never_reaches_the_queue(real):
    before = {(d.queue, d.model): d.enqueued for d in real.broker.demand()}
    r = httpx.post(real.base + "/v1/chat/completions", json={
        "model": real.names["smol"], "messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "x"}},
        timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "audio"
    r = httpx.post(real.base + "/v1/chat/completions", json={
        "model": real.names["smol"], "messages": [{"role": "user", "content": "hi"}], "n": 40}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(real.base + "/v1/chat/completions", json={
        "model": "nobody-serves-this", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert {(d.queue, d.model): d.enqueued for d in real.broker.demand()} == before


# -- what the fleet survives (fake workers: answers that take their time) ----------------------------------------
@pytest.fixture(params=["redis", "sqlite"])
def fleet(request, tmp_path_factory):
    f = Fleet(engine_url(request, tmp_path_factory), tmp_path_factory.mktemp("gw-fake"))
    yield f
    f.stop()


def held_by(fleet: Fleet, timeout_s: float = 30) -> tuple[str, str]:
    """(task, node) of the first task a worker leases."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        views = [fleet.broker.get(t) for t in _task_ids(fleet.broker)]
        held = [v for v in views if v is not None and v.state == "leased"]
        if held:
            return held[0].id, held[0].node
        time.sleep(0.05)
    raise AssertionError("no worker took the request")


def _task_ids(broker) -> list[str]:
    if broker.url.startswith("sqlite"):
        return [r[0] for r in broker._db().execute("SELECT id FROM tasks")]
    return [k.rsplit(":", 1)[1] for k in broker.r.scan_iter("nodeagent:v1:task:*")]


def test_a_whole_request_survives_the_death_of_its_worker(fleet):
    for node_id in ("a", "b"):
        fleet.worker(node_id, "fake:latency_ms=2500", "--lease", "1")
    fleet.ready(2)
    answer: dict = {}

    def ask() -> None:
        answer["r"] = httpx.post(fleet.base + "/v1/chat/completions", json={
            "model": "fake:latency_ms=2500", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60)

    t = threading.Thread(target=ask)
    t.start()
    task, node = held_by(fleet)
    fleet.kill(node)
    t.join(60)
    r = answer["r"]
    assert r.status_code == 200, r.text
    assert r.headers["x-nodeagent-attempts"] == "2" and r.headers["x-nodeagent-node"] != node
    assert r.json()["choices"][0]["message"]["content"] is not None
    assert fleet.broker.get(task).history[0].error.code == "lease_expired"


def stream_events(base: str, body: dict, on_first_piece=None, route: str = "chat") -> list[dict]:
    """A streamed request's events, as parsed JSON: chat's chunks ("[DONE]" last), or the Responses API's events
    (``route`` "responses": the chat body's messages sent as its input)."""
    out = []
    if route == "responses":
        body = {"model": body["model"], "input": body["messages"], "max_output_tokens": body["max_tokens"]}
    path = "/v1/chat/completions" if route == "chat" else "/v1/responses"
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            out.append("[DONE]" if data == "[DONE]" else json.loads(data))
            if on_first_piece and isinstance(out[-1], dict) and (any(
                    (c.get("delta") or {}).get("content") for c in out[-1].get("choices", []))
                    or out[-1].get("type") == "response.output_text.delta"):
                on_first_piece()
                on_first_piece = None
    return out


def the_end(events: list, route: str) -> tuple[bool, list[dict]]:
    """Whether the stream ended as its shape ends ([DONE], or a terminal response event), and its errors."""
    if route == "chat":
        return events[-1] == "[DONE]", [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    ended = events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    return ended, [e for e in events if e["type"] == "error"]


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_a_stream_before_its_first_piece_follows_the_next_attempt(fleet, route):
    for node_id in ("a", "b"):
        fleet.worker(node_id, "fake:latency_ms=2500", "--lease", "1")
    fleet.ready(2)
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("events", stream_events(fleet.base, {
        "model": "fake:latency_ms=2500", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        route=route)))
    t.start()
    task, node = held_by(fleet)
    fleet.kill(node)
    t.join(60)
    events = got["events"]
    ended, errors = the_end(events, route)
    assert ended and not errors
    if route == "chat":
        assert any(c.get("finish_reason") for e in events[:-1] for c in e["choices"])
    else:
        assert [e["sequence_number"] for e in events] == list(range(len(events)))  # one beginning, not two
        assert events[-1]["response"]["output"]
    assert fleet.broker.get(task).attempts == 2


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_a_stream_after_its_first_piece_continues_on_the_next_node(fleet, route):
    """The worker streaming the answer is killed after its first piece: the next attempt continues from what was
    sent, and the client gets one stream, no error, no second beginning, its text the task's whole answer."""
    model = "fake:token_ms=120,ramble=1"
    for node_id in ("a", "b"):
        fleet.worker(node_id, model, "--lease", "1")
    fleet.ready(2)
    holder: dict = {}

    def kill_the_holder() -> None:
        holder["task"], holder["node"] = held_by(fleet)
        fleet.kill(holder["node"])

    events = stream_events(fleet.base, {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 30}, on_first_piece=kill_the_holder, route=route)
    ended, errors = the_end(events, route)
    assert ended and not errors, errors
    result = fleet.broker.result(holder["task"])
    assert result is not None and result.attempts == 2
    if route == "chat":
        chunks = [e for e in events if isinstance(e, dict)]
        contents = "".join((c.get("delta") or {}).get("content") or "" for e in chunks for c in e["choices"])
        assert sum(1 for e in chunks for c in e["choices"] if (c.get("delta") or {}).get("role")) == 1
        [final] = [e for e in chunks if any(c.get("finish_reason") for c in e["choices"])]
        assert final["nodeagent_resumed"] == 1
        assert contents == result.output["choices"][0]["message"]["content"]
    else:
        assert [e["sequence_number"] for e in events] == list(range(len(events)))  # one beginning, not two
        contents = "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")
        assert events[-1]["type"] in ("response.completed", "response.incomplete")  # rambling: max tokens hit
        assert contents == events[-1]["response"]["output"][0]["content"][0]["text"]
    assert contents and fleet.broker.get(holder["task"]).state == "done"


def test_a_draining_node_hands_its_stream_to_another(fleet):
    """NODEAGENT_DRAIN_HANDOFF: SIGTERM to the node streaming an answer gives the stream back at once; the other
    node continues it, and the draining node exits without finishing it."""
    model = "fake:token_ms=120,ramble=1"
    for node_id in ("a", "b"):
        fleet.worker(node_id, model, env={"NODEAGENT_DRAIN_HANDOFF": "1"})
    fleet.ready(2)
    holder: dict = {}

    def drain_the_holder() -> None:
        holder["task"], holder["node"] = held_by(fleet)
        p = fleet.workers.pop(holder["node"])
        p.send_signal(signal.SIGTERM)
        holder["proc"] = p

    events = stream_events(fleet.base, {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 30}, on_first_piece=drain_the_holder)
    holder["proc"].wait(30)
    assert holder["proc"].returncode == 0
    ended, errors = the_end(events, "chat")
    assert ended and not errors, errors
    chunks = [e for e in events if isinstance(e, dict)]
    [final] = [e for e in chunks if any(c.get("finish_reason") for c in e["choices"])]
    assert final["nodeagent_resumed"] == 1
    result = fleet.broker.result(holder["task"])
    # given back unrun, the attempt is not counted; the other node finished it
    assert result.status == "ok" and fleet.broker.get(holder["task"]).history[-1].node != holder["node"]
    contents = "".join((c.get("delta") or {}).get("content") or "" for e in chunks for c in e["choices"])
    assert contents == result.output["choices"][0]["message"]["content"]


def test_a_stream_that_cannot_be_continued_ends_with_the_reason(fleet):
    """Log-probabilities asked for: the next node cannot give them for tokens it did not sample, so the stream
    ends with node_lost saying so, and its task is cancelled rather than run for nobody."""
    model = "fake:token_ms=120,ramble=1"
    for node_id in ("a", "b"):
        fleet.worker(node_id, model, "--lease", "1")
    fleet.ready(2)
    holder: dict = {}

    def kill_the_holder() -> None:
        holder["task"], holder["node"] = held_by(fleet)
        fleet.kill(holder["node"])

    started = time.time()
    events = stream_events(fleet.base, {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 60, "logprobs": True}, on_first_piece=kill_the_holder)
    assert time.time() - started < 30  # never hangs
    ended, errors = the_end(events, "chat")
    assert ended and len(errors) == 1 and errors[0]["code"] == "node_lost"
    assert "log-probabilities" in errors[0]["message"], errors[0]
    deadline = time.time() + 10
    while time.time() < deadline and fleet.broker.get(holder["task"]).state != "cancelled":
        time.sleep(0.1)
    assert fleet.broker.get(holder["task"]).state in ("cancelled", "dead")  # not run again for nobody


def test_a_client_that_goes_away_cancels_its_task(fleet):
    fleet.worker("a", "fake:latency_ms=5000", "--lease", "2")
    fleet.ready(1)
    body = {"model": "fake:latency_ms=5000", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with pytest.raises(httpx.ReadTimeout):  # the running one
        httpx.post(fleet.base + "/v1/chat/completions", json=body, timeout=1.0)
    with pytest.raises(httpx.ReadTimeout):  # and one still waiting behind it
        httpx.post(fleet.base + "/v1/chat/completions", json=body, timeout=1.0)
    views = both_cancelled(fleet)
    never_started = [v for v in views if not v.history]
    assert never_started  # the one that waited was never run


def test_status_lists_the_gateway_apart_from_the_nodes(fleet, isolated_env):
    from conftest import cli

    fleet.worker("a", "fake")
    fleet.ready(1)
    shown = json.loads(cli(["status", "--broker", fleet.url, "--json"], isolated_env).stdout)
    assert [g["id"] for g in shown["gateways"]] == [f"gateway-{__import__('socket').gethostname()}-{fleet.port}"]
    assert [n["id"] for n in shown["nodes"]] == ["a"] and not shown["gateways"][0]["lost"]
    metrics = httpx.get(fleet.base + "/metrics", timeout=10).text
    assert "nodeagent_http_requests_total" in metrics and "nodeagent_queue_tasks" in metrics


def test_a_typed_request_with_an_idempotency_key_runs_once(fleet):
    """The same /v1/extract body with the same key, sent twice to the gateway: one task, one result (as on `serve
    --broker`)."""
    fleet.worker("a", "fake:latency_ms=200")
    fleet.ready(1)
    body = {"input": "Alice is 34.", "idempotency_key": "k-1", "schema": {
        "type": "object", "required": ["age"], "properties": {"age": {"type": "integer"}}}}
    first = httpx.post(fleet.base + "/v1/extract", json=body, timeout=60)
    again = httpx.post(fleet.base + "/v1/extract", json=body, timeout=60)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert first.json()["status"] == "ok" and again.json() == first.json()
    assert again.json()["task_id"] == first.json()["task_id"] and len(_task_ids(fleet.broker)) == 1
    other = httpx.post(fleet.base + "/v1/extract", json={**body, "idempotency_key": "k-2"}, timeout=60).json()
    assert other["task_id"] != first.json()["task_id"] and len(_task_ids(fleet.broker)) == 2


EXTRACT = {"input": "Alice is 34.", "schema": {"type": "object", "required": ["age"],
                                                "properties": {"age": {"type": "integer"}}}}


@pytest.fixture(params=["redis", "sqlite"])
def impatient(request, tmp_path_factory):
    """A gateway that gives a request 2 s (NODEAGENT_GATEWAY_TIMEOUT_S)."""
    f = Fleet(engine_url(request, tmp_path_factory), tmp_path_factory.mktemp("gw-impatient"),
              env={"NODEAGENT_GATEWAY_TIMEOUT_S": "2"})
    yield f
    f.stop()


def test_a_key_retried_after_the_gateways_verdict_runs_again_and_an_operators_cancel_answers_at_once(impatient):
    """A keyed request the gateway gives up on (its deadline) frees its key with the cancel: the orchestrator's
    retry with the key runs the work (on the node that joined meanwhile) and gets its result, instead of a 504 for a
    task that can no longer finish. A key whose task an operator cancelled answers the retry at once with a 409
    that says so, not after the deadline."""
    fleet = impatient
    fleet.worker("slow", "fake:latency_ms=8000")
    fleet.ready(1)
    body = {**EXTRACT, "idempotency_key": "order-17"}
    first = httpx.post(fleet.base + "/v1/extract", json=body, timeout=30)
    assert first.status_code == 504, first.text
    fleet.kill("slow")
    fleet.worker("fast", "fake:latency_ms=20")
    fleet.ready(1)
    started = time.monotonic()
    again = httpx.post(fleet.base + "/v1/extract", json=body, timeout=30)
    assert again.status_code == 200 and again.json()["status"] == "ok", again.text
    assert time.monotonic() - started < 2
    retried = again.json()["task_id"]
    assert retried != first.json()["error"]["message"] and fleet.broker.get(retried).attempts == 1
    assert httpx.post(fleet.base + "/v1/extract", json=body, timeout=30).json()["task_id"] == retried  # one task now
    # an operator's cancel keeps the key, and says so at once
    from nodeagent.client import Client
    from nodeagent.tasks.contracts import ExtractTask

    parked = Client(fleet.broker).submit(ExtractTask.model_validate({**EXTRACT, "input": "Bob is 9."}),
                                         idempotency_key="order-18", model="nobody-serves-this")
    assert fleet.broker.cancel(parked)
    started = time.monotonic()
    r = httpx.post(fleet.base + "/v1/extract", json={**EXTRACT, "idempotency_key": "order-18"}, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "task_cancelled", r.text
    assert parked in r.json()["error"]["message"] and time.monotonic() - started < 3


@pytest.fixture(params=["redis", "sqlite"])
def small_inputs(request, tmp_path_factory):
    """A gateway whose fields are bounded at 64 KB (NODEAGENT_MAX_INPUT_BYTES), before a worker of 1 MB."""
    f = Fleet(engine_url(request, tmp_path_factory), tmp_path_factory.mktemp("gw-small"),
              env={"NODEAGENT_MAX_INPUT_BYTES": str(64 << 10), "NODEAGENT_ANSWERED_KEEP_S": "1"})
    yield f
    f.stop()


def test_the_broker_keeps_only_what_something_still_points_at(small_inputs):
    """A request refused for its size is refused at the door and keeps nothing in the broker (40 such 3.9 MB
    /v1/responses requests grew Redis by 173 MB); an answered request's task and result go a moment after its answer
    is delivered (NODEAGENT_ANSWERED_KEEP_S), a refusal of the request too (a 4xx the client has); what a key names
    stays, for the key; a failure of the fleet (backend_error past its attempts) stays a dead letter for the
    operator."""
    fleet = small_inputs
    fleet.worker("a", "fake:fail=[boom]", env={"NODEAGENT_MAX_ATTEMPTS": "1"})
    fleet.ready(1)
    big = httpx.post(fleet.base + "/v1/responses", json={"model": "fake", "input": "word " * 20_000}, timeout=30)
    assert big.status_code == 413 and big.json()["error"]["code"] == "input_too_large", big.text
    assert _task_ids(fleet.broker) == []
    ok = httpx.post(fleet.base + "/v1/classify", json={"input": "ticket", "labels": ["bug", "question"]}, timeout=30)
    assert ok.status_code == 200 and ok.json()["status"] == "ok", ok.text
    chat = httpx.post(fleet.base + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=30)
    assert chat.status_code == 200, chat.text
    refused = httpx.post(fleet.base + "/v1/completions", json={"prompt": [2**40], "max_tokens": 2}, timeout=30)
    assert refused.status_code == 400 and "not in the model's vocabulary" in refused.text, refused.text  # the node's
    keyed = httpx.post(fleet.base + "/v1/classify", json={"input": "kept", "labels": ["bug", "question"],
                                                         "idempotency_key": "kept-1"}, timeout=30).json()
    failed = httpx.post(fleet.base + "/v1/classify", json={"input": "it went [boom]", "labels": ["bug", "question"]},
                        timeout=30).json()
    assert failed["error"]["code"] == "backend_error", failed
    assert len(_task_ids(fleet.broker)) == 5  # answered: each kept a moment (NODEAGENT_ANSWERED_KEEP_S, 1 s here)
    deadline = time.time() + 10
    while time.time() < deadline and len(_task_ids(fleet.broker)) > 2:
        time.sleep(0.2)
        fleet.broker.purge(3600)  # SQLite drops them at its purge (each minute); Redis's expire
    assert sorted(_task_ids(fleet.broker)) == sorted([keyed["task_id"], failed["task_id"]])
    assert fleet.broker.result(keyed["task_id"]).status == "ok"
    assert [v.id for v in fleet.broker.dead()] == [failed["task_id"]]


def test_a_key_whose_task_its_deadline_ended_runs_again(impatient):
    """A worker that ends a keyed task at its deadline (2 s) before the gateway's own verdict (2 s and its grace)
    dead-letters it with deadline_exceeded: the deadline was the request's, so the key is freed as by the gateway's
    cancel, and the retry with the key runs the work (before, every retry answered deadline_exceeded at once for the
    retention, and the work never ran)."""
    fleet = impatient
    fleet.worker("slow", "fake:latency_ms=3000")
    fleet.ready(1)
    body = {**EXTRACT, "idempotency_key": "order-19"}
    first = httpx.post(fleet.base + "/v1/extract", json=body, timeout=30)
    assert first.json()["error"]["code"] == "deadline_exceeded", first.text
    fleet.kill("slow")
    fleet.worker("fast", "fake:latency_ms=20")
    fleet.ready(1)
    again = httpx.post(fleet.base + "/v1/extract", json=body, timeout=30)
    assert again.status_code == 200 and again.json()["status"] == "ok", again.text
    assert again.json()["task_id"] != first.json()["task_id"]


@pytest.mark.parametrize("impatient,slow_ms", [("redis", 3000), ("sqlite", 8000)], indirect=["impatient"])
def test_a_retry_waiting_on_a_task_its_first_request_gave_up_runs_its_own(impatient, slow_ms):
    """Two requests with one key, through two gateways of one broker: the second (a gateway giving 30 s) waits on
    the first's task; that task ends unrun by the first request's own verdict (its 2 s deadline: met by the worker
    when its prompt takes 3 s, by the gateway's cancel when it takes 8), which frees the key, and the second then
    runs its own request under the key and gets the result, not a 409 blaming an operator who never acted (nor the
    first's deadline_exceeded)."""
    fleet = impatient
    patient = free_port()
    other = spawn(["gateway", "--broker", fleet.url, "--port", str(patient)],
                  {"NODEAGENT_HOME": str(fleet.home / "patient"), "NODEAGENT_HEARTBEAT_S": "0.5",
                   "NODEAGENT_GATEWAY_TIMEOUT_S": "30"})
    try:
        fleet.worker("slow", f"fake:latency_ms={slow_ms}")
        fleet.ready(1)
        body = {**EXTRACT, "idempotency_key": "order-20"}
        out: dict = {}
        first = threading.Thread(target=lambda: out.setdefault("first", httpx.post(
            fleet.base + "/v1/extract", json=body, timeout=30)))
        first.start()
        held_by(fleet)  # the slow worker holds the first request's task
        second = threading.Thread(target=lambda: out.setdefault("second", httpx.post(
            f"http://127.0.0.1:{patient}/v1/extract", json=body, timeout=60)))
        second.start()
        fleet.worker("fast", "fake:latency_ms=20")
        first.join(30)
        second.join(60)
    finally:
        other.send_signal(signal.SIGTERM)
        other.wait(30)
    assert out["first"].status_code == 504 or out["first"].json()["error"]["code"] == "deadline_exceeded", \
        out["first"].text
    assert out["second"].status_code == 200 and out["second"].json()["status"] == "ok", out["second"].text
    assert out["second"].json()["task_id"] != out["first"].json().get("task_id")


def test_the_wake_log_stays_short_and_a_lost_end_is_read_from_the_task(fleet):
    """Every whole request's end is told to the gateway's own log: its reader trims what it read, so the log holds
    what is unread, however many requests came. An end that is gone from the log before it was read (a reader far
    behind its cap, or a node whose version tells no log) is read from the task itself: the request still gets its
    answer, not a 504."""
    fleet.worker("a", "fake:latency_ms=5")
    fleet.ready(1)
    for i in range(60):
        r = httpx.post(fleet.base + "/v1/classify", json={"input": f"ticket {i}", "labels": ["bug", "question"]},
                       timeout=30)
        assert r.status_code == 200, r.text
    time.sleep(2.5)  # a trim comes every 2 s
    wake = f"gateway-gateway-{__import__('socket').gethostname()}-{fleet.port}"
    assert wake_entries(fleet.broker, wake) <= 5
    fleet.kill("a")
    fleet.worker("slow", "fake:latency_ms=1500")
    fleet.ready(1)
    done: dict = {}
    t = threading.Thread(target=lambda: done.setdefault("r", httpx.post(
        fleet.base + "/v1/classify", json={"input": "lost end", "labels": ["bug", "question"]},
        headers={"X-Stainless-Timeout": "30"}, timeout=60)))
    t.start()
    deadline = time.monotonic() + 6
    while t.is_alive() and time.monotonic() < deadline:  # every event the log gets is dropped unread
        clear_log(fleet.broker, wake)
        time.sleep(0.01)
    t.join(30)
    assert done["r"].status_code == 200 and done["r"].json()["status"] == "ok", done["r"].text


def wake_entries(broker, name: str) -> int:
    if broker.url.startswith("sqlite"):
        return broker._db().execute("SELECT COUNT(*) FROM logs WHERE task_id=?", (name,)).fetchone()[0]
    return broker.r.xlen(f"nodeagent:v1:log:{name}")


def clear_log(broker, name: str) -> None:
    if broker.url.startswith("sqlite"):
        with broker._tx() as db:
            db.execute("DELETE FROM logs WHERE task_id=?", (name,))
    else:
        broker.r.xtrim(f"nodeagent:v1:log:{name}", maxlen=0)


def test_a_request_type_no_live_node_can_run_is_a_503_that_says_why(fleet):
    """Nodes hold the model but none takes the request's type: their version predates it (a node's record lists
    what its version knows), or they were started without it. Both are a 503 that says which, not a 404; a model no
    node holds is still a 404."""
    from nodeagent.broker.base import NodeRecord

    def node(node_id: str, **fields) -> None:
        fleet.broker.register(NodeRecord(id=node_id, hostname=node_id, agent_version="0.2.0", contract="1.1",
                                         os="linux", arch="aarch64", backend="fake", state="ready", heartbeat_s=600,
                                         **fields))

    node("older", models=["pi-model"], task_types=["classify.v1"], knows=["classify.v1", "extract.v1"])
    node("narrow", models=["mac-model"], task_types=["classify.v1"], knows=["classify.v1", "chat.v1"])
    fleet.up()
    time.sleep(1.2)  # the gateway's view of the fleet is at most a second old
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(fleet.base + "/v1/chat/completions", json={"model": "pi-model", **ask}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "type_unavailable", r.text
    assert "no live node can run chat.v1 requests" in r.json()["error"]["message"]
    assert "nodeagent 0.2.0 (contract 1.1), which predates them; upgrade a node" in r.json()["error"]["message"]
    r = httpx.post(fleet.base + "/v1/chat/completions", json={"model": "mac-model", **ask}, timeout=30)
    assert r.status_code == 503 and "NODEAGENT_TYPES" in r.json()["error"]["message"]
    r = httpx.post(fleet.base + "/v1/chat/completions", json={"model": "no-such-model", **ask}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert not _task_ids(fleet.broker)  # nothing was queued


# -- a stream survives its node, on real models -------------------------------------------------------------------
@pytest.fixture(scope="module", params=["redis", "sqlite"])
def twins(request, tmp_path_factory, smollm2_path, gemma3_path):
    """Two workers of each real model (lease 2 s), so that another can take over the one streaming."""
    fleet = Fleet(engine_url(request, tmp_path_factory), tmp_path_factory.mktemp("gw-twins"))
    fleet.paths = {"smol": str(smollm2_path), "gemma": str(gemma3_path)}
    for name in fleet.paths:
        for twin in ("1", "2"):
            twin_worker(fleet, name + twin)
    fleet.ready(4)
    yield fleet
    fleet.stop()


def twin_worker(fleet: Fleet, node_id: str) -> None:
    fleet.worker(node_id, fleet.paths[node_id[:-1]], "--ctx", "2048", "--slots", "1", "--lease", "2")


def killed_after_first_piece(fleet: Fleet, body: dict) -> tuple[list, str]:
    """A chat stream whose worker is killed with SIGKILL after the first piece (and started again, for the next
    test); its events and its task."""
    holder: dict = {}

    def kill_the_holder() -> None:
        holder["task"], holder["node"] = held_by(fleet)
        fleet.kill(holder["node"])

    events = stream_events(fleet.base, body, on_first_piece=kill_the_holder)
    twin_worker(fleet, holder["node"])
    fleet.ready(4)
    return events, holder["task"]


def one_stream(events: list) -> str:
    """The text of a stream that ended well, checked to be one stream: no error, one beginning, resumed once."""
    ended, errors = the_end(events, "chat")
    assert ended and not errors, errors
    chunks = [e for e in events if isinstance(e, dict)]
    assert sum(1 for e in chunks for c in e["choices"] if (c.get("delta") or {}).get("role")) == 1
    [final] = [e for e in chunks if any(c.get("finish_reason") for c in e["choices"])]
    assert final.get("nodeagent_resumed") == 1, final
    return "".join((c.get("delta") or {}).get("content") or "" for e in chunks for c in e["choices"])


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smol", "gemma"])
def test_a_real_stream_continues_from_what_was_sent(twins, model):
    name = Path(twins.paths[model]).stem
    events, task = killed_after_first_piece(twins, {
        "model": name, "max_tokens": 80, "temperature": 0,
        "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]})
    text = one_stream(events)
    result = twins.broker.result(task)
    assert result.attempts == 2 and text == result.output["choices"][0]["message"]["content"]
    first = next(c["delta"]["content"] for e in events if isinstance(e, dict) for c in e["choices"]
                 if (c.get("delta") or {}).get("content"))
    assert text.startswith(first) and len(text) > len(first)  # the sent prefix, then the continuation
    assert result.output["usage"]["completion_tokens"] <= 80


@pytest.mark.real_model
def test_a_real_json_schema_stream_still_validates_after_a_resume(twins):
    schema = {"type": "object", "additionalProperties": False, "required": ["title", "lines"],
              "properties": {"title": {"type": "string", "maxLength": 60},
                             "lines": {"type": "array", "minItems": 3, "maxItems": 6,
                                       "items": {"type": "string", "maxLength": 80}}}}
    events, task = killed_after_first_piece(twins, {
        "model": Path(twins.paths["gemma"]).stem, "max_tokens": 120, "temperature": 0,
        "messages": [{"role": "user", "content": "A poem about the sea, as JSON with a title and its lines."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "poem", "schema": schema}}})
    text = one_stream(events)
    assert validate_output(schema, json.loads(text)) is None
    assert twins.broker.result(task).attempts == 2


@pytest.mark.real_model
def test_a_real_tool_call_stream_survives_its_node(twins):
    """A streamed tool call goes out whole once its arguments are complete (never as a half that a next node
    would have to continue), so a node killed while writing one leaves nothing sent: the next attempt writes the
    call afresh, and the client gets one call whose arguments validate."""
    params = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
              "properties": {"city": {"type": "string", "maxLength": 40},
                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
    body = {"model": Path(twins.paths["smol"]).stem, "max_tokens": 120, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the weather in Lisbon, in celsius?"}],
            "tools": [{"type": "function", "function": {"name": "weather", "parameters": params}}],
            "tool_choice": "required"}
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("events", stream_events(twins.base, body)))
    t.start()
    task, node = held_by(twins)
    time.sleep(0.3)  # decoding the call
    twins.kill(node)
    t.join(120)
    twin_worker(twins, node)
    twins.ready(4)
    events = got["events"]
    ended, errors = the_end(events, "chat")
    assert ended and not errors, errors
    calls = [tc for e in events if isinstance(e, dict) for c in e["choices"]
             for tc in (c.get("delta") or {}).get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls if c.get("function", {}).get("name")] == ["weather"]
    arguments = "".join(c["function"].get("arguments") or "" for c in calls)
    assert validate_output(params, json.loads(arguments)) is None
    [final] = [e for e in events if isinstance(e, dict) and any(c.get("finish_reason") for c in e["choices"])]
    assert final["choices"][0]["finish_reason"] == "tool_calls"
    assert twins.broker.result(task).attempts == 2



# -- a typed request whose client goes away: its task is cancelled, as a chat's is -----------------------------------

def test_a_typed_client_that_goes_away_cancels_its_task(fleet):
    """/v1/classify given up by its client (it closes the connection): the running task and the one waiting behind
    it are cancelled, the waiting one never run."""
    fleet.worker("a", "fake:latency_ms=5000", "--lease", "2")
    fleet.ready(1)
    for _ in range(2):  # the running one, then one still waiting behind it
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(fleet.base + "/v1/classify", json={"input": "hi", "labels": ["a", "b"]}, timeout=1.0)
    assert [v for v in both_cancelled(fleet) if not v.history]  # the one that waited was never run


def both_cancelled(fleet: Fleet) -> list:
    """The fleet's two tasks, once both are cancelled (within 15 s)."""
    deadline = time.time() + 15
    views = []
    while time.time() < deadline:
        views = [fleet.broker.get(t) for t in _task_ids(fleet.broker)]
        if len(views) == 2 and all(v.state == "cancelled" for v in views):
            break
        time.sleep(0.2)
    assert [v.state for v in views] == ["cancelled", "cancelled"]
    return views

# -- a chat without max_tokens through the gateway: bounded by NODEAGENT_MAX_TOKENS -----------------------------------

def _unbudgeted_chat(fleet: Fleet) -> dict:
    """A chat without max_tokens on a model that never ends an answer on its own (``ramble``): its usage and finish
    show the budget it was given."""
    r = httpx.post(fleet.base + "/v1/chat/completions", json={
        "model": "fake:ramble=1", "messages": [{"role": "user", "content": "talk"}]}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_chat_without_max_tokens_is_bounded_by_the_workers_own_limit(tmp_path_factory):
    """NODEAGENT_MAX_TOKENS on the worker only: a queued chat that gives no budget gets what the context leaves up
    to the worker's limit, as on `serve` (not the setting's default, 4096)."""
    fleet = Fleet(f"sqlite://{tmp_path_factory.mktemp('gw-budget') / 'queue.db'}", tmp_path_factory.mktemp("gw"))
    try:
        fleet.worker("a", "fake:ramble=1", env={"NODEAGENT_MAX_TOKENS": "7"})
        fleet.ready(1)
        body = _unbudgeted_chat(fleet)
        assert body["usage"]["completion_tokens"] == 7 and body["choices"][0]["finish_reason"] == "length", body
    finally:
        fleet.stop()
