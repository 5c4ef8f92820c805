"""The worker, the guard and the orchestrator client, on both brokers, with the fake backend as the model:
the other side of the boundary. Real processes (kill -9, SIGTERM) are in test_fleet_processes.py."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import QUIET_GUARD, raw_enqueue

from nodeagent.broker.base import Envelope
from nodeagent.client import Client, WaitTimeout
from nodeagent.config import resolve
from nodeagent.fleet.guard import Guard, GuardConfig, Readings
from nodeagent.fleet.worker import Worker, WorkerConfig
from nodeagent.node import Node
from nodeagent.tasks.contracts import ClassifyTask, ExtractTask

Q = "classify.v1"


def worker(broker, model="fake", burst=True, **kw) -> Worker:
    node = Node(model, config=resolve(env={}))
    config = WorkerConfig(node_id=kw.pop("node_id", "w1"), queues=kw.pop("queues", [Q, "extract.v1"]),
                          burst=burst, retry_base_s=0.01, retry_cap_s=0.05, idle_max_s=0.05, **kw)
    return Worker(broker, node, config, guard=kw.pop("guard", None))


def test_burst_serves_every_task_and_fans_in_in_order(broker):
    client = Client(broker)
    tasks = [ClassifyTask(input=f"text {i}", labels=["red", "green", "blue"]) for i in range(40)]
    done = {}

    def fan():
        done["fan"] = client.map(tasks, max_in_flight=8, timeout=60)

    t = threading.Thread(target=fan)
    t.start()
    time.sleep(0.2)
    w = worker(broker, burst=False)
    runner = threading.Thread(target=w.run)
    runner.start()
    t.join(60)
    w.stop()
    runner.join(10)
    fan = done["fan"]
    assert len(fan.ok) == 40 and not fan.failed and not fan.missing
    assert [r.task_id for _, r in fan.ok] == [task.id for task in tasks]  # submission order


def test_failing_task_is_dead_lettered_with_its_history_and_kept_apart(broker):
    client = Client(broker)
    good = [ClassifyTask(input=f"fine {i}", labels=["a", "b"]) for i in range(3)]
    bad = ClassifyTask(input="this one [boom]", labels=["a", "b"])
    ids = [client.submit(t, index=i) for i, t in enumerate([good[0], bad, *good[1:]])]
    summary = worker(broker, "fake:fail=[boom]").run()
    assert summary == {"completed": 3, "failed": 4}
    view = broker.get(ids[1])
    assert view.state == "dead" and view.attempts == 4
    assert [h.error.code for h in view.history] == ["backend_error"] * 4
    assert [v.id for v in broker.dead()] == [ids[1]]
    r = client.wait(ids[1], timeout=1)
    assert r.status == "error" and r.output is None and r.error.code == "backend_error"


def test_malformed_payload_is_dead_lettered_and_the_worker_keeps_serving(broker):
    raw_enqueue(broker, "raw-1", Q, '{"id": "raw-1", "queue": "classify.v1", "task": {"input": 7}}')
    client = Client(broker)
    good = client.submit(ClassifyTask(input="fine", labels=["a", "b"]))
    worker(broker).run()
    view = broker.get("raw-1")
    assert view.state == "dead" and view.last_error.code == "invalid_task"
    assert client.wait(good, timeout=1).status == "ok"


def test_task_past_its_time_limit_is_stopped(broker):
    client = Client(broker)
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 50}}, "required": ["name"]}
    task_id = client.submit(ExtractTask(input="a long name", schema=schema))
    worker(broker, default_timeout_s=0.001).run()
    r = client.wait(task_id, timeout=1)
    assert r.status == "error" and r.error.code == "timeout"


def test_a_task_past_its_deadline_is_not_started(broker):
    e = Envelope(queue=Q, task=ClassifyTask(input="late", labels=["a", "b"]).model_dump(mode="json"),
                 deadline=time.time() - 1)
    broker.enqueue(e)
    worker(broker).run()
    assert broker.get(e.id).last_error.code == "deadline_exceeded"


def test_submit_wait_cancel_and_idempotency(broker):
    client = Client(broker)
    task = ClassifyTask(input="once", labels=["a", "b"])
    first = client.submit(task, idempotency_key="order-17")
    assert client.submit(ClassifyTask(input="twice", labels=["a", "b"]), idempotency_key="order-17") == first
    with pytest.raises(WaitTimeout):
        client.wait(first, timeout=0.1)
    other = client.submit(ClassifyTask(input="never", labels=["a", "b"]))
    assert client.cancel(other)
    worker(broker).run()
    assert client.wait(first, timeout=1).status == "ok"
    assert broker.get(other).state == "cancelled" and broker.result(other) is None


def test_routing_to_the_named_model(broker):
    client = Client(broker)
    mine = client.submit(ClassifyTask(input="for me", labels=["a", "b"]), model="fake")
    theirs = client.submit(ClassifyTask(input="for gemma", labels=["a", "b"]), model="gemma-3-270m-it")
    w = worker(broker, models=["fake"], burst=False)
    t = threading.Thread(target=w.run)
    t.start()
    client.wait(mine, timeout=10)
    w.stop()
    t.join(10)
    assert broker.get(theirs).state == "ready"


def test_drain_gives_the_running_task_back(broker):
    client = Client(broker)
    task_id = client.submit(ClassifyTask(input="slow", labels=["a", "b"]))
    w = worker(broker, "fake:latency_ms=400", burst=False, drain_s=0.01)
    t = threading.Thread(target=w.run)
    t.start()
    time.sleep(0.2)  # mid-task
    w.stop()
    t.join(10)
    view = broker.get(task_id)
    # the fake's latency is one sleep before the first token, so the task finishes there: either way, nothing
    # is lost and it counts once
    assert view.state in ("ready", "done") and view.attempts <= 1


# -- the guard, with made-up readings ------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_guard_pauses_on_memory_and_cpu():
    reading = {"m": 50.0, "c": 10.0}
    g = Guard(GuardConfig(sample_every_s=0), read=lambda: Readings(memory_pct=reading["m"], cpu_pct=reading["c"]))
    assert g.may_claim() and g.state == "ok"
    reading["m"] = 85.1
    assert not g.may_claim() and g.state == "paused" and "memory" in g.reason
    reading["m"], reading["c"] = 84.9, 90.5
    assert not g.may_claim() and "CPU" in g.reason
    reading["c"] = 89.0
    assert g.may_claim() and g.state == "ok"
    assert [e["to"] for e in g.events] == ["paused", "paused", "ok"]


def test_guard_unhealthy_on_error_rate_then_probes():
    clock = Clock()
    g = Guard(GuardConfig(min_samples=10, cooldown_s=60), read=lambda: Readings(memory_pct=10, cpu_pct=0),
              clock=clock)
    for _ in range(9):
        g.record(True)
    g.record(False)
    assert g.state == "ok"  # 1 of 10 = 10 %, under 15 %
    g.record(False)
    assert g.state == "unhealthy"  # 2 of 11 = 18 %
    assert not g.may_claim()
    clock.t += 61
    assert g.may_claim()  # the cooldown passed: one probe
    g.record(False)
    assert g.state == "unhealthy" and not g.may_claim()
    clock.t += 61
    g.record(True)
    assert g.state == "ok" and g.may_claim()


def test_guard_alerts_after_three_consecutive_failures():
    posted = []
    g = Guard(GuardConfig(webhook="http://127.0.0.1:9/alert", min_samples=100),
              read=lambda: Readings(memory_pct=10, cpu_pct=0), post=lambda url, event: posted.append((url, event)))
    for ok in (False, False, True, False, False):
        g.record(ok)
    assert not posted
    g.record(False)
    time.sleep(0.1)
    assert len(posted) == 1 and posted[0][1]["alert"] == "3 consecutive task failures"


def test_guard_pauses_the_worker(broker):
    reading = {"m": 99.0}
    guard = Guard(GuardConfig(), read=lambda: Readings(memory_pct=reading["m"], cpu_pct=0))
    client = Client(broker)
    task_id = client.submit(ClassifyTask(input="wait for memory", labels=["a", "b"]))
    w = Worker(broker, Node("fake", config=resolve(env={})), WorkerConfig(node_id="g", queues=[Q], burst=True,
                                                                          idle_max_s=0.05), guard=guard)
    t = threading.Thread(target=w.run)
    t.start()
    time.sleep(0.3)
    assert broker.get(task_id).state == "ready"  # not claimed while memory is high
    reading["m"] = 20.0
    t.join(10)
    assert broker.get(task_id).state == "done"


def test_errors_reach_the_guard(broker):
    g = Guard(GuardConfig(min_samples=3, cooldown_s=600), read=lambda: Readings(memory_pct=1, cpu_pct=0))
    client = Client(broker)
    for i in range(4):
        client.submit(ClassifyTask(input=f"[boom] {i}", labels=["a", "b"]), max_attempts=1)
    w = Worker(broker, Node("fake:fail=[boom]", config=resolve(env={})),
               WorkerConfig(node_id="e", queues=[Q], burst=True, idle_max_s=0.05), guard=g)
    t = threading.Thread(target=w.run)
    t.start()
    time.sleep(1.0)
    w.stop()
    t.join(10)
    assert g.state == "unhealthy" and len(broker.dead()) == 3  # the fourth waits for the cooldown


def readme_block(marker: str, page: str = "README.md") -> str:
    """The Python block after ``marker`` in ``page`` (README.md, or a page under docs/), as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / page).read_text()
    return text[text.index(marker):].split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_client_example_runs(tmp_path):
    """The README's fan-out of 100 classifications, as written, against a worker on this machine's queue."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NODEAGENT_HOME": str(tmp_path), "NODEAGENT_CONFIG": str(tmp_path / "none.toml"),
           **QUIET_GUARD}
    w = subprocess.Popen([sys.executable, "-m", "nodeagent", "worker", "--model", "fake"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        proc = subprocess.run([sys.executable, "-c", readme_block("<!-- client-example -->")], env=env,
                              capture_output=True, text=True, timeout=300)
    finally:
        w.terminate()
        try:
            w.wait(30)
        except subprocess.TimeoutExpired:  # say what the worker and the client said before failing
            w.kill()
            raise AssertionError(f"the worker did not stop within 30 s of SIGTERM; its log: {w.stderr.read()!r}")
    assert proc.returncode == 0, proc.stderr
    counts, failures = proc.stdout.strip().splitlines()
    assert counts.startswith("Counter(") and sum(int(n) for n in __import__("re").findall(r": (\d+)", counts)) == 100
    assert failures == "0 failed, 0 unfinished"


def test_status_alerts_on_a_growing_queue():
    from nodeagent.fleet.status import _trend

    now = 10_000.0
    growing = [(now - 100 + 20 * i, {Q: 10 * i}) for i in range(6)]
    trend, alert = _trend(growing, Q, now)
    assert trend.startswith("+") and alert and "keeps growing" in alert
    steady = [(now - 100 + 20 * i, {Q: 5}) for i in range(6)]
    assert _trend(steady, Q, now) == ("steady", None)
    brief = [(now - 4 + i, {Q: i}) for i in range(5)]  # growing, but over seconds: not yet an alert
    assert _trend(brief, Q, now)[1] is None


def test_guard_readings_are_sampled_not_taken_per_claim():
    clock = Clock()
    taken = []
    g = Guard(GuardConfig(sample_every_s=0.5), read=lambda: taken.append(1) or Readings(memory_pct=1, cpu_pct=0),
              clock=clock)
    for _ in range(100):
        g.may_claim()
    assert len(taken) == 1
    clock.t += 0.5
    g.may_claim()
    assert len(taken) == 2


def test_a_streamed_task_whose_log_cannot_be_read_is_given_back_not_failed(broker):
    """A worker first reads a streamed task's log (to continue what an earlier attempt sent). When that read fails
    (the broker's blip outlasting its retries), what went out is unknown: the task goes back for a next claim,
    its attempt uncounted, instead of failing as not resumable though nothing was sent."""
    from nodeagent.tasks.contracts import ChatTask

    task = ChatTask(request={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    broker.open_log(task.id, 60)
    broker.enqueue(Envelope.of(task, id=task.id, progress=True))
    real = broker.read_logs
    fails = {"left": 1}

    def flaky(cursors, wait_s=0.0):
        if task.id in cursors and fails["left"]:
            fails["left"] -= 1
            raise ConnectionError("the broker went away")
        return real(cursors, wait_s)

    broker.read_logs = flaky
    w = worker(broker, queues=["chat.v1"])
    w.run()
    result = broker.result(task.id)
    assert fails["left"] == 0 and result is not None and result.status == "ok", result
    assert result.attempts == 1 and broker.get(task.id).attempts == 1


def test_a_nodes_counts_reach_its_record_without_waiting_for_a_heartbeat(broker):
    """`status` lists each node's done and failed counts beside the queue's own done column: they come within
    about a second of a task settling, not a heartbeat (here 60 s) later."""
    from nodeagent.broker.base import NodeRecord

    client = Client(broker)
    w = worker(broker, burst=False, heartbeat_s=60)
    w.record = NodeRecord(id="w1", hostname="w1", agent_version="0", os="linux", arch="x86_64", backend="fake")
    runner = threading.Thread(target=w.run)
    runner.start()
    try:
        ids = [client.submit(ClassifyTask(input=f"t {i}", labels=["a", "b"])) for i in range(5)]
        for i in ids:
            client.wait(i, timeout=30)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            [node] = [n for n in broker.nodes() if n.id == "w1"]
            if node.completed == 5:
                break
            time.sleep(0.1)
        assert node.completed == 5, node.completed
    finally:
        w.stop()
        runner.join(10)


# -- Client.map and wait end on every way a task ends (cancelled by an operator or a gateway, forgotten) ------------

def _forget(broker, task_id: str) -> None:
    """The task dropped as the retention's purge or expiry drops a finished one: cancelled (a gateway's verdict), then
    its record and result gone."""
    broker.cancel(task_id, free_key=True)
    if broker.url.startswith("sqlite"):
        with broker._tx() as db:
            db.execute("DELETE FROM results WHERE task_id=?", (task_id,))
            db.execute("DELETE FROM tasks WHERE id=?", (task_id,))
    else:
        broker.r.delete(f"nodeagent:v1:task:{task_id}", f"nodeagent:v1:result:{task_id}")


def test_map_without_a_timeout_ends_when_tasks_are_cancelled_or_forgotten(broker, monkeypatch):
    """An operator's cancel, a gateway's cancel and a task the broker no longer knows each end the fan-in's wait
    (map has no timeout here): the cancelled ones are failures with their reason, the forgotten one is missing with
    why, and the rest are the successes."""
    import nodeagent.fleet.client as client_module
    from nodeagent.fleet.controls import cancel_task

    client = Client(broker)
    tasks = [ClassifyTask(input=f"text {i}", labels=["a", "b"]) for i in range(6)]
    real_pause = client_module.pause
    acted = []

    def pause_once_acting(seconds):  # the first pause of map's loop: every task is queued, none has ended
        if not acted:
            acted.append(cancel_task(broker, tasks[3].id, by="test-operator"))
            acted.append(broker.cancel(tasks[4].id, free_key=True))  # a gateway whose client went away
            _forget(broker, tasks[5].id)
        real_pause(seconds)

    monkeypatch.setattr(client_module, "pause", pause_once_acting)
    w = worker(broker, "fake:latency_ms=50", burst=False)
    runner = threading.Thread(target=w.run)
    runner.start()
    done = {}
    fan_in = threading.Thread(target=lambda: done.update(fan=client.map(tasks, max_in_flight=8)), daemon=True)
    fan_in.start()
    fan_in.join(30)
    w.stop()
    runner.join(10)
    assert acted == [True, True] and "fan" in done, "map kept waiting on tasks that had ended"
    fan = done["fan"]
    assert [i for i, _ in fan.ok] == [0, 1, 2]
    assert [(i, r.error.code) for i, r in fan.failed] == [(3, "cancelled"), (4, "cancelled")]
    assert all("cancelled" in r.error.message and not r.error.retryable for _, r in fan.failed)
    assert fan.missing == [5] and "no longer knows" in fan.why[5]
    assert fan.why[:5] == [None] * 5


def test_wait_ends_on_a_cancel_and_on_a_forgotten_task(broker):
    """wait() answers a cancelled task with its error Result (code cancelled), and a task the broker no longer
    knows with NotFoundError at once, whatever the timeout."""
    from nodeagent.errors import NotFoundError
    from nodeagent.fleet.controls import cancel_task

    client = Client(broker)
    cancelled = client.submit(ClassifyTask(input="stopped", labels=["a", "b"]))
    forgotten = client.submit(ClassifyTask(input="dropped", labels=["a", "b"]))
    assert cancel_task(broker, cancelled, by="test-operator")
    _forget(broker, forgotten)
    r = client.wait(cancelled)
    assert r.status == "error" and r.error.code == "cancelled" and r.task_id == cancelled and r.type == Q
    started = time.monotonic()
    with pytest.raises(NotFoundError, match="no longer knows"):
        client.wait(forgotten)
    assert time.monotonic() - started < 5
