"""The fleet with real processes, as a user runs it: `nodeagent worker` processes on both brokers, killed
with SIGKILL mid-task, drained with SIGTERM; Redis restarted with AOF; an orchestrator enqueueing with plain
Redis commands; and two real SmolLM2 workers serving 20 classifications through the client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import QUIET_GUARD, RedisServer, age_heartbeat, cli, free_port

from nodeagent.broker.open import open_broker
from nodeagent.client import Client
from nodeagent.tasks.contracts import ClassifyTask

Q = "classify.v1"


def start_worker(url: str, env: dict, model: str = "fake:latency_ms=200", *extra: str) -> subprocess.Popen:
    env = {**QUIET_GUARD, **env}
    return subprocess.Popen([sys.executable, "-m", "nodeagent", "worker", "--model", model, "--broker", url,
                             "--lease", "1", "--heartbeat", "0.5", *extra],
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(params=["sqlite", "redis"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'queue.db'}"
    import redis

    server = request.getfixturevalue("redis_server")
    redis.Redis.from_url(server.url).flushall()
    return server.url


def results_of(broker, ids):
    return {i: broker.result(i) for i in ids}


def test_kill_9_mid_task_loses_nothing_and_runs_nothing_twice(url, isolated_env, tmp_path):
    broker = open_broker(url, tmp_path)
    client = Client(broker)
    ids = [client.submit(ClassifyTask(input=f"item {i}", labels=["a", "b"])) for i in range(12)]
    a = start_worker(url, {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "a")})
    deadline = time.time() + 30
    while time.time() < deadline and not any(v.state == "leased" for v in map(broker.get, ids)):
        time.sleep(0.05)
    time.sleep(0.5)  # a few tasks done, one in flight
    held = [i for i in ids if broker.get(i).state == "leased"]
    assert held, "worker A never took a task"
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    b = start_worker(url, {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "b")}, "fake:latency_ms=200", "--burst")
    out, err = b.communicate(timeout=120)
    assert b.returncode == 0, err
    results = results_of(broker, ids)
    assert all(r is not None and r.status == "ok" for r in results.values())  # none lost
    for i in held:  # the task A died on: taken over after its lease expired, finished once
        view = broker.get(i)
        assert view.attempts == 2 and view.history[0].error.code == "lease_expired"
        assert results[i].attempts == 2
    assert sum(s.done for s in broker.stats()) == len(ids)  # exactly one result each


def test_a_node_killed_with_9_leaves_every_task_it_finished_in_the_history(url, isolated_env, tmp_path):
    """The page's counts come from the history the workers write; a worker held them until its next heartbeat,
    so one killed with -9 took up to a beat of finished tasks out of them (by hand: 33 counted of 40 answered
    over three kills). Each settled attempt is now written as it settles: here the node beats every 30 s and
    is killed long before its second beat."""
    from nodeagent.fleet.history import History

    broker = open_broker(url, tmp_path)
    client = Client(broker)
    ids = [client.submit(ClassifyTask(input=f"item {i}", labels=["a", "b"])) for i in range(30)]
    a = start_worker(url, {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "a")}, "fake:latency_ms=100",
                     "--heartbeat", "30", "--lease", "60")
    deadline = time.time() + 30
    while time.time() < deadline and sum(broker.result(i) is not None for i in ids) < 5:
        time.sleep(0.05)
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    done = sum(broker.result(i) is not None for i in ids)
    assert 5 <= done < len(ids)
    history = History.read(broker, broker.now(), 10, kinds=None)
    assert history.outcomes()[Q][0] == done
    assert sum(ok for ok, _ in history.by_node().values()) == done


def test_sigterm_drains_and_marks_the_node(url, isolated_env, tmp_path):
    broker = open_broker(url, tmp_path)
    client = Client(broker)
    ids = [client.submit(ClassifyTask(input=f"item {i}", labels=["a", "b"])) for i in range(5)]
    w = start_worker(url, {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "w")})
    while not any(broker.get(i).state == "done" for i in ids):
        time.sleep(0.05)
    w.send_signal(signal.SIGTERM)
    w.wait(20)
    assert w.returncode == 0, w.stderr.read()
    [node] = broker.nodes()
    assert node.state == "stopped"
    states = [broker.get(i).state for i in ids]
    assert set(states) <= {"done", "ready"} and "leased" not in states  # finished or given back, none held


def test_a_task_that_always_fails_is_dead_lettered(url, isolated_env, tmp_path):
    env = {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "w")}
    task_id = json.loads(cli(["submit", "classify", "--labels", "a,b", "--text", "always [boom]", "--broker", url,
                              "--json"], env).stdout)["task_id"]
    w = start_worker(url, env, "fake:fail=[boom]", "--burst")
    w.communicate(timeout=120)
    dead = json.loads(cli(["dlq", "list", "--broker", url, "--json"], env).stdout)
    assert [d["id"] for d in dead] == [task_id]
    assert [h["error"]["code"] for h in dead[0]["history"]] == ["backend_error"] * 4
    shown = json.loads(cli(["tasks", "show", task_id, "--broker", url, "--json"], env).stdout)
    assert shown["state"] == "dead" and shown["result"]["status"] == "error"
    # the shell's replay is the page's (fleet/controls.py): the task goes back, and the fleet's log says who
    replayed = json.loads(cli(["dlq", "replay", "--all", "--broker", url, "--json"], env).stdout)
    assert replayed == {"replayed": [task_id], "not_dead": []}
    broker = open_broker(url, tmp_path)
    assert broker.get(task_id).state == "ready"
    [event] = [e for e in broker.events(20) if e.get("kind") == "control"]
    assert event["action"] == "replay dead letters" and event["tasks"] == 1 and event["by"].startswith("cli ")


def test_the_shell_s_controls_are_the_page_s(url, isolated_env, tmp_path):
    """Hold, pause and cancel from the shell go through the operator API (fleet/controls.py): the broker's
    documents every node reads, and the fleet's event log says who did what."""
    from nodeagent.fleet.controls import read_controls

    env = {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "w")}
    task_id = json.loads(cli(["submit", "classify", "--labels", "a,b", "--text", "wait", "--broker", url,
                              "--json"], env).stdout)["task_id"]
    assert json.loads(cli(["queue", "pause", "classify.v1", "--broker", url, "--json"], env).stdout) == \
        {"queue": "classify.v1", "done": "paused"}
    assert json.loads(cli(["node", "hold", "pi-7", "--broker", url, "--json"], env).stdout)["done"] == "held"
    broker = open_broker(url, tmp_path)
    seen = read_controls(broker, "pi-7")
    assert seen.queues(["classify.v1", "extract.v1"]) == ["extract.v1"] and seen.hold.startswith("held by the operator (cli ")
    cancelled = json.loads(cli(["tasks", "cancel", task_id, "nope", "--broker", url, "--json"], env).stdout)
    assert cancelled == {"cancelled": [task_id], "not_cancelled": ["nope"]}
    assert broker.get(task_id).state == "cancelled"
    cli(["queue", "resume", "classify.v1", "--broker", url], env)
    cli(["node", "resume", "pi-7", "--broker", url], env)
    again = read_controls(broker, "pi-7")
    assert again.hold is None and again.queues(["classify.v1"]) == ["classify.v1"]
    actions = [(e["action"], e["target"]) for e in reversed(broker.events(20)) if e.get("kind") == "control"]
    assert actions == [("pause queue", "classify.v1"), ("hold node", "pi-7"), ("cancel task", task_id),
                       ("resume queue", "classify.v1"), ("resume node", "pi-7")]


def test_plain_redis_commands_enqueue_a_task(redis_server, isolated_env, tmp_path):
    """An orchestrator in another language: the documented contract, with raw commands, no nodeagent code."""
    import redis

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.flushall()
    task = {"type": "classify.v1", "id": "ext-42", "input": "from elsewhere", "labels": ["a", "b"]}
    envelope = {"id": "ext-42", "queue": "classify.v1", "task": task}
    assert r.execute_command("SET", "nodeagent:v1:idem:order-9", "ext-42", "NX") is True
    r.execute_command("XADD", "nodeagent:v1:q:classify.v1", "*", "envelope", json.dumps(envelope))
    w = start_worker(redis_server.url, {**isolated_env, "NODEAGENT_HOME": str(tmp_path)}, "fake", "--burst")
    w.communicate(timeout=60)
    result = json.loads(r.execute_command("GET", "nodeagent:v1:result:ext-42"))
    assert result["status"] == "ok" and result["task_id"] == "ext-42"
    assert r.execute_command("HGET", "nodeagent:v1:task:ext-42", "state") == "done"


def test_sigterm_stops_a_node_whose_broker_is_down_at_once(isolated_env, tmp_path):
    """A node stopped while Redis is down (a host rebooting, a service stopped in a broker outage) took 85 s, each
    beat of its drain riding out the 30 s a failover is given: longer than systemd waits before its SIGKILL. With
    nothing in flight it now leaves at once, its record left to age out as lost; the gateway too (28 s, and a
    traceback), and the scheduler."""
    server = RedisServer(tmp_path / "down")
    (tmp_path / "down").mkdir()
    server.start()
    try:
        w = start_worker(server.url, {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "w")}, "fake")
        gw = subprocess.Popen([sys.executable, "-m", "nodeagent", "gateway", "--broker", server.url, "--port",
                               str(free_port())], env={**os.environ, **isolated_env,
                                                       "NODEAGENT_HOME": str(tmp_path / "gw")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sched = subprocess.Popen([sys.executable, "-m", "nodeagent", "scheduler", "--broker", server.url],
                                 env={**os.environ, **isolated_env, "NODEAGENT_HOME": str(tmp_path / "s")},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        broker = open_broker(server.url, tmp_path)
        deadline = time.time() + 30
        while time.time() < deadline and len(broker.nodes()) < 2:
            time.sleep(0.1)
        assert len(broker.nodes()) == 2, "the worker or the gateway never registered"
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        time.sleep(1.5)  # its claims and beats are failing now
        for proc in (w, gw, sched):
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=90)
            took = time.monotonic() - started
            assert proc.returncode == 0, err
            assert took < 10, f"took {took:.1f} s to stop"
            assert "stopped" in err and "Traceback" not in err and "shutdown failed" not in err, err
    finally:
        server.stop()


def test_redis_restart_with_aof_loses_no_acknowledged_result(isolated_env, tmp_path):
    server = RedisServer(tmp_path / "aof", appendonly=True)
    (tmp_path / "aof").mkdir()
    server.start()
    try:
        client = Client(open_broker(server.url, tmp_path))
        ids = [client.submit(ClassifyTask(input=f"keep {i}", labels=["a", "b"])) for i in range(10)]
        w = start_worker(server.url, {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "w")}, "fake", "--burst")
        w.communicate(timeout=60)
        before = {i: client.wait(i, timeout=5) for i in ids}
        server.proc.send_signal(signal.SIGKILL)  # no clean shutdown: only the append-only file keeps them
        server.proc.wait(10)
        server.start()
        after = Client(open_broker(server.url, tmp_path))
        assert {i: after.broker.result(i) for i in ids} == before
    finally:
        server.stop()


def test_an_expired_lease_is_reclaimed_within_one_lease(url, isolated_env, tmp_path):
    broker = open_broker(url, tmp_path)
    client = Client(broker)
    task_id = client.submit(ClassifyTask(input="orphan", labels=["a", "b"]))
    claim = broker.claim([Q], "ghost", lease_s=1.0)  # a worker that will never come back
    assert claim is not None
    start = time.time()
    b = start_worker(url, {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "b")}, "fake", "--burst")
    b.communicate(timeout=60)
    view = broker.get(task_id)
    took = view.history[1].started_at - claim.leased_until
    assert view.state == "done" and view.history[1].node != "ghost"
    assert 0 <= took <= 1.0 + 0.5, took  # within one lease period after it expired
    assert time.time() - start < 30


@pytest.mark.real_model
def test_two_real_workers_serve_twenty_classifications_in_order(isolated_env, tmp_path, smollm2_path):
    url = f"sqlite://{tmp_path / 'queue.db'}"
    workers = [start_worker(url, {**isolated_env, "NODEAGENT_HOME": str(tmp_path / f"w{i}"), "NODEAGENT_CTX": "1024",
                                  "NODEAGENT_THREADS": "1"}, str(smollm2_path)) for i in range(2)]
    try:
        client = Client(open_broker(url, tmp_path))
        deadline = time.time() + 120
        while sum(n.state == "ready" for n in client.broker.nodes()) < 2 and time.time() < deadline:
            time.sleep(0.1)  # both loaded and registered: on a busy machine one may start much later
        texts = [f"Review {i}: {'I loved it, wonderful!' if i % 2 else 'Terrible, it broke on day one.'}"
                 for i in range(20)]
        fan = client.map([ClassifyTask(input=t, labels=["positive", "negative"]) for t in texts], timeout=300)
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(60)
    assert len(fan.ok) == 20 and not fan.failed and not fan.missing
    assert [r.task_id for _, r in fan.ok] == fan.task_ids
    assert all(set(r.output.probabilities) == {"positive", "negative"} and r.backend == "llamacpp"
               for _, r in fan.ok)
    served = {client.broker.get(i).history[-1].node for i in fan.task_ids}
    assert len(served) == 2  # both workers took tasks


def test_cli_submit_idempotency_and_status_fit(isolated_env, tmp_path, header_7b):
    env = {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "home")}
    args = ["submit", "classify", "--labels", "a,b", "--text", "once", "--idempotency-key", "k-1", "--json"]
    first = json.loads(cli(args, env).stdout)["task_id"]
    again = json.loads(cli(args, env).stdout)["task_id"]
    assert again == first
    # registered node with recorded hardware (a Pi 5): where does the 7B fit?
    from nodeagent.broker.base import NodeRecord
    from nodeagent.profiles import get_profile

    broker = open_broker(f"sqlite://{tmp_path / 'home' / 'queue.db'}", tmp_path)
    pi = get_profile("rpi5-8gb")
    mac = get_profile("apple-m2-pro-16gb")
    for name, profile in (("pi", pi), ("mac", mac)):
        broker.register(NodeRecord(id=name, hostname=name, agent_version="0", os=profile.match.os or "linux",
                                   arch=profile.nominal.arch, backend="llamacpp", labels={"profile": profile.id},
                                   hardware=profile.nominal_hardware().model_dump(mode="json"), state="ready"))
    status = json.loads(cli(["status", "--fit", str(header_7b), "--json"], env).stdout)
    fit = {f["node"]: f for f in status["fit"]}
    assert fit["mac"]["fits"] and fit["mac"]["ctx_tokens"] >= 8192
    assert fit["pi"]["fits"] and fit["pi"]["ctx_tokens"] <= fit["mac"]["ctx_tokens"]
    four = get_profile("rpi4-4gb")
    broker.register(NodeRecord(id="pi4", hostname="pi4", agent_version="0", os="linux", arch="aarch64",
                               backend="llamacpp", labels={"profile": four.id}, state="ready",
                               hardware=four.nominal_hardware().model_dump(mode="json")))
    age_heartbeat(broker, "pi4", 120)
    status = json.loads(cli(["status", "--fit", str(header_7b), "--json"], env).stdout)
    pi4 = next(f for f in status["fit"] if f["node"] == "pi4")
    assert not pi4["fits"] and "nothing fits" in pi4["why"]
    assert {q["queue"]: q["ready"] for q in status["queues"]} == {"classify.v1": 1}
    lost = {n["id"]: n["lost"] for n in status["nodes"]}
    assert lost == {"mac": False, "pi": False, "pi4": True}  # no heartbeat for 2 minutes
    assert any("pi4 is lost" in a for a in status["alerts"])
