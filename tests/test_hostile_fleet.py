"""A fleet that no task and no blip can take down: poison payloads on both brokers, broker errors and outages
under the worker loop, validation that backtracks without end, and the queue's promises (reclaim first, ids
that match, refused duplicates, idempotency keys that expire with their task, health that counts only the
node's own faults). Each test reproduces a defect a hostile probe found; real worker processes and a real
Redis where the defect was seen with them."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
from conftest import QUIET_GUARD, RedisServer, cli, raw_enqueue

from nodeagent.broker.open import open_broker
from nodeagent.client import Client
from nodeagent.config import resolve
from nodeagent.errors import ConflictError
from nodeagent.fleet.guard import Guard, GuardConfig, Readings
from nodeagent.fleet.worker import Worker, WorkerConfig
from nodeagent.node import Node
from nodeagent.tasks.contracts import ClassifyTask, ExtractTask

Q = "classify.v1"
def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def poison_envelopes() -> dict[str, str]:
    """Envelopes (as raw JSON text) that crashed every worker that claimed them, by what they hold."""
    task = {"type": Q, "id": "deep", "input": "x", "labels": ["a", "b"]}
    schema: dict = {"type": "object"}
    for _ in range(150):
        schema = {"type": "object", "properties": {"a": schema}}
    return {
        "deep": json.dumps({"id": "deep", "queue": Q, "task": {**task, "input": "x"}})[:-1] +
        f', "extra": {deep(2000)}}}',
        "surrogate-input": json.dumps({"id": "surrogate-input", "queue": Q,
                                       "task": {**task, "id": "surrogate-input", "input": "\ud800"}}),
        "surrogate-label": json.dumps({"id": "surrogate-label", "queue": Q,
                                       "task": {**task, "id": "surrogate-label", "labels": ["a\udc00", "b"]}}),
        "deep-schema": json.dumps({"id": "deep-schema", "queue": "extract.v1",
                                   "task": {"type": "extract.v1", "id": "deep-schema", "input": "x",
                                            "schema": schema}}),
    }


def worker(broker, model="fake", **kw) -> Worker:
    node = Node(model, config=kw.pop("config", None) or resolve(env={}))
    config = WorkerConfig(node_id=kw.pop("node_id", "w1"), queues=kw.pop("queues", [Q, "extract.v1"]),
                          burst=kw.pop("burst", True), retry_base_s=0.01, retry_cap_s=0.05, idle_max_s=0.05, **kw)
    return Worker(broker, node, config, guard=kw.pop("guard", None))


def test_poison_payloads_are_dead_lettered_at_the_first_claim(broker):
    for task_id, text in poison_envelopes().items():
        raw_enqueue(broker, task_id, "extract.v1" if task_id == "deep-schema" else Q, text)
    good = Client(broker).submit(ClassifyTask(input="fine", labels=["a", "b"]))
    summary = worker(broker).run()
    assert summary["completed"] == 1
    dead = {v.id: v for v in broker.dead()}
    assert set(dead) == set(poison_envelopes())  # every one filed under its own id
    for task_id, view in dead.items():
        assert view.attempts == 1 and view.last_error.code == "invalid_task", (task_id, view.last_error)
        assert broker.result(task_id).status == "error"
    assert "nested deeper" in dead["deep"].last_error.message
    assert "surrogate" in dead["surrogate-input"].last_error.message
    assert "surrogate" in dead["surrogate-label"].last_error.message
    assert "nested deeper" in dead["deep-schema"].last_error.message
    assert broker.result(good).status == "ok"


def test_an_invalid_envelope_that_carries_an_id_is_filed_under_that_id(broker):
    text = json.dumps({"id": "t-42", "queue": Q, "deadline": "tomorrow",
                       "task": {"type": Q, "id": "t-42", "input": "x", "labels": ["a", "b"]}})
    raw_enqueue(broker, "t-42", Q, text)
    worker(broker).run()
    view = broker.get("t-42")
    assert view.state == "dead" and view.attempts == 1 and view.last_error.code == "invalid_task"
    assert broker.result("t-42").error.code == "invalid_task"
    assert broker.get("?") is None and broker.result("?") is None
    assert broker.outstanding([Q]) == 0  # nothing left leased for ever


def test_sqlite_a_row_whose_envelope_names_another_task_is_dead_lettered(tmp_path):
    broker = open_broker(f"sqlite://{tmp_path / 'q.db'}", tmp_path)
    text = json.dumps({"id": "someone-else", "queue": Q,
                       "task": {"type": Q, "id": "someone-else", "input": "x", "labels": ["a", "b"]}})
    raw_enqueue(broker, "row-1", Q, text)
    worker(broker).run()
    view = broker.get("row-1")
    assert view.state == "dead" and view.attempts == 1 and "someone-else" in view.last_error.message


def test_a_task_that_omits_its_own_id_gets_the_queues(broker):
    raw_enqueue(broker, "ext-1", Q, json.dumps({"id": "ext-1", "queue": Q,
                                             "task": {"type": Q, "input": "x", "labels": ["a", "b"]}}))
    worker(broker).run()
    assert broker.result("ext-1").status == "ok" and broker.result("ext-1").task_id == "ext-1"


@pytest.mark.parametrize("engine", ["sqlite", "redis"])
def test_poison_payloads_never_stop_a_worker_process(engine, request, tmp_path, isolated_env):
    """As the probe saw it: real `nodeagent worker` processes, which used to die on every claim of these."""
    if engine == "sqlite":
        url = f"sqlite://{tmp_path / 'queue.db'}"
    else:
        import redis

        server = request.getfixturevalue("redis_server")
        redis.Redis.from_url(server.url).flushall()
        url = server.url
    broker = open_broker(url, tmp_path)
    for task_id, text in poison_envelopes().items():
        raw_enqueue(broker, task_id, "extract.v1" if task_id == "deep-schema" else Q, text)
    good = Client(broker).submit(ClassifyTask(input="fine", labels=["a", "b"]))
    proc = subprocess.run([sys.executable, "-m", "nodeagent", "worker", "--model", "fake", "--broker", url,
                           "--burst", "--types", "classify,extract"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **isolated_env, **QUIET_GUARD, "NODEAGENT_HOME": str(tmp_path / "w")})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert broker.result(good).status == "ok"
    assert {v.id for v in broker.dead()} == set(poison_envelopes())


# -- the broker fails under the worker -------------------------------------------------------------------------
def test_a_sqlite_write_lock_held_past_the_busy_timeout_is_waited_out(tmp_path):
    from nodeagent.broker.sqlite import SqliteBroker

    path = tmp_path / "q.db"
    broker = SqliteBroker(path, busy_timeout_s=0.2)
    client = Client(broker)
    first = client.submit(ClassifyTask(input="before", labels=["a", "b"]))
    w = worker(broker, burst=False)
    t = threading.Thread(target=w.run)
    t.start()
    client.wait(first, timeout=10)
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # another process holds the write lock for a second: claims fail meanwhile
    time.sleep(1.0)
    assert w._state == "degraded" and not w.serving and t.is_alive()
    lock.execute("COMMIT")
    lock.close()
    later = Client(SqliteBroker(path)).submit(ClassifyTask(input="after", labels=["a", "b"]))
    assert Client(SqliteBroker(path)).wait(later, timeout=10).status == "ok"
    assert w.serving and w._state == "ready"
    w.stop()
    t.join(10)


def start_worker(url: str, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nodeagent", "worker", "--model", "fake", "--broker", url,
                             "--lease", "2", "--heartbeat", "0.5", *extra], env={**os.environ, **QUIET_GUARD, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_workers_survive_a_redis_restart_and_a_dropped_connection(tmp_path, isolated_env):
    import redis

    folder = tmp_path / "aof"
    folder.mkdir()
    server = RedisServer(folder, appendonly=True).start()
    workers = [start_worker(server.url, {**isolated_env, "NODEAGENT_HOME": str(tmp_path / f"w{i}")})
               for i in range(2)]
    try:
        client = Client(open_broker(server.url, tmp_path))
        deadline = time.time() + 60
        while sum(n.state == "ready" for n in client.broker.nodes()) < 2 and time.time() < deadline:
            time.sleep(0.1)  # both running: a busy machine may start one much later
        before = [client.submit(ClassifyTask(input=f"before {i}", labels=["a", "b"])) for i in range(5)]
        assert all(client.wait(i, timeout=60).status == "ok" for i in before)
        server.proc.send_signal(signal.SIGKILL)  # mid-claim: idle workers block on XREADGROUP all the time
        server.proc.wait(10)
        time.sleep(0.3)
        server.start()
        r = redis.Redis.from_url(server.url)
        r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")  # and every connection dropped
        client = Client(open_broker(server.url, tmp_path))
        after = [client.submit(ClassifyTask(input=f"after {i}", labels=["a", "b"])) for i in range(5)]
        assert all(client.wait(i, timeout=60).status == "ok" for i in after)
        dead = [w.communicate()[1] for w in workers if w.poll() is not None]
        assert not dead, f"a worker died with the broker: {dead}"
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        errs = [w.communicate(timeout=30)[1] for w in workers]
        server.stop()
    assert all(w.returncode == 0 for w in workers), errs
    assert not any("Traceback" in e for e in errs), errs
    # a worker that saw the broker fail says so, and says when it answers again (a blip the Redis client's own
    # retries absorb is not seen: on a loaded machine the restart can fall within them)
    noticed = [e for e in errs if "the broker failed" in e]
    assert all("answers again" in e for e in noticed), errs


# -- validation that backtracks without end ---------------------------------------------------------------------
# llguidance cannot parse the lookahead, so the pattern is left to the final validation; the fake backend writes
# 28 letters and no "!", which Python's backtracking engine takes 2^28 steps to refuse
CATASTROPHIC = {"type": "object", "required": ["code"], "additionalProperties": False,
                "properties": {"code": {"type": "string", "minLength": 28, "maxLength": 28,
                                        "pattern": "^(?=(.|.)*!$)"}}}


def test_catastrophic_pattern_stops_at_the_task_limit_and_leases_stay_renewed(tmp_path, isolated_env):
    url = f"sqlite://{tmp_path / 'queue.db'}"
    broker = open_broker(url, tmp_path)
    task_id = Client(broker).submit(ExtractTask(input="the code", schema=CATASTROPHIC))
    env = {**isolated_env, "NODEAGENT_TASK_TIMEOUT_S": "2"}
    workers = [start_worker(url, {**env, "NODEAGENT_HOME": str(tmp_path / f"w{i}")}, "--lease", "1")
               for i in range(2)]
    started = time.time()
    try:
        while broker.result(task_id) is None and time.time() - started < 60:
            time.sleep(0.05)
        took = time.time() - started
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(30)
    result = broker.result(task_id)
    view = broker.get(task_id)
    assert result.error.code == "timeout" and "validating" in result.error.message
    assert view.attempts == 1  # renewed while it validated: no second worker took it
    assert took < 2 + 1 + 5  # within the limit and one lease (and the workers' start-up)


def test_validation_releases_the_gil_for_the_lease_and_heartbeat_threads():
    from nodeagent.tasks.schema import ValidationTimeout, validate_output

    ticks = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    t = threading.Thread(target=tick)
    t.start()
    started = time.monotonic()
    with pytest.raises(ValidationTimeout):
        validate_output(CATASTROPHIC, {"code": "}" * 28}, timeout_s=1.0)
    done.set()
    t.join()
    assert time.monotonic() - started < 1.5
    assert len(ticks) > 50  # the other thread ran while the pattern was matched


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {"^(a|a)*$": {"type": "string"}}},
    {"type": "object", "patternProperties": {"^(a|a)*$": {"type": "string"}}, "additionalProperties": False},
    {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
     "patternProperties": {"^(a|a)*$": {"type": "integer"}}, "unevaluatedProperties": False},
    {"type": "object", "propertyNames": {"pattern": "^(a|a)*$"}},
])
def test_every_keyword_that_matches_a_pattern_is_bounded(schema):
    from nodeagent.tasks.schema import ValidationTimeout, validate_output

    started = time.monotonic()
    with pytest.raises(ValidationTimeout):
        validate_output(schema, {"a" * 30 + "!": "x"}, timeout_s=0.5)
    assert time.monotonic() - started < 1.0


# -- the queue's promises ---------------------------------------------------------------------------------------
def test_an_expired_lease_is_reclaimed_before_the_backlog(broker):
    client = Client(broker)
    orphan = client.submit(ClassifyTask(input="orphan", labels=["a", "b"]))
    assert broker.claim([Q], "ghost", lease_s=0.3).envelope.id == orphan
    for i in range(50):
        client.submit(ClassifyTask(input=f"backlog {i}", labels=["a", "b"]))
    time.sleep(0.4)
    again = broker.claim([Q], "n2", lease_s=0.3)  # the lease is the fleet's setting: the same for all
    assert again.envelope.id == orphan and again.attempt == 2


def test_submitting_an_existing_task_id_is_refused(broker):
    client = Client(broker)
    task = ClassifyTask(input="once", labels=["a", "b"])
    client.submit(task)
    with pytest.raises(ConflictError):
        client.submit(task)
    assert broker.get(task.id).history == [] and [s.ready for s in broker.stats() if s.queue == Q] == [1]
    # with an idempotency key the first id comes back, as always
    keyed = ClassifyTask(input="keyed", labels=["a", "b"])
    first = client.submit(keyed, idempotency_key="k")
    assert client.submit(keyed, idempotency_key="k") == first


def test_cli_refuses_an_existing_task_id_in_one_line(isolated_env):
    args = ["submit", "classify", "--labels", "a,b", "--text", "x", "--id", "fixed-1"]
    cli(args, isolated_env)
    proc = cli(args, isolated_env, check=False)
    assert proc.returncode == 15 and "already in the queue" in proc.stderr and "Traceback" not in proc.stderr


def test_redis_idempotency_keys_expire_with_their_task(redis_server, tmp_path):
    import redis

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.flushall()
    broker = open_broker(redis_server.url, tmp_path)
    client = Client(broker)
    first = client.submit(ClassifyTask(input="keyed", labels=["a", "b"]), idempotency_key="order-1")
    assert r.ttl("nodeagent:v1:idem:order-1") == -1  # no expiry while the task is in the queue
    broker.retention_s = 1
    worker(broker).run()
    assert 0 < r.ttl("nodeagent:v1:idem:order-1") <= broker.retention_s  # as long as its result is kept
    assert r.ttl("nodeagent:v1:idem:order-1") == r.ttl(f"nodeagent:v1:task:{first}")  # and its task
    time.sleep(1.2)
    assert not r.exists("nodeagent:v1:idem:order-1") and not r.exists(f"nodeagent:v1:task:{first}")
    again = client.submit(ClassifyTask(input="keyed", labels=["a", "b"]), idempotency_key="order-1")
    assert again != first and broker.get(again).state == "ready"


def test_errors_the_task_caused_do_not_count_against_the_node(broker):
    guard = Guard(GuardConfig(min_samples=3, cooldown_s=600), read=lambda: Readings(memory_pct=1, cpu_pct=0))
    client = Client(broker)
    config = resolve(env={"NODEAGENT_MAX_INPUT_BYTES": "100"})
    ids = []
    for i in range(20):
        text = "x" * 200 if i % 5 == 0 else f"fine {i}"  # every fifth is over the input limit
        ids.append(client.submit(ClassifyTask(input=text, labels=["a", "b"])))
    summary = worker(broker, guard=guard, config=config).run()
    assert summary == {"completed": 16, "failed": 4}
    assert guard.state == "ok" and guard.error_rate() == 0.0
    codes = [broker.result(i).error.code for i in ids if broker.result(i).status != "ok"]
    assert codes == ["input_too_large"] * 4


def test_node_faults_still_count(broker):
    guard = Guard(GuardConfig(min_samples=3, cooldown_s=600), read=lambda: Readings(memory_pct=1, cpu_pct=0))
    client = Client(broker)
    for i in range(4):
        client.submit(ClassifyTask(input=f"[boom] {i}", labels=["a", "b"]), max_attempts=1)
    w = worker(broker, "fake:fail=[boom]", guard=guard, burst=False)
    t = threading.Thread(target=w.run)
    t.start()
    time.sleep(1.0)
    w.stop()
    t.join(10)
    assert guard.state == "unhealthy"


def test_every_field_is_bounded_by_the_input_limit():
    node = Node("fake", config=resolve(env={"NODEAGENT_MAX_INPUT_BYTES": "300"}))
    big = "y" * 400
    cases = [ClassifyTask(input="x", labels=["a", "b"], instructions=big),
             ClassifyTask(input="x", labels=[{"name": "a", "description": big}, "b"]),
             ExtractTask(input="x", schema={"type": "object", "description": big}),
             ExtractTask(input="x", schema={"type": "object"}, examples=[{"text": big, "output": {}}])]
    for task in cases:
        r = node.run(task)
        assert r.status == "error" and r.error.code == "input_too_large", task
    assert node.run(ClassifyTask(input="x", labels=["a", "b"], instructions="short")).status == "ok"


def test_an_output_that_fails_validation_is_repaired_once_then_dead_lettered(broker):
    # `not` is left to the validator, and this one no string can meet
    schema = {"type": "object", "required": ["word"], "additionalProperties": False,
              "properties": {"word": {"type": "string", "maxLength": 8, "not": {"type": "string"}}}}
    task_id = Client(broker).submit(ExtractTask(input="a word", schema=schema))
    worker(broker).run()
    view = broker.get(task_id)
    assert view.state == "dead" and view.attempts == 1
    assert view.last_error.code == "invalid_output" and "one repair" in view.last_error.message
    assert view.last_error.retryable is False


def test_workers_sharing_a_state_directory_have_distinct_ids(tmp_path, isolated_env):
    url = f"sqlite://{tmp_path / 'queue.db'}"
    env = {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "shared")}
    workers = [start_worker(url, env) for _ in range(3)]
    broker = open_broker(url, tmp_path)
    try:
        deadline = time.time() + 60
        while len(broker.nodes()) < 3 and time.time() < deadline:
            time.sleep(0.1)
        ids = {n.id for n in broker.nodes()}
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(30)
    assert len(ids) == 3
    base = (tmp_path / "shared" / "node-id").read_text().strip()
    assert ids == {base, f"{base}-1", f"{base}-2"}
    again = start_worker(url, env, "--burst")  # a restarted worker takes the first free id again
    again.communicate(timeout=60)
    assert {n.id for n in broker.nodes()} == ids


def test_guard_pauses_for_cpu_at_most_a_while():
    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    reading = {"cpu": 99.0}
    g = Guard(GuardConfig(sample_every_s=0, cpu_pause_max_s=60), clock=clock,
              read=lambda: Readings(memory_pct=10, cpu_pct=reading["cpu"]))
    assert not g.may_claim() and g.state == "paused"
    clock.t = 59
    assert not g.may_claim()
    clock.t = 61
    assert g.may_claim() and "serving anyway" in g.reason  # not starved
    clock.t = 500
    assert g.may_claim()  # still busy: it serves on
    reading["cpu"] = 10
    assert g.may_claim()
    reading["cpu"] = 99  # a new spell of contention pauses again, for at most as long
    clock.t = 501
    assert not g.may_claim()
    reading["cpu"] = 10
    assert g.may_claim()


def test_memory_pressure_pauses_without_a_time_limit():
    clock = [0.0]
    g = Guard(GuardConfig(sample_every_s=0, cpu_pause_max_s=1), clock=lambda: clock[0],
              read=lambda: Readings(memory_pct=99, cpu_pct=0))
    for t in (0, 10, 1000):
        clock[0] = t
        assert not g.may_claim()


def test_a_value_that_would_inject_a_unit_line_is_refused(isolated_env):
    env = {**isolated_env, "NODEAGENT_ALERT_WEBHOOK": "https://example.test/hook\nExecStartPre=/bin/sh -c id"}
    proc = cli(["service", "install", "--model", "fake", "--manager", "systemd", "--dry-run"], env, check=False)
    assert proc.returncode == 2 and "control character" in proc.stderr and "Traceback" not in proc.stderr
    assert "ExecStartPre" not in proc.stdout


def test_specifiers_and_variables_are_escaped_in_units():
    from nodeagent.service.units import ServiceSpec, render_systemd

    unit = render_systemd(ServiceSpec(model="fake", argv=["/usr/bin/python3", "-m", "nodeagent", "serve", "$HOME"],
                                      env={"NODEAGENT_TOKEN": "a%b c\"d"}))
    assert 'Environment="NODEAGENT_TOKEN=a%%b c\\"d"' in unit
    assert '"$$HOME"' in unit


def test_the_thread_governor_gives_a_thread_up_per_core_other_processes_hold():
    from nodeagent.backends.threads import ThreadGovernor

    clock = [0.0]
    other = {"pct": 0.0}
    g = ThreadGovernor(4, 4, lambda: other["pct"], every_s=1.0, clock=lambda: clock[0])
    assert g() == 4
    other["pct"] = 25.0  # one core of four
    assert g() == 4  # sampled at most every second
    clock[0] = 1.0
    assert g() == 3
    other["pct"], clock[0] = 10.0, 2.0  # 0.4 of a core: not worth a thread
    assert g() == 4
    other["pct"], clock[0] = 100.0, 3.0
    assert g() == 1  # never below one


def test_threads_adapt_only_when_the_user_left_them_to_the_plan():
    assert Node("fake", config=resolve(env={})).adapt_threads
    assert not Node("fake", config=resolve(env={"NODEAGENT_THREADS": "2"})).adapt_threads
    assert not Node("fake", config=resolve(env={"NODEAGENT_THREADS_ADAPT": "0"})).adapt_threads
    # deterministic answers hold the thread count: a sum over another number of threads rounds differently
    assert not Node("fake", config=resolve(env={"NODEAGENT_DETERMINISTIC": "1"})).adapt_threads


def test_a_worker_started_before_its_broker_waits_for_it(tmp_path, isolated_env):
    folder = tmp_path / "late"
    folder.mkdir()
    server = RedisServer(folder, appendonly=True)  # its port chosen, nothing listening yet
    w = start_worker(server.url, {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "w")})
    try:
        time.sleep(2.0)
        assert w.poll() is None, w.communicate()[1]
        server.start()
        client = Client(open_broker(server.url, tmp_path))
        task_id = client.submit(ClassifyTask(input="late", labels=["a", "b"]))
        assert client.wait(task_id, timeout=60).status == "ok"
    finally:
        w.send_signal(signal.SIGTERM)
        err = w.communicate(timeout=30)[1]
        server.stop()
    assert w.returncode == 0 and "Traceback" not in err, err
