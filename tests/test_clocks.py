"""One clock for the fleet: every lease, deadline, retry, heartbeat and the leader lease on the broker's time.

First with injected clocks (a node's wall clock off by minutes, a wall clock that steps under a SQLite queue, a
lease left from another boot), then with real processes whose wall clocks libfaketime shifts by 10 minutes
(monotonic clocks untouched), on both engines: workers ahead and behind sharing a queue of tasks with 5-minute
deadlines, retries and a standby scheduler; and a SQLite worker whose wall clock steps forward and back in the
middle of a lease."""

from __future__ import annotations

import glob
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import age_heartbeat, spawn

from nodeagent.broker.base import Envelope, NodeRecord
from nodeagent.broker.open import open_broker
from nodeagent.broker.sqlite import SqliteBroker
from nodeagent.client import Client
from nodeagent.clock import BrokerClock
from nodeagent.fleet.scheduler import LeaderLease, lease_holder
from nodeagent.fleet.status import fleet_status
from nodeagent.fleet.worker import Worker, WorkerConfig
from nodeagent.tasks.contracts import ClassifyTask, ErrorInfo

Q = "classify.v1"
SKEW_S = 600.0


def record(node_id: str) -> NodeRecord:
    return NodeRecord(id=node_id, hostname=node_id, agent_version="0", os="linux", arch="x86_64", backend="fake",
                      state="ready")


def fake_node():
    """The node under a worker: the fake backend through the real task runner."""
    from nodeagent.node import Node

    return Node("fake")


# -- injected clocks -------------------------------------------------------------------------------------------
def test_the_broker_clock_reads_once_and_runs_on_the_monotonic_clock():
    reads = []
    server = [1000.0]

    def read():
        reads.append(1)
        return server[0]

    clock = BrokerClock(read, refresh_s=60)
    first = clock.now()
    assert first == pytest.approx(1000.0, abs=0.01) and len(reads) == 1
    assert clock.offset_s == pytest.approx(time.time() - 1000.0, abs=0.05)  # this process's wall less the broker's
    time.sleep(0.05)
    assert clock.now() - first == pytest.approx(0.05, abs=0.02) and len(reads) == 1  # no round trip
    server[0] = 5000.0
    assert clock.sample() == pytest.approx(5000.0, abs=0.01) and len(reads) == 2


def test_a_node_whose_wall_clock_is_off_serves_deadlines_on_the_brokers_time_and_is_named(broker):
    """Two workers on one queue, one whose own clock runs 10 minutes ahead: it dead-letters no task whose
    5-minute deadline has not passed, its offset is measured, and status alerts on it and on nothing else."""
    client = Client(broker)
    ids = [client.submit(ClassifyTask(input=f"t{i}", labels=["a", "b"]), deadline=timedelta(minutes=5))
           for i in range(6)]
    node = fake_node()
    workers = [Worker(broker, node, WorkerConfig(node_id=name, queues=[Q], heartbeat_s=0.05), record=record(name),
                      wall=wall) for name, wall in (("ahead", lambda: time.time() + SKEW_S), ("true", time.time))]
    threads = [threading.Thread(target=w.run) for w in workers]
    for t in threads:
        t.start()
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not all(broker.result(i) for i in ids):
            time.sleep(0.05)
        time.sleep(0.2)  # a heartbeat or two with the offsets measured
        status = fleet_status(broker, lost_after_s=30, clock_warn_s=5)
    finally:
        for w in workers:
            w.stop()
        for t in threads:
            t.join(30)
    assert all(broker.result(i).status == "ok" for i in ids)  # none dead-lettered for a deadline
    offsets = {n.id: n.clock_offset_s for n in status.nodes}
    assert offsets["ahead"] == pytest.approx(SKEW_S, abs=2) and abs(offsets["true"]) < 2
    clock_alerts = [a for a in status.alerts if "clock" in a]
    assert len(clock_alerts) == 1 and "ahead" in clock_alerts[0] and "+600" in clock_alerts[0]
    late = client.submit(ClassifyTask(input="late", labels=["a", "b"]), deadline=broker.now() - 1)
    Worker(broker, node, WorkerConfig(node_id="true", queues=[Q], burst=True), record=record("true")).run()
    assert broker.result(late).error.code == "deadline_exceeded"  # a deadline past on the broker's clock


def test_the_standby_compares_the_leader_lease_on_the_brokers_time(broker):
    """A standby whose own clock runs ahead by more than the lease's TTL does not take it from a live leader."""
    leader = LeaderLease(broker, "leader", ttl_s=15)
    standby = LeaderLease(broker, "standby", ttl_s=15)  # its clock is the broker's, whatever its host's says
    assert leader.hold() and not standby.hold()
    assert leader.hold() and not standby.hold()
    assert lease_holder(broker).owner == "leader"


def test_a_sqlite_queue_keeps_one_time_whatever_each_process_wall_clock_says(tmp_path):
    path = tmp_path / "queue.db"
    true = SqliteBroker(path)
    ahead = SqliteBroker(path, wall=lambda: time.time() + SKEW_S)  # a process whose clock is off from its start
    assert ahead.now() == pytest.approx(true.now(), abs=0.5)  # the anchor the first process of the boot wrote


def test_a_wall_clock_step_moves_deadlines_not_leases(tmp_path):
    """A process that sees its wall clock step (NTP correcting a Pi at boot) moves the queue's time for every
    process; a lease taken before the step is still held, on the host clock, forward and back."""
    step = [0.0]
    stepping = SqliteBroker(tmp_path / "queue.db", wall=lambda: time.time() + step[0])
    other = SqliteBroker(tmp_path / "queue.db")
    e = Envelope(queue=Q, task=ClassifyTask(input="x", labels=["a", "b"]).model_dump(mode="json"))
    other.enqueue(e)
    claim = other.claim([Q], "n1", lease_s=30)
    before = other.now()
    assert stepping.now() == pytest.approx(before, abs=0.5)  # running before the step
    for jump in (SKEW_S, -SKEW_S):
        step[0] += jump
        assert stepping.now() == pytest.approx(time.time() + step[0], abs=0.5)  # it followed the step
        assert other.claim([Q], "n2", lease_s=30) is None  # the lease still runs
        assert other.renew(claim, 30)
    other._anchor = None  # the other process reads the anchor again (it does every 2 s)
    assert other.now() == pytest.approx(before, abs=1)  # forward and back: where it was


def test_a_lease_from_another_boot_has_expired(tmp_path):
    import sqlite3

    broker = SqliteBroker(tmp_path / "queue.db")
    e = Envelope(queue=Q, task=ClassifyTask(input="x", labels=["a", "b"]).model_dump(mode="json"))
    broker.enqueue(e)
    claim = broker.claim([Q], "n1", lease_s=3600)
    assert broker.claim([Q], "n2", lease_s=30) is None
    with sqlite3.connect(broker.path) as db:  # the database moved to another boot of the host
        db.execute("UPDATE tasks SET boot = 'an-earlier-boot'")
    again = broker.claim([Q], "n2", lease_s=30)
    assert again is not None and again.attempt == 2 and not broker.renew(claim, 30)
    assert broker.get(e.id).history[0].error.code == "lease_expired"


def test_retries_wait_their_backoff_on_the_brokers_clock(broker):
    e = Envelope(queue=Q, task=ClassifyTask(input="x", labels=["a", "b"]).model_dump(mode="json"))
    broker.enqueue(e)
    c = broker.claim([Q], "n1", lease_s=30)
    broker.retry(c, ErrorInfo(code="backend_error", message="once", retryable=True), delay_s=0.4)
    assert broker.claim([Q], "n1", lease_s=30) is None
    time.sleep(0.5)
    again = broker.claim([Q], "n1", lease_s=30)
    assert again is not None
    first, second = broker.get(e.id).history
    assert second.started_at - first.ended_at >= 0.4


def test_status_ages_are_the_brokers(broker):
    broker.register(record("quiet"))
    age_heartbeat(broker, "quiet", 120)
    [node] = fleet_status(broker, lost_after_s=30).nodes
    assert node.lost and node.heartbeat_age_s == pytest.approx(120, abs=2)


# -- real processes under libfaketime ---------------------------------------------------------------------------
def faked(env: dict, offset: str | None = None, file: Path | None = None) -> dict:
    """``env`` for a process whose wall clock libfaketime shifts, its monotonic clocks untouched."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    assert found, "libfaketime is not installed: scripts/test installs it (apt-get install faketime)"
    extra = {"LD_PRELOAD": found[0], "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    if file is not None:
        extra.update({"FAKETIME_TIMESTAMP_FILE": str(file), "FAKETIME_NO_CACHE": "1"})
    else:
        extra["FAKETIME"] = offset or "+0"
    return {**env, **extra}


@pytest.fixture(params=["sqlite", "redis"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'queue.db'}"
    import redis

    server = request.getfixturevalue("redis_server")
    redis.Redis.from_url(server.url).flushall()
    return server.url


def test_workers_ahead_and_behind_share_a_queue_with_deadlines_retries_and_a_standby(url, isolated_env, tmp_path):
    broker = open_broker(url, tmp_path)
    client = Client(broker, max_attempts=40)
    env = {**isolated_env, "NODEAGENT_MAX_ATTEMPTS": "40", "NODEAGENT_RETRY_BASE_S": "0.3",
           "NODEAGENT_RETRY_CAP_S": "2", "NODEAGENT_SCHEDULER_LEASE_S": "3", "NODEAGENT_SCHEDULE_S": "0.5"}
    common = ["worker", "--broker", url, "--lease", "2", "--heartbeat", "0.5"]
    procs = {
        # the skewed workers fail the flaky tasks (retried until the worker with the true clock takes them)
        "ahead": spawn([*common, "--model", "fake:latency_ms=150,fail=flaky"],
                       faked({**env, "NODEAGENT_HOME": str(tmp_path / "a")}, "+10m"), "ahead"),
        "behind": spawn([*common, "--model", "fake:latency_ms=150,fail=flaky"],
                        faked({**env, "NODEAGENT_HOME": str(tmp_path / "b")}, "-10m"), "behind"),
        "true": spawn([*common, "--model", "fake:latency_ms=150"], {**env, "NODEAGENT_HOME": str(tmp_path / "c")},
                      "true"),
        "leader": spawn(["scheduler", "--broker", url], {**env, "NODEAGENT_HOME": str(tmp_path / "s1")}),
    }
    leader = f":{procs['leader'].pid}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (lease_holder(broker) and lease_holder(broker).owner.endswith(leader)
                                              and len([n for n in broker.nodes() if n.state == "ready"]) == 3):
            time.sleep(0.1)
        # 24 tasks due in 5 minutes; every second is flaky (not every third: the three workers, of one latency,
        # take tasks in turn, and a period of three can put every flaky task on the worker that never fails one)
        ids = [client.submit(ClassifyTask(input=("flaky " if i % 2 == 0 else "") + f"item {i}", labels=["a", "b"]),
                             deadline=timedelta(minutes=5)) for i in range(24)]
        # the standby's clock runs ahead by far more than the lease's 3 s
        procs["standby"] = spawn(["scheduler", "--broker", url],
                                 faked({**env, "NODEAGENT_HOME": str(tmp_path / "s2")}, "+10m"))
        owners: set[str] = set()
        lost_seen: set[str] = set()
        alerts: list[str] = []
        deadline = time.time() + 90
        while time.time() < deadline and not all(broker.result(i) for i in ids):
            owners.add(lease_holder(broker).owner)
            status = fleet_status(broker, lost_after_s=30)
            lost_seen |= {n.id for n in status.nodes if n.lost}
            alerts = status.alerts
            time.sleep(0.2)
        for _ in range(10):  # a few more rounds of the schedulers
            owners.add(lease_holder(broker).owner)
            time.sleep(0.2)
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for name, p in procs.items():
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, (name, err[-3000:])
    results = {i: broker.result(i) for i in ids}
    assert all(r is not None and r.status == "ok" for r in results.values()), \
        [(i, r.error) for i, r in results.items() if r is None or r.status != "ok"]  # none dead for a deadline
    assert sum(s.done for s in broker.stats()) == len(ids)  # each ended once
    retried = [broker.get(i) for i in ids if broker.get(i).attempts > 1]
    assert retried, ("no task was retried", [[a.node for a in broker.get(i).history] for i in ids])
    for view in retried:  # each retry began after the attempt before it ended, on one clock
        for a, b in zip(view.history, view.history[1:]):
            assert b.started_at >= a.ended_at, view.history
    assert len(owners) == 1 and owners.pop().endswith(leader)  # one scheduler led throughout
    assert not lost_seen  # no live node shown lost
    clock_alerts = sorted(a.split("'")[0].removeprefix("node ") for a in alerts if "off the broker's" in a)
    assert clock_alerts == ["ahead", "behind"], alerts
    offsets = {n.id: n.clock_offset_s for n in broker.nodes()}
    assert offsets["ahead"] == pytest.approx(SKEW_S, abs=5) and offsets["behind"] == pytest.approx(-SKEW_S, abs=5)
    assert abs(offsets["true"]) < 5


def test_a_sqlite_lease_holds_across_wall_clock_steps(isolated_env, tmp_path):
    url = f"sqlite://{tmp_path / 'queue.db'}"
    broker = open_broker(url, tmp_path)
    client = Client(broker)
    slow = client.submit(ClassifyTask(input="slow", labels=["a", "b"]))
    step = tmp_path / "step"
    step.write_text("+0\n")
    env = {**isolated_env, "NODEAGENT_RETRY_BASE_S": "0.3"}
    common = ["worker", "--broker", url, "--lease", "2", "--heartbeat", "0.5"]
    stepping = spawn([*common, "--model", "fake:latency_ms=6000"],
                     faked({**env, "NODEAGENT_HOME": str(tmp_path / "a")}, file=step), "stepping")
    other = None
    try:
        deadline = time.time() + 30
        while time.time() < deadline and broker.get(slow).state != "leased":
            time.sleep(0.05)
        assert broker.get(slow).node == "stepping"
        other = spawn([*common, "--model", "fake:latency_ms=10"], {**env, "NODEAGENT_HOME": str(tmp_path / "b")},
                      "other")
        time.sleep(1.5)
        step.write_text("+10m\n")  # forward in the middle of the lease
        time.sleep(1.5)
        step.write_text("-10m\n")  # and back, past where it was
        deadline = time.time() + 30
        while time.time() < deadline and broker.result(slow) is None:
            time.sleep(0.1)
    finally:
        errs = {}
        for p in filter(None, (stepping, other)):
            p.send_signal(signal.SIGTERM)
        for p in filter(None, (stepping, other)):
            errs[p.pid] = p.communicate(timeout=60)[1]
            assert p.returncode == 0, errs[p.pid][-3000:]
    view = broker.get(slow)
    assert broker.result(slow).status == "ok" and view.attempts == 1  # the lease was never taken
    assert [a.node for a in view.history] == ["stepping"]
    assert "the wall clock stepped" in errs[stepping.pid]  # it saw both steps and said so
