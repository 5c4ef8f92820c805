"""Versions in one fleet: every envelope, node record and event carries the contract version that wrote it; a worker
gives back, unread and without spending an attempt, a task it cannot read because a newer contract wrote it; status
and the page flag a fleet of more than one version; the previous release's worker (this repository's own history)
shares a queue with today's, and a rolling upgrade (drain, upgrade, start) loses nothing while tasks flow."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
from conftest import QUIET_GUARD, age_heartbeat, cli, stop_all

from nodeagent.broker.base import CONTRACT, Envelope, NodeRecord
from nodeagent.client import Client
from nodeagent.fleet.status import fleet_status
from nodeagent.tasks.contracts import ClassifyTask

ROOT = Path(__file__).resolve().parent.parent
PREVIOUS = "7d82c62"  # the last commit before contract versions: nodeagent 0.1.0, contract 1.0
LAST = "c75c179"  # the last landed release before contract 1.5: nodeagent 0.2.0, contract 1.4
BEFORE_EMBED = "4c5311a"  # the last release before contract 1.6 (embed.v1, NodeRecord.embedders): contract 1.5
BEFORE_KINDS = "423e068"  # the last release before contract 1.7 (NodeRecord.model_kinds): contract 1.6
BEFORE_RERANK = "2a71b69"  # the last release before contract 1.8 (rerank.v1, a reranker loaded): contract 1.7
Q = "classify.v1"
TASK = {"type": Q, "input": "the app crashes", "labels": ["bug", "question"]}


def record(node_id: str, **fields) -> NodeRecord:
    return NodeRecord(**{"id": node_id, "hostname": node_id, "agent_version": "0.2.0", "contract": CONTRACT,
                         "os": "linux", "arch": "aarch64", "backend": "fake", "state": "ready", "heartbeat_s": 1.0,
                         "task_types": [Q], **fields})


def serve_a_while(broker, seconds: float, node_id: str = "w1", until=None, timeout_s: float = 60.0):
    """An in-process worker on the fake model for ``seconds`` at least, and on until ``until()`` holds (a loaded
    machine is slower to start it; ``timeout_s`` at most); returns it (stopped)."""
    from test_worker import worker

    w = worker(broker, burst=False, node_id=node_id, queues=[Q])
    w.record = record(node_id)
    runner = threading.Thread(target=w.run)
    runner.start()
    time.sleep(seconds)
    deadline = time.monotonic() + timeout_s
    while until is not None and not until(w) and time.monotonic() < deadline:
        time.sleep(0.1)
    w.stop()
    runner.join(30)
    return w


def test_a_task_of_a_newer_major_contract_is_given_back_unread_and_unspent(broker):
    newer = Envelope(queue=Q, task={**TASK, "a_field_of_2_0": True}, contract="2.0")
    broker.enqueue(newer)
    plain = Client(broker).submit(ClassifyTask(input="fine", labels=["a", "b"]))
    w = serve_a_while(broker, 2.5, until=lambda w: w.deferred >= 1 and broker.get(plain).state == "done" and any(
        n.id == "w1" and n.deferred >= 1 for n in broker.nodes()))
    assert broker.get(plain).state == "done"
    view = broker.get(newer.id)
    assert view.state in ("ready", "delayed") and view.attempts == 0 and not view.history  # not dead, not spent
    assert w.deferred >= 1 and f"contract 2.0, another major version than this node's {CONTRACT}" in w.deferred_why
    node = next(n for n in broker.nodes() if n.id == "w1")
    assert node.deferred == w.deferred and node.contract == CONTRACT
    alerts = fleet_status(broker, 30).alerts
    assert any("node w1 gave back" in a and "newer version" in a for a in alerts), alerts
    # a node of the newer contract takes it (here: the test, reading it as such a node would), as its first attempt
    deadline = time.time() + 10
    claim = None
    while claim is None and time.time() < deadline:
        claim = broker.claim([Q], "newer-node", 30)
        time.sleep(0.1)
    assert claim.envelope.id == newer.id and claim.attempt == 1 and claim.envelope.contract == "2.0"


def test_a_newer_minor_a_node_cannot_read_is_given_back_but_its_own_minor_is_a_dead_letter(broker):
    """The rule (schemas/redis-contract.md): unknown optional fields of a newer minor are another node's to run;
    the same from a writer of this node's own contract is a broken task."""
    newer = Envelope(queue=Q, task={**TASK, "copy": "auto"}, contract="1.9")
    same = Envelope(queue=Q, task={**TASK, "copy": "auto"})
    broker.enqueue(newer)
    broker.enqueue(same)
    w = serve_a_while(broker, 2.0, until=lambda w: w.deferred_why and broker.get(same.id).state == "dead")
    assert broker.get(newer.id).attempts == 0 and broker.get(newer.id).state in ("ready", "delayed")
    assert f"contract 1.9, newer than this node's {CONTRACT}, which cannot read it" in w.deferred_why
    dead = broker.get(same.id)
    assert dead.state == "dead" and dead.last_error.code == "invalid_task" and "copy" in dead.last_error.message


def test_a_task_for_a_newer_node_past_its_deadline_is_a_dead_letter_and_a_future_shape_is_given_back(broker):
    """A task given back for a newer node is still checked against its deadline (it would otherwise bounce for
    ever); an envelope whose outer shape does not parse, written by another major, is that major's to judge: given
    back, not dead-lettered; one of this major that does not parse is a dead letter."""
    late = Envelope(queue=Q, task={**TASK, "a_field_of_2_0": True}, contract="2.0", deadline=broker.now() - 1)
    broker.enqueue(late)
    future = {"id": "shape-2", "queue": Q, "contract": "2.0", "task": TASK, "max_attempts": "many"}
    broken = {"id": "shape-1", "queue": Q, "contract": CONTRACT, "task": TASK, "max_attempts": "many"}
    for raw in (future, broken):
        raw_enqueue(broker, raw)
    w = serve_a_while(broker, 2.0, until=lambda w: w.deferred >= 1 and broker.get(late.id).state == "dead"
                      and broker.get("shape-1").state == "dead")
    dead = broker.get(late.id)
    assert dead.state == "dead" and dead.last_error.code == "deadline_exceeded"
    given_back = broker.get("shape-2")
    assert given_back.state in ("ready", "delayed") and given_back.attempts == 0 and w.deferred >= 1
    assert broker.get("shape-1").state == "dead" and broker.get("shape-1").last_error.code == "invalid_task"


def test_an_envelope_without_a_contract_gets_a_result_a_1_0_reader_reads(broker):
    """A writer from before versions says no contract: its results are written for 1.0 (no field a later minor
    added), so that writer reads them."""
    from nodeagent.tasks.contracts import ExtractTask

    task = ExtractTask(input="Alice is 34.", schema={"type": "object", "properties": {"age": {"type": "integer"}}})
    raw = {"id": task.id, "queue": "extract.v1", "task": {"type": "extract.v1", "input": task.input,
                                                           "schema": task.json_schema}}
    raw_enqueue(broker, raw)
    from test_worker import worker

    worker(broker, queues=["extract.v1"]).run()
    result = broker.result(task.id)
    assert result.status == "ok" and result.field_logprobs is None
    assert "field_logprobs" not in result.model_dump_json()


def raw_enqueue(broker, data: dict) -> None:
    """An envelope written as a producer in another language writes it (an XADD; an INSERT), unchecked."""
    from conftest import raw_enqueue as written

    written(broker, data["id"], data["queue"], json.dumps(data))


def test_envelopes_records_and_events_carry_the_contract_that_wrote_them(broker):
    e = Envelope(queue=Q, task=TASK, progress=True)
    broker.open_log(e.id, 60)
    broker.enqueue(e)
    assert json.loads(Envelope(queue=Q, task=TASK).model_dump_json())["contract"] == CONTRACT
    broker.register(record("n1"))
    assert broker.nodes()[0].contract == CONTRACT
    serve_a_while(broker, 1.5, until=lambda w: broker.get(e.id).state == "done")
    events = [ev for _, _, ev in broker.read_logs({e.id: "0"})]
    assert [ev["kind"] for ev in events][:2] == ["queued", "started"] and events[-1]["kind"] == "finished"
    assert {ev.get("contract") for ev in events} == {CONTRACT}
    assert [ev["seq"] for ev in events if "seq" in ev] == list(range(1, 1 + sum("seq" in ev for ev in events)))
    broker.record_event({"kind": "control", "action": "pause"})
    assert broker.events(1)[0]["contract"] == CONTRACT


def test_a_record_from_before_versions_reads_as_contract_1_0():
    old = NodeRecord.model_validate({"id": "pi", "hostname": "pi", "agent_version": "0.1.0", "os": "linux",
                                     "arch": "aarch64", "backend": "llamacpp", "a_field_from_later": 1})
    assert old.contract == "1.0" and old.runs("chat.v1") and old.runs("classify.v1.batch")
    assert not record("n", knows=["classify.v1"]).runs("chat.v1")


def test_status_flags_a_fleet_of_more_than_one_version(broker, isolated_env):
    broker.register(record("new-pi"))
    broker.register(NodeRecord.model_validate({**record("old-pi").model_dump(), "agent_version": "0.1.0",
                                               "contract": "1.0"}))
    broker.register(record("gone", agent_version="0.0.9", contract="1.0"))
    age_heartbeat(broker, "gone", 600)  # a lost node's version is no part of the fleet's
    shown = fleet_status(broker, 30)
    assert shown.versions == {"nodeagent 0.1.0 (contract 1.0)": ["old-pi"],
                                 f"nodeagent 0.2.0 (contract {CONTRACT})": ["new-pi"]}
    assert any(a.startswith("the fleet runs 2 versions") for a in shown.alerts), shown.alerts
    if broker.url.startswith("redis"):  # the CLI as a user types it
        out = cli(["status", "--broker", broker.url], isolated_env)
        assert "alert: the fleet runs 2 versions: nodeagent 0.1.0 (contract 1.0) on old-pi" in out.stderr
        assert "0.1.0/1.0 *" in out.stdout and f"0.2.0/{CONTRACT} *" in out.stdout


# -- the previous release, from this repository's history, beside today's ----------------------------------------
def previous_release(folder: Path, commit: str = PREVIOUS) -> Path:
    """The package as it was at ``commit`` (with its profiles and models), to run with this interpreter."""
    done = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, "nodeagent", "profiles",
                           "models"], capture_output=True)
    assert done.returncode == 0, ("this test runs the previous release from the repository's history (a clone "
                                  f"without --depth): {done.stderr.decode()[-300:]}")
    out = folder / f"nodeagent-{commit}"
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(out)
    return out


def start(url: str, home: Path, node_id: str, code: Path | None = None, types: str = "classify",
          *args: str) -> subprocess.Popen:
    """A worker (or, with ``args``, another command: ``gateway ...``) of this release or of the one at ``code``."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "node-id").write_text(node_id + "\n")
    env = {**os.environ, **QUIET_GUARD, "NODEAGENT_HOME": str(home), "NODEAGENT_HEARTBEAT_S": "0.5",
           "NODEAGENT_LEASE_S": "5"}
    env.pop("PYTHONPATH", None)
    if code is not None:  # the previous release's package first on the path
        env["PYTHONPATH"] = str(code)
    command = list(args) or ["worker", "--model", "fake:latency_ms=30", "--broker", url, "--types", types]
    # `python -m` puts the working directory first on the path: the previous release's own folder, for its code
    return subprocess.Popen([sys.executable, "-m", "nodeagent", *command], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(home / "worker.log", "a"), cwd=str(code) if code is not None else None)


def wait_for(test, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not test():
        assert time.time() < deadline, what
        time.sleep(0.1)


def test_the_previous_release_shares_the_queue_and_a_rolling_upgrade_loses_nothing(redis_server, tmp_path,
                                                                                 isolated_env):
    """A worker of 0.1.0 (contract 1.0) and one of today's serve one Redis queue while an orchestrator of today's
    submits; status flags the skew. Then the old one is drained (SIGTERM), upgraded and started again under the
    same id, with tasks flowing throughout: every task is done once, none is dead or lost, and the fleet is one
    version again."""
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    url = redis_server.url
    old_code = previous_release(tmp_path)
    broker = Client(url).broker
    client = Client(broker)
    old = start(url, tmp_path / "a", "node-a", code=old_code)
    new = start(url, tmp_path / "b", "node-b")
    wait_for(lambda: {n.id for n in broker.nodes() if n.state == "ready"} == {"node-a", "node-b"}, 120,
             "both workers registered")
    assert {n.id: (n.agent_version, n.contract) for n in broker.nodes()} == {
        "node-a": ("0.1.0", "1.0"), "node-b": ("0.2.0", CONTRACT)}
    ids: list[str] = []
    flowing = threading.Event()
    flowing.set()

    def produce() -> None:
        i = 0
        while flowing.is_set():
            ids.append(client.submit(ClassifyTask(input=f"ticket {i}: crash on start", labels=["bug", "question"]),
                                     idempotency_key=f"rolling-{i}"))
            i += 1
            time.sleep(0.05)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        time.sleep(3)
        status = json.loads(cli(["status", "--broker", url, "--json"], isolated_env).stdout)
        assert any(a.startswith("the fleet runs 2 versions") for a in status["alerts"]), status["alerts"]
        # the rolling upgrade of node-a: drain, upgrade (today's code), start again under the same id
        old.send_signal(signal.SIGTERM)
        assert old.wait(60) == 0
        upgraded = start(url, tmp_path / "a", "node-a")
        wait_for(lambda: any(n.id == "node-a" and n.contract == CONTRACT and n.state == "ready"
                             for n in broker.nodes()), 60, "the upgraded node-a registered")
        time.sleep(3)
    finally:
        flowing.clear()
        producer.join(30)
    wait_for(lambda: all(s == "done" for s in broker.states(ids).values()) and len(broker.states(ids)) == len(ids),
             60, "every task done")
    assert len(ids) == len(set(ids)) >= 100
    assert not broker.dead() and broker.get(ids[0]).attempts == 1
    ran = {broker.get(i).node for i in ids}
    assert {"node-a", "node-b"} <= ran  # both versions ran tasks
    status = json.loads(cli(["status", "--broker", url, "--json"], isolated_env).stdout)
    assert status["versions"] == {f"nodeagent 0.2.0 (contract {CONTRACT})": ["node-a", "node-b"]}
    assert not any("versions" in a for a in status["alerts"])
    for p in (new, upgraded):
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    assert "Traceback" not in (tmp_path / "a" / "worker.log").read_text()


# -- every pairing of a previous release and this one, in both directions ----------------------------------------
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
OLD_CLIENT = """
import json, sys
from nodeagent.client import Client
from nodeagent.tasks.contracts import ClassifyTask, ExtractTask
url, what = sys.argv[1], sys.argv[2]
client = Client(url)
if what == "submit":
    tasks = [ClassifyTask(input="the app crashes", labels=["bug", "question"]),
             ExtractTask(input="Alice is 34.", schema=json.loads(sys.argv[3]))]
    print(json.dumps([client.submit(t) for t in tasks]))
else:
    print(json.dumps([client.wait(i, timeout=60).status for i in json.loads(sys.argv[3])]))
"""


def old_client(code: Path, url: str, *args: str) -> list:
    """The previous release's Client, in a process of its own: what an orchestrator not yet upgraded runs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", OLD_CLIENT, url, *args], env={**env, "PYTHONPATH": str(code)},
                          cwd=str(code), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def ask(base: str, route: str, body: dict) -> "httpx.Response":
    import httpx

    return httpx.post(base + route, json=body, timeout=60)


def two_gateways(url: str, tmp_path: Path, code: Path, procs: list[subprocess.Popen]) -> dict[str, str]:
    """A gateway of the release at ``code`` (``old``) and one of this release (``new``) on ``url``, their processes
    added to ``procs`` (old first); each one's base URL."""
    from conftest import free_port

    gateways = {}
    for name, where in (("old", code), ("new", None)):
        port = free_port()
        procs.append(start(url, tmp_path / f"gw-{name}", f"gw-{name}", where, "", "gateway", "--broker", url,
                           "--port", str(port)))
        gateways[name] = f"http://127.0.0.1:{port}"
    return gateways


def gateways_up(gateways: dict[str, str], procs: list[subprocess.Popen], tmp_path: Path) -> None:
    """Each of ``two_gateways``' gateways (its process first in ``procs``, in order) answering with a node behind
    it."""
    for i, (name, base) in enumerate(gateways.items()):
        gateway_up(base, procs[i], tmp_path / f"gw-{name}")


def gateway_up(base: str, proc: subprocess.Popen, home: Path) -> None:
    import httpx

    def up() -> bool:
        assert proc.poll() is None, (home / "worker.log").read_text()[-2000:]
        try:
            return httpx.get(base + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 60, "the gateway answers with a node behind it")


@pytest.mark.parametrize("release", [PREVIOUS, LAST])
def test_every_pairing_of_a_previous_release_and_this_one_loses_nothing(redis_server, tmp_path, release):
    """Old and new workers, clients and gateways on one Redis, every task type, plain and with a field a later
    contract added (extract's prompt, 1.2). While only the old worker runs, what it can read is done through every
    producer; a task that sets the newer field is never claimed by it (it waits on its route, not dead-lettered),
    and the new gateway answers such a request 503 rather than queue it for nobody. Once the worker is upgraded,
    everything left is done, through both gateways and both clients, and each producer reads its results."""
    import redis

    from nodeagent.tasks.contracts import ExtractTask

    redis.Redis.from_url(redis_server.url).flushall()
    url = redis_server.url
    code = previous_release(tmp_path, release)
    broker = Client(url).broker
    client = Client(broker)
    procs: list[subprocess.Popen] = []
    try:
        gateways = two_gateways(url, tmp_path, code, procs)
        worker = start(url, tmp_path / "node", "node-1", code, "classify,extract,chat")
        procs.append(worker)
        gateways_up(gateways, procs, tmp_path)
        plain = {"classify": {"input": "the app crashes", "labels": ["bug", "question"]},
                 "extract": {"input": "Alice is 34.", "schema": SCHEMA}}
        newer = {"input": "Bob is 9.", "schema": SCHEMA, "prompt": "none"}
        chat = {"model": "fake:latency_ms=30", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

        def through_both(phase: str) -> None:
            for name, base in gateways.items():
                for kind, body in plain.items():
                    r = ask(base, f"/v1/{kind}", body)
                    assert r.status_code == 200 and r.json()["status"] == "ok", (phase, name, kind, r.text)
                r = ask(base, "/v1/chat/completions", chat)
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], (phase, name, r.text)

        # phase one: the old worker alone
        through_both("old worker")
        r = ask(gateways["new"], "/v1/extract", newer)
        assert r.status_code == 503 and r.json()["error"]["code"] == "type_unavailable", r.text
        ids = [client.submit(ExtractTask.model_validate(plain["extract"])),
               client.submit(ExtractTask.model_validate(newer))]
        old_ids = old_client(code, url, "submit", json.dumps(SCHEMA))
        wait_for(lambda: all(broker.get(i).state == "done" for i in [ids[0], *old_ids]), 60, "the old worker's work")
        time.sleep(1.5)
        waiting = broker.get(ids[1])
        assert waiting.state == "ready" and waiting.attempts == 0 and not waiting.history  # never claimed by it
        # phase two: the worker upgraded (drained, started again as this release under the same id)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0
        procs.append(start(url, tmp_path / "node", "node-1", None, "classify,extract,chat"))
        wait_for(lambda: any(n.id == "node-1" and n.contract == CONTRACT and n.state == "ready"
                             for n in broker.nodes()), 60, "the upgraded node registered")
        wait_for(lambda: broker.get(ids[1]).state == "done", 60, "the newer task, once a node reads it")
        through_both("new worker")
        r = ask(gateways["new"], "/v1/extract", newer)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        more = old_client(code, url, "submit", json.dumps(SCHEMA))
        assert old_client(code, url, "wait", json.dumps(old_ids + more)) == ["ok"] * 4  # each read by its writer
        assert all(client.wait(i, timeout=30).status == "ok" for i in ids)
        assert not broker.dead() and not broker.dead_codes()
    finally:
        stop_all(procs)


@pytest.mark.real_model
def test_a_fleet_of_the_release_before_embeddings_and_this_one(redis_server, tmp_path, minilm_path):
    """Contract 1.6 beside 1.5 on one Redis: a 1.5 worker (a generator) and gateway, this release's embedding worker
    and gateway, a 1.5 client. Each gateway reads the other's node records (``embedders`` is new); the old worker
    never claims an embed.v1 task (it knows no such type); embeddings come back through the new gateway and
    client; the old gateway and client get their answers as before; nothing is dead-lettered."""
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    url = redis_server.url
    code = previous_release(tmp_path, BEFORE_EMBED)
    broker = Client(url).broker
    client = Client(broker)
    procs: list[subprocess.Popen] = []
    try:
        gateways = two_gateways(url, tmp_path, code, procs)
        procs.append(start(url, tmp_path / "old-node", "old-node", code, "classify,extract,chat"))
        procs.append(start(url, tmp_path / "emb-node", "emb-node", None, "", "worker", "--model", str(minilm_path),
                           "--broker", url, "--types", "embed,classify"))
        gateways_up(gateways, procs, tmp_path)
        wait_for(lambda: {"old-node", "emb-node"} <= {n.id for n in broker.nodes() if n.state == "ready"}, 120,
                 "both workers registered")
        emb = next(n for n in broker.nodes() if n.id == "emb-node")
        assert emb.contract == CONTRACT and emb.embedders
        chat = {"model": "fake:latency_ms=30", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        for name, base in gateways.items():  # what both versions serve, through each gateway
            r = ask(base, "/v1/extract", {"input": "Alice is 34.", "schema": SCHEMA})
            assert r.status_code == 200 and r.json()["status"] == "ok", (name, r.text)
            r = ask(base, "/v1/chat/completions", chat)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], (name, r.text)
        model = minilm_path.stem
        r = ask(gateways["new"], "/v1/embeddings", {"model": model, "input": ["a cat", "a dog"]})
        assert r.status_code == 200 and [len(d["embedding"]) for d in r.json()["data"]] == [384, 384], r.text
        r = ask(gateways["new"], "/v1/chat/completions", {**chat, "model": model})
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind", r.text
        r = ask(gateways["old"], "/v1/embeddings", {"model": model, "input": "a cat"})
        assert r.status_code in (400, 404), r.text  # the old door refuses the route, as it did: nothing queued
        vectors = client.embed(["one", "two", "three"], model=model)
        assert len(vectors) == 3 and all(len(v) == 384 for v in vectors)
        old_ids = old_client(code, url, "submit", json.dumps(SCHEMA))
        assert old_client(code, url, "wait", json.dumps(old_ids)) == ["ok", "ok"]
        from nodeagent.tasks.contracts import EmbedTask

        ids = [client.submit(EmbedTask(input=f"text {i}"), model=model) for i in range(4)]
        assert all(client.wait(i, timeout=60).status == "ok" for i in ids)
        assert {broker.get(i).node for i in ids} == {"emb-node"}
        assert not broker.dead() and not broker.dead_codes()
        old_log = (tmp_path / "old-node" / "worker.log").read_text()
        assert "embed.v1" not in old_log and "Traceback" not in old_log
    finally:
        stop_all(procs)


@pytest.mark.real_model
def test_model_kinds_are_read_both_ways_with_the_release_before_them(redis_server, tmp_path, minilm_path,
                                                                     minilm_q8_path):
    """Contract 1.7 beside 1.6 on one Redis: an embedding worker of each (MiniLM F32 on 1.6, its Q8_0 on 1.7), a 1.7
    generator, a gateway and a client of each. Each gateway reads each worker's record: the 1.7 one's kinds from
    ``model_kinds`` (it still writes ``embedders`` for the 1.6 gateway), the 1.6 one's from ``embedders``; so
    through both gateways a chat on either embedding model is a 400 wrong_model_kind, never queued, and its
    embeddings come back; the 1.6 client's tasks are answered; nothing is dead-lettered."""
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    url = redis_server.url
    code = previous_release(tmp_path, BEFORE_KINDS)
    broker = Client(url).broker
    client = Client(broker)
    procs: list[subprocess.Popen] = []
    try:
        gateways = two_gateways(url, tmp_path, code, procs)
        procs.append(start(url, tmp_path / "old-emb", "old-emb", code, "", "worker", "--model", str(minilm_path),
                           "--broker", url, "--types", "embed,classify"))
        procs.append(start(url, tmp_path / "new-emb", "new-emb", None, "", "worker", "--model", str(minilm_q8_path),
                           "--broker", url, "--types", "embed,classify"))
        procs.append(start(url, tmp_path / "new-gen", "new-gen", None, "classify,extract,chat"))
        gateways_up(gateways, procs, tmp_path)
        wait_for(lambda: {"old-emb", "new-emb", "new-gen"} <= {n.id for n in broker.nodes() if n.state == "ready"},
                 120, "the three workers registered")
        records = {n.id: n for n in broker.nodes()}
        assert records["old-emb"].contract == "1.6" and not records["old-emb"].model_kinds
        assert records["new-emb"].model_kinds and set(records["new-emb"].embedders) == set(
            records["new-emb"].model_kinds)
        assert set(records["new-gen"].model_kinds.values()) == {"generate"} and not records["new-gen"].embedders
        for name, base in gateways.items():
            for model in (minilm_path.stem, minilm_q8_path.stem):
                r = ask(base, "/v1/chat/completions", {"model": model, "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind", (name, model, r.text)
                r = ask(base, "/v1/embeddings", {"model": model, "input": ["a cat", "a dog"]})
                assert r.status_code == 200 and [len(d["embedding"]) for d in r.json()["data"]] == [384, 384], \
                    (name, model, r.text)
            r = ask(base, "/v1/chat/completions", {"model": "fake:latency_ms=30", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], (name, r.text)
        old_ids = old_client(code, url, "submit", json.dumps(SCHEMA))
        assert old_client(code, url, "wait", json.dumps(old_ids)) == ["ok", "ok"]
        assert len(client.embed(["one", "two"], model=minilm_path.stem)) == 2
        assert not broker.dead() and not broker.dead_codes()
    finally:
        stop_all(procs)


@pytest.mark.real_model
def test_rerank_beside_the_release_before_it(redis_server, tmp_path, minilm_path):
    """Contract 1.8 (rerank.v1) beside 1.7 on one Redis: a reranker worker (1.8), a generator of each release, a
    gateway and a client of each. The 1.7 generator never claims a rerank task (a queue it does not read): every
    rerank through the 1.8 gateway is answered, by the reranker unnamed or by the 1.8 generator named, and one naming
    the 1.7 generator's model is refused at once, never queued to wait for it. The 1.7 gateway reads the reranker's
    kind from its record and refuses a chat or embeddings on it (400 wrong_model_kind), and has no /v1/rerank (404);
    every other task of either client is answered; nothing is dead-lettered."""
    import redis
    from ggufgen import as_reranker

    from nodeagent.tasks.contracts import RerankTask

    redis.Redis.from_url(redis_server.url).flushall()
    url = redis_server.url
    code = previous_release(tmp_path, BEFORE_RERANK)
    reranker = as_reranker(minilm_path, tmp_path / "minilm-reranker.gguf")
    broker = Client(url).broker
    client = Client(broker)
    procs: list[subprocess.Popen] = []
    try:
        gateways = two_gateways(url, tmp_path, code, procs)
        procs.append(start(url, tmp_path / "new-rr", "new-rr", None, "", "worker", "--model", str(reranker),
                           "--broker", url, "--types", "rerank"))
        procs.append(start(url, tmp_path / "old-gen", "old-gen", code, "", "worker", "--model",
                           "fake:latency_ms=21", "--broker", url))
        procs.append(start(url, tmp_path / "new-gen", "new-gen", None, "", "worker", "--model",
                           "fake:latency_ms=22", "--broker", url, "--types", "classify,extract,chat,rerank"))
        gateways_up(gateways, procs, tmp_path)
        wait_for(lambda: {"new-rr", "old-gen", "new-gen"} <= {n.id for n in broker.nodes() if n.state == "ready"},
                 120, "the three workers registered")
        records = {n.id: n for n in broker.nodes()}
        assert records["old-gen"].contract == "1.7" and records["new-rr"].contract == "1.8"
        assert set(records["new-rr"].model_kinds.values()) == {"rerank"} and not records["new-rr"].embedders
        docs = ["Cats groom their fur.", "Rates rose again.", "A cat washes its face."]
        new, old = gateways["new"], gateways["old"]
        for _ in range(4):  # a task the old generator could claim, were it to read the queue, would land there
            r = ask(new, "/v1/rerank", {"query": "cat care", "documents": docs})
            assert r.status_code == 200 and r.json()["model"] == reranker.stem, r.text
            r = ask(new, "/v1/rerank", {"query": "cat care", "documents": docs, "model": "fake:latency_ms=22"})
            assert r.status_code == 200 and len(r.json()["results"]) == 3, r.text
        started = time.monotonic()
        r = ask(new, "/v1/rerank", {"query": "cat care", "documents": docs, "model": "fake:latency_ms=21"})
        assert r.status_code in (400, 404, 503) and time.monotonic() - started < 30, r.text
        for route, body in (("/v1/chat/completions", {"max_tokens": 4, "messages": [{"role": "user",
                                                                                          "content": "hi"}]}),
                            ("/v1/embeddings", {"input": ["a cat"]})):
            r = ask(old, route, {**body, "model": reranker.stem})
            assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind", (route, r.text)
        assert ask(old, "/v1/rerank", {"query": "q", "documents": ["d"]}).status_code == 404
        for base in (old, new):
            r = ask(base, "/v1/classify", {"input": "the app crashes", "labels": ["bug", "question"],
                                           "model": "fake:latency_ms=21"})
            assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        old_ids = old_client(code, url, "submit", json.dumps(SCHEMA))
        assert old_client(code, url, "wait", json.dumps(old_ids)) == ["ok", "ok"]
        ranked = client.wait(client.submit(RerankTask(query="cat care", documents=docs)), timeout=60)
        assert ranked.status == "ok" and ranked.model in (reranker.name, "fake:latency_ms=22"), ranked  # a 1.8 node
        bound = client.wait(client.submit(RerankTask(query="cat care", documents=docs), model=reranker.stem),
                            timeout=60)
        assert bound.status == "ok" and bound.model == reranker.name, bound.error
        assert not broker.dead() and not broker.dead_codes()
    finally:
        stop_all(procs)
