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

from conftest import QUIET_GUARD, age_heartbeat, cli

from nodeagent.broker.base import CONTRACT, Envelope, NodeRecord
from nodeagent.client import Client
from nodeagent.fleet.status import fleet_status
from nodeagent.tasks.contracts import ClassifyTask

ROOT = Path(__file__).resolve().parent.parent
PREVIOUS = "7d82c62"  # the last commit before contract versions: nodeagent 0.1.0, contract 1.0
Q = "classify.v1"
TASK = {"type": Q, "input": "the app crashes", "labels": ["bug", "question"]}


def record(node_id: str, **fields) -> NodeRecord:
    return NodeRecord(**{"id": node_id, "hostname": node_id, "agent_version": "0.2.0", "contract": CONTRACT,
                         "os": "linux", "arch": "aarch64", "backend": "fake", "state": "ready", "heartbeat_s": 1.0,
                         "task_types": [Q], **fields})


def serve_a_while(broker, seconds: float, node_id: str = "w1"):
    """An in-process worker on the fake model for ``seconds``; returns it (stopped)."""
    from test_worker import worker

    w = worker(broker, burst=False, node_id=node_id, queues=[Q])
    w.record = record(node_id)
    runner = threading.Thread(target=w.run)
    runner.start()
    time.sleep(seconds)
    w.stop()
    runner.join(30)
    return w


def test_a_task_of_a_newer_major_contract_is_given_back_unread_and_unspent(broker):
    newer = Envelope(queue=Q, task={**TASK, "a_field_of_2_0": True}, contract="2.0")
    broker.enqueue(newer)
    plain = Client(broker).submit(ClassifyTask(input="fine", labels=["a", "b"]))
    w = serve_a_while(broker, 2.5)
    assert broker.get(plain).state == "done"
    view = broker.get(newer.id)
    assert view.state in ("ready", "delayed") and view.attempts == 0 and not view.history  # not dead, not spent
    assert w.deferred >= 1 and f"contract 2.0, another major version than this node's {CONTRACT}" in w.deferred_why
    node = next(n for n in broker.nodes() if n.id == "w1")
    assert node.deferred == w.deferred and node.contract == CONTRACT
    alerts = fleet_status(broker, 30)["alerts"]
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
    w = serve_a_while(broker, 2.0)
    assert broker.get(newer.id).attempts == 0 and broker.get(newer.id).state in ("ready", "delayed")
    assert f"contract 1.9, newer than this node's {CONTRACT}, which cannot read it" in w.deferred_why
    dead = broker.get(same.id)
    assert dead.state == "dead" and dead.last_error.code == "invalid_task" and "copy" in dead.last_error.message


def test_envelopes_records_and_events_carry_the_contract_that_wrote_them(broker):
    e = Envelope(queue=Q, task=TASK, progress=True)
    broker.open_log(e.id, 60)
    broker.enqueue(e)
    assert json.loads(Envelope(queue=Q, task=TASK).model_dump_json())["contract"] == CONTRACT
    broker.register(record("n1"))
    assert broker.nodes()[0].contract == CONTRACT
    serve_a_while(broker, 1.5)
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
    assert shown["versions"] == {"nodeagent 0.1.0 (contract 1.0)": ["old-pi"],
                                 f"nodeagent 0.2.0 (contract {CONTRACT})": ["new-pi"]}
    assert any(a.startswith("the fleet runs 2 versions") for a in shown["alerts"]), shown["alerts"]
    if broker.url.startswith("redis"):  # the CLI as a user types it
        out = cli(["status", "--broker", broker.url], isolated_env)
        assert "alert: the fleet runs 2 versions: nodeagent 0.1.0 (contract 1.0) on old-pi" in out.stderr
        assert "0.1.0/1.0 *" in out.stdout and f"0.2.0/{CONTRACT} *" in out.stdout


# -- the previous release, from this repository's history, beside today's ----------------------------------------
def previous_release(folder: Path) -> Path:
    """The package as it was at PREVIOUS (with its profiles and models), to run with this interpreter."""
    done = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", PREVIOUS, "nodeagent", "profiles",
                           "models"], capture_output=True)
    assert done.returncode == 0, ("this test runs the previous release from the repository's history (a clone "
                                  f"without --depth): {done.stderr.decode()[-300:]}")
    out = folder / f"nodeagent-{PREVIOUS}"
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(out)
    return out


def start(url: str, home: Path, node_id: str, code: Path | None = None) -> subprocess.Popen:
    home.mkdir(parents=True, exist_ok=True)
    (home / "node-id").write_text(node_id + "\n")
    env = {**os.environ, **QUIET_GUARD, "NODEAGENT_HOME": str(home), "NODEAGENT_HEARTBEAT_S": "0.5",
           "NODEAGENT_LEASE_S": "5"}
    if code is not None:  # the previous release's package first on the path
        env["PYTHONPATH"] = str(code)
    # `python -m` puts the working directory first on the path: the previous release's own folder, for its code
    return subprocess.Popen([sys.executable, "-m", "nodeagent", "worker", "--model", "fake:latency_ms=30", "--broker",
                             url, "--types", "classify"], env=env, stdout=subprocess.DEVNULL,
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
