"""One suite, both engines (SQLite in WAL mode, a real Redis server): leases, reclaim, write-once results,
retries held by the broker, dead letters with history, idempotency, routing by model, cancel, replay. Redis runs
twice: Debian's 7.0, and Valkey 8 (the 7.2 line's behaviour)."""

from __future__ import annotations

import json
import time

import pytest
from conftest import engine_broker

from nodeagent.broker.base import UNPARSABLE, Envelope, NodeRecord, backoff_s
from nodeagent.config import default_of
from nodeagent.tasks.contracts import ClassifyTask, ErrorInfo, Result


@pytest.fixture(params=["sqlite", "redis", "valkey"])
def broker(request, tmp_path):
    yield from engine_broker(request, tmp_path)

Q = "classify.v1"


def envelope(text="hello", **kw) -> Envelope:
    task = ClassifyTask(input=text, labels=["a", "b"])
    return Envelope(id=task.id, queue=Q, task=task.model_dump(mode="json"), **kw)


def ok(task_id: str, attempt: int = 1) -> Result:
    from nodeagent.tasks.contracts import ClassifyOutput

    return Result(task_id=task_id, type=Q, status="ok", attempts=attempt,
                  output=ClassifyOutput(label="a", probabilities={"a": 0.9, "b": 0.1}))


ERR = ErrorInfo(code="backend_error", message="boom", retryable=True)


def test_claim_complete_and_write_once(broker):
    e = envelope()
    assert broker.enqueue(e) == e.id
    c = broker.claim([Q], "n1", lease_s=30)
    assert c is not None and c.envelope.id == e.id and c.attempt == 1
    assert broker.claim([Q], "n2", lease_s=30) is None  # leased: nobody else gets it
    assert broker.complete(c, ok(e.id)) is True
    assert broker.complete(c, ok(e.id, 2)) is False  # a redelivery finds the result and only acknowledges
    assert broker.result(e.id).attempts == 1
    view = broker.get(e.id)
    assert view.state == "done" and view.attempts == 1 and view.history[0].node == "n1"
    assert broker.outstanding([Q]) == 0


def test_idempotency_key_returns_the_first_id(broker):
    first = broker.enqueue(envelope("one", idempotency_key="k"))
    again = broker.enqueue(envelope("two", idempotency_key="k"))
    assert again == first
    assert [s.ready for s in broker.stats() if s.queue == Q] == [1]


def test_expired_lease_is_reclaimed_and_the_old_holder_is_locked_out(broker):
    e = envelope()
    broker.enqueue(e)
    first = broker.claim([Q], "dead-node", lease_s=0.3)  # the lease is the fleet's setting: the same for all
    assert broker.claim([Q], "n2", lease_s=0.3) is None
    time.sleep(0.45)
    second = broker.claim([Q], "n2", lease_s=0.3)
    assert second is not None and second.envelope.id == e.id and second.attempt == 2
    assert broker.renew(first, 30) is False  # the lease moved on
    assert broker.renew(second, 30) is True
    view = broker.get(e.id)
    assert view.history[0].error.code == "lease_expired" and view.history[1].node == "n2"
    broker.complete(second, ok(e.id, 2))
    assert broker.get(e.id).state == "done"


def test_renewal_keeps_the_lease(broker):
    e = envelope()
    broker.enqueue(e)
    c = broker.claim([Q], "n1", lease_s=0.4)
    for _ in range(4):
        time.sleep(0.15)
        assert broker.renew(c, 0.4)
    assert broker.claim([Q], "n2", lease_s=30) is None


def test_retry_is_delayed_by_the_broker(broker):
    e = envelope()
    broker.enqueue(e)
    c = broker.claim([Q], "n1", lease_s=30)
    broker.retry(c, ERR, delay_s=0.4)
    view = broker.get(e.id)
    assert view.state == "delayed" and view.last_error.code == "backend_error"
    assert [s.delayed for s in broker.stats() if s.queue == Q] == [1]
    assert broker.claim([Q], "n1", lease_s=30) is None
    time.sleep(0.5)
    again = broker.claim([Q], "n1", lease_s=30)
    assert again is not None and again.attempt == 2
    assert broker.get(e.id).history[0].error.code == "backend_error"


def test_dead_letters_keep_history_and_replay(broker):
    e = envelope(max_attempts=2)
    broker.enqueue(e)
    c = broker.claim([Q], "n1", lease_s=30)
    broker.retry(c, ERR, delay_s=0)
    c = broker.claim([Q], "n1", lease_s=30)
    broker.bury(c, ErrorInfo(code="invalid_output", message="bad", retryable=False))
    dead = broker.dead(Q)
    assert [v.id for v in dead] == [e.id]
    assert [h.error.code for h in dead[0].history] == ["backend_error", "invalid_output"]
    r = broker.result(e.id)
    assert r.status == "error" and r.error.code == "invalid_output" and r.output is None
    assert broker.replay(e.id) is True and broker.replay(e.id) is False
    assert broker.result(e.id) is None and broker.get(e.id).state == "ready"
    c = broker.claim([Q], "n1", lease_s=30)
    assert c.attempt == 1 and len(broker.get(e.id).history) == 3  # the history is kept


def test_release_gives_a_task_back_uncounted(broker):
    e = envelope()
    broker.enqueue(e)
    c = broker.claim([Q], "n1", lease_s=30)
    broker.release(c)
    again = broker.claim([Q], "n2", lease_s=30)
    assert again is not None and again.attempt == 1 and broker.get(e.id).history[-1].node == "n2"


def test_routing_by_model(broker):
    bound = envelope("bound", model="gemma-3-270m-it")
    free = envelope("free")
    broker.enqueue(bound)
    broker.enqueue(free)
    c = broker.claim([Q], "smol-node", lease_s=30, models=["smollm2-135m-instruct"])
    assert c.envelope.id == free.id
    broker.complete(c, ok(free.id))
    assert broker.claim([Q], "smol-node", lease_s=30, models=["smollm2-135m-instruct"]) is None
    assert broker.outstanding([Q], ["smollm2-135m-instruct"]) == 0  # a burst worker of that model may stop
    assert broker.outstanding([Q], ["gemma-3-270m-it"]) == 1
    c = broker.claim([Q], "gemma-node", lease_s=30, models=["gemma-3-270m-it"])
    assert c.envelope.id == bound.id


def test_routing_by_task_type(broker):
    broker.enqueue(envelope())
    assert broker.claim(["extract.v1"], "n1", lease_s=30) is None
    assert broker.claim([Q, "extract.v1"], "n1", lease_s=30) is not None


def test_cancel(broker):
    e = envelope()
    broker.enqueue(e)
    assert broker.cancel(e.id) is True
    assert broker.claim([Q], "n1", lease_s=30) is None
    assert broker.get(e.id).state == "cancelled" and broker.cancel(e.id) is False
    leased = envelope("second")
    broker.enqueue(leased)
    c = broker.claim([Q], "n1", lease_s=30)
    assert broker.cancel(leased.id) is True
    assert broker.renew(c, 30) is False  # the worker learns at its next renewal


def test_stats_and_outstanding(broker):
    for i in range(3):
        broker.enqueue(envelope(f"t{i}"))
    c = broker.claim([Q], "n1", lease_s=30)
    s = next(s for s in broker.stats() if s.queue == Q)
    assert (s.ready, s.leased, s.delayed, s.dead, s.done) == (2, 1, 0, 0, 0)
    assert broker.outstanding([Q]) == 3
    broker.complete(c, ok(c.envelope.id))
    s = next(s for s in broker.stats() if s.queue == Q)
    assert (s.ready, s.leased, s.done) == (2, 0, 1)


def test_demand_by_queue_and_model(broker):
    """What the scheduler reads: unfinished tasks per queue and bound model, retries counted under their model,
    and an enqueued count that grows with each arrival."""
    for i in range(3):
        broker.enqueue(envelope(f"g{i}", model="gemma"))
    broker.enqueue(envelope("free"))
    c = broker.claim([Q], "n1", lease_s=30, models=["gemma"])
    assert c is not None
    bound = c if c.envelope.model == "gemma" else None
    if bound is None:  # the unbound one came first: take a gemma one too
        bound = broker.claim([Q], "n1", lease_s=30, models=["gemma"])
    broker.retry(bound, ERR, delay_s=60)
    rows = {(d.queue, d.model): d for d in broker.demand()}
    g = rows[(Q, "gemma")]
    assert g.delayed == 1 and g.waiting == 3 and g.enqueued >= 3
    assert rows[(Q, None)].waiting == 1
    broker.enqueue(envelope("g-more", model="gemma"))
    assert {(d.queue, d.model): d for d in broker.demand()}[(Q, "gemma")].enqueued > g.enqueued


def test_nodes_register_and_heartbeat(broker):
    record = NodeRecord(id="n1", hostname="pi", agent_version="0", os="linux", arch="aarch64", backend="fake")
    broker.register(record)
    broker.heartbeat("n1", {"state": "ready", "in_flight": 1})
    [n] = broker.nodes()
    assert n.state == "ready" and n.in_flight == 1 and n.heartbeat_at >= record.heartbeat_at


def test_history_adds_counters_sets_gauges_and_forgets_old_minutes(broker):
    m = int(broker.now() // 60)
    broker.history_add(m, {"t|q|ok": 2, "w|q|3": 1}, keep_s=3600)
    broker.history_add(m, {"t|q|ok": 3}, keep_s=3600)  # another node's counts add up
    broker.history_set(m, {"d|q|ready": 7}, keep_s=3600)
    broker.history_set(m, {"d|q|ready": 4}, keep_s=3600)  # a gauge: the last sample wins
    broker.history_add(m - 1, {"t|q|ok": 1}, keep_s=3600)
    got = broker.history(m - 1)
    assert got[m] == {"t|q|ok": 5.0, "w|q|3": 1.0, "d|q|ready": 4.0} and got[m - 1] == {"t|q|ok": 1.0}
    assert set(broker.history(m)) == {m}


def test_the_event_log_is_newest_first_stamped_and_bounded(broker):
    from nodeagent.broker import base

    before = broker.now()
    for i in range(5):
        broker.record_event({"kind": "control", "n": i})
    got = broker.events(limit=3)
    assert [e["n"] for e in got] == [4, 3, 2] and all(e["at"] >= before - 1 for e in got)
    assert base.EVENTS_KEPT >= 100


def test_dead_letters_page_and_group_by_code(broker):
    ids = {}
    for i in range(7):
        e = envelope(f"t{i}", max_attempts=1)
        broker.enqueue(e)
        c = broker.claim([Q], "n1", lease_s=30)
        code = "invalid_output" if i % 3 else "timeout"
        broker.bury(c, ErrorInfo(code=code, message=f"m{i}", retryable=False))
        ids.setdefault(code, []).append(c.envelope.id)
    assert [(g.code, g.count) for g in broker.dead_codes()] == [("invalid_output", 4), ("timeout", 3)]
    sample = broker.dead_codes()[1].sample
    assert sample["id"] in ids["timeout"] and sample["queue"] == Q and sample["message"].startswith("m")
    pages = [broker.dead(limit=3, offset=k) for k in (0, 3, 6)]
    assert [len(p) for p in pages] == [3, 3, 1] and len({v.id for p in pages for v in p}) == 7
    assert {v.id for v in broker.dead(code="timeout")} == set(ids["timeout"])
    assert [v.id for v in broker.dead(Q, code="timeout", limit=1, offset=1)] == [broker.dead(code="timeout")[1].id]
    assert broker.replay(ids["timeout"][0])
    assert [(g.code, g.count) for g in broker.dead_codes()] == [("invalid_output", 4), ("timeout", 2)]
    assert broker.dead(code="timeout")[0].input["input"].startswith("t")  # the task as it was enqueued


def test_stats_tell_the_oldest_ready_task(broker):
    assert all(s.oldest_ready_at is None for s in broker.stats())
    before = broker.now()
    broker.enqueue(envelope("first"))
    time.sleep(0.05)
    broker.enqueue(envelope("second"))
    [s] = [s for s in broker.stats() if s.queue == Q]
    assert s.ready == 2 and before - 1 <= s.oldest_ready_at <= before + 1
    c = broker.claim([Q], "n1", lease_s=30)
    c2 = broker.claim([Q], "n1", lease_s=30)
    broker.complete(c, ok(c.envelope.id))
    broker.complete(c2, ok(c2.envelope.id))
    assert [s.oldest_ready_at for s in broker.stats() if s.queue == Q] == [None]


def test_finished_tasks_go_after_the_retention_and_nothing_is_scanned(broker):
    """Done, dead and cancelled tasks, their results, keys and dead-letter entries are gone once the retention has
    passed: on Redis each expires as it is written (the purge only trims the dead-letter indexes, from their
    registry); on SQLite the purge finds them through an index by time."""
    redis_engine = broker.url.startswith("redis")
    if redis_engine:
        broker.retention_s = 1
    done, dead, cancelled, waiting = (envelope(idempotency_key=f"k-{i}") for i in range(4))
    for e in (done, dead, cancelled, waiting):
        broker.enqueue(e)
    broker.complete(broker.claim([Q], "n1", lease_s=30), ok(done.id))
    broker.bury(broker.claim([Q], "n1", lease_s=30), ErrorInfo(code="invalid_output", message="x", retryable=False))
    broker.cancel(cancelled.id)
    assert broker.purge(older_than_s=3600) == 0 and broker.get(done.id).state == "done"
    time.sleep(1.3)
    broker.purge(older_than_s=1)
    for e in (done, dead, cancelled):
        assert broker.get(e.id) is None and broker.result(e.id) is None
    assert broker.get(waiting.id).state == "ready"  # what is not finished is kept, whatever its age
    assert not broker.dead() and not broker.dead_codes()
    assert [s.dead for s in broker.stats() if s.queue == Q] == [0]
    fresh = broker.enqueue(envelope(idempotency_key="k-0"))
    assert fresh != done.id  # its key went with it
    if redis_engine:
        import redis

        r = redis.Redis.from_url(broker.url, decode_responses=True)
        left = {k for k in r.keys("nodeagent:v1:*") if k.split(":")[2] in ("task", "result", "idem")}
        assert left == {f"nodeagent:v1:task:{waiting.id}", f"nodeagent:v1:task:{fresh}", "nodeagent:v1:idem:k-0",
                        "nodeagent:v1:idem:k-3"}, left


def test_backoff_is_full_jitter_with_a_cap():
    import random

    rng = random.Random(1)
    for attempt in range(1, 12):
        values = [backoff_s(attempt, default_of("retry_base_s"), default_of("retry_cap_s"), rng=rng) for _ in range(200)]
        bound = min(300.0, 2 ** attempt)
        assert all(0 <= v <= bound for v in values) and max(values) > 0.8 * bound


def test_malformed_payload_claims_as_unparsable(broker, tmp_path):
    """Written by hand (sqlite3 / redis-cli): the claim still yields an envelope that says so."""
    if broker.url.startswith("sqlite"):
        import sqlite3

        db = sqlite3.connect(broker.path)
        db.execute("INSERT INTO tasks (id, queue, envelope, state, max_attempts, ready_at, created_at, updated_at) "
                   "VALUES ('raw1', ?, '{not json', 'ready', 4, 0, 0, 0)", (Q,))
        db.commit()
        db.close()
    else:
        import redis

        r = redis.Redis.from_url(broker.url)
        r.xgroup_create(f"nodeagent:v1:q:{Q}", "workers", id="0", mkstream=True)
        r.xadd(f"nodeagent:v1:q:{Q}", {"envelope": "{not json"})
    c = broker.claim([Q], "n1", lease_s=30)
    assert UNPARSABLE in c.envelope.task and "{not json" in json.dumps(c.envelope.task)


def test_documents_are_written_over_the_version_read(broker):
    """The Batch API's store: a new document once, a write over a stale version refused, newest first by pages."""
    assert broker.doc_put("file", "f1", {"id": "f1", "n": 1}, body="line\n")
    assert not broker.doc_put("file", "f1", {"id": "f1", "n": 99})  # it exists
    data, version = broker.doc_get("file", "f1")
    assert data == {"id": "f1", "n": 1} and broker.doc_body("file", "f1") == "line\n"
    assert broker.doc_put("file", "f1", {"id": "f1", "n": 2}, version=version)
    assert not broker.doc_put("file", "f1", {"id": "f1", "n": 3}, version=version)  # another writer won
    assert broker.doc_get("file", "f1") == ({"id": "f1", "n": 2}, version + 1)
    assert broker.doc_body("file", "f1") == "line\n"  # a write of the data keeps the body
    for i in range(2, 6):
        broker.doc_put("file", f"f{i}", {"id": f"f{i}"})
    first = broker.doc_list("file", limit=2)
    assert [d["id"] for d in first] == ["f5", "f4"]
    assert [d["id"] for d in broker.doc_list("file", after="f4", limit=10)] == ["f3", "f2", "f1"]
    assert broker.doc_list("batch") == [] and broker.doc_get("batch", "f1") is None
    assert broker.doc_delete("file", "f3") and not broker.doc_delete("file", "f3")
    assert [d["id"] for d in broker.doc_list("file", limit=10)] == ["f5", "f4", "f2", "f1"]


def test_bulk_states_and_results(broker):
    ids = [broker.enqueue(envelope(f"t{i}")) for i in range(3)]
    claim = broker.claim([Q], "n1", 30)
    broker.complete(claim, ok(claim.envelope.id))
    states = broker.states(ids + ["nope"])
    assert states[claim.envelope.id] == "done" and sorted(states.values()) == ["done", "ready", "ready"]
    assert list(broker.results(ids + ["nope"])) == [claim.envelope.id]


def test_an_event_log_records_a_tasks_progress_and_how_it_ended(broker):
    """A gateway opens a task's log before it is enqueued; the worker appends to it; the broker adds how the task
    ended, in the step that ends it. A task without a log writes none."""
    e = envelope()
    broker.open_log(e.id, ttl_s=60)
    broker.enqueue(e)
    c = broker.claim([Q], "n1", lease_s=30)
    broker.publish(e.id, {"kind": "started", "attempt": c.attempt, "node": "n1"})
    broker.retry(c, ErrorInfo(code="backend_error", message="once", retryable=True), delay_s=0)
    again = broker.claim([Q], "n2", lease_s=30)
    broker.complete(again, ok(e.id))
    got = broker.read_logs({e.id: "0"})
    kinds = [(ev["kind"], ev.get("state"), ev.get("attempt")) for _, _, ev in got]
    assert kinds == [("queued", None, None), ("started", None, 1), ("finished", "delayed", 1),
                     ("finished", "done", 2)]
    assert broker.read_logs({e.id: got[-1][1]}) == []  # nothing after the last cursor
    other = envelope()
    broker.enqueue(other)
    broker.publish(other.id, {"kind": "started"})
    assert broker.read_logs({other.id: "0"}) == []
    cancelled = envelope()
    broker.open_log(cancelled.id, ttl_s=60)
    broker.enqueue(cancelled)
    broker.cancel(cancelled.id)
    assert [ev["kind"] for _, _, ev in broker.read_logs({cancelled.id: "0"})] == ["queued", "cancelled"]


def test_only_the_claim_holding_a_task_finishes_it(broker):
    """An attempt cut off past its lease (its node stalled, another claim took the task) and back later writes
    nothing: the result, its usage and a stored response are the holder's. Nor does it bury a task another runs."""
    e = envelope()
    broker.enqueue(e)
    zombie = broker.claim([Q], "n1", lease_s=0.3)
    time.sleep(0.45)
    holder = broker.claim([Q], "n2", lease_s=0.3)  # the lease is the fleet's setting: the same for all
    assert holder.envelope.id == e.id and holder.attempt == 2
    assert broker.complete(zombie, ok(e.id, 1)) is False and broker.result(e.id) is None
    broker.bury(zombie, ErrorInfo(code="invalid_output", message="late", retryable=False))
    assert broker.get(e.id).state == "leased" and not broker.dead()
    assert broker.complete(holder, ok(e.id, 2)) is True and broker.result(e.id).attempts == 2
    # a lease that ran out with nobody taking the task over is still its claim's to finish
    late = envelope()
    broker.enqueue(late)
    slow = broker.claim([Q], "n1", lease_s=0.2)
    time.sleep(0.3)
    assert broker.complete(slow, ok(late.id)) is True and broker.get(late.id).state == "done"


def test_a_task_that_sets_a_newer_field_is_routed_to_the_nodes_that_read_it(broker):
    """A task whose fields need a later contract minor than its type (here extract's prompt, 1.2) is queued on its
    route: a node of this version reads it; a node of an older one (it claims the plain queue only) never gets it,
    and the queue's counts are one queue's."""
    from nodeagent.tasks.contracts import ExtractTask

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    newer = Envelope.of(ExtractTask(input="x", schema=schema, prompt="none"))
    plain = Envelope.of(ExtractTask(input="y", schema=schema))
    assert (newer.needs, newer.route, plain.needs, plain.route) == ("1.2", "extract.v1~1.2", None, "extract.v1")
    broker.enqueue(newer)
    broker.enqueue(plain)
    [s] = [s for s in broker.stats() if s.queue == "extract.v1"]
    assert s.ready == 2 and [d.ready for d in broker.demand() if d.queue == "extract.v1"] == [2]
    if broker.url.startswith("sqlite"):  # an older node's claim: the plain queue's rows only
        rows = broker._db().execute("SELECT id FROM tasks WHERE queue IN ('extract.v1')").fetchall()
    else:
        rows = broker.r.xrange("nodeagent:v1:q:extract.v1")
    assert len(rows) == 1
    got = {broker.claim(["extract.v1"], "n1", lease_s=30).envelope.id for _ in range(2)}
    assert got == {newer.id, plain.id} and broker.get(newer.id).queue == "extract.v1"


@pytest.fixture(params=["redis", "valkey"])
def redis_broker(request, tmp_path):
    yield from engine_broker(request, tmp_path)


def test_a_dead_letter_landing_while_its_set_is_trimmed_stays_registered(redis_broker):
    """A purge trims a dead-letter set and unregisters it once empty while dead letters keep landing in it (from
    another connection, as another worker's would): every set that holds letters afterwards is still in the registry
    the failures page and the next purge read (before, a letter landing between the trim and the unregister was
    left in a set no one trimmed or listed again). (SQLite keeps dead letters as rows of one table: no registry.)"""
    import threading

    import redis as redis_py

    from nodeagent.broker.open import open_broker
    from nodeagent.broker.redis import DEADSETS

    broker = redis_broker
    other = open_broker(broker.url, None)
    stop = threading.Event()

    def burying() -> None:
        while not stop.is_set():
            other.enqueue(envelope(max_attempts=1))
            claim = other.claim([Q], "w", 30)
            other.bury(claim, ERR)

    t = threading.Thread(target=burying)
    t.start()
    try:
        end = time.time() + 3
        while time.time() < end:
            broker.purge(older_than_s=0)
    finally:
        stop.set()
        t.join(10)
    r = redis_py.Redis.from_url(broker.url, decode_responses=True)
    sets = [k for k in r.scan_iter("nodeagent:v1:dead*") if k != DEADSETS]
    holding = {k for k in sets if r.type(k) == "zset" and r.zcard(k)}
    assert holding and holding <= r.smembers(DEADSETS), (holding, r.smembers(DEADSETS))
    other.close()


def test_a_deleted_value_of_a_bounded_collection_frees_its_room(broker):
    """Stored responses are kept within a bound of values and bytes, the oldest going first: a deleted one leaves
    the bound with it, so the live ones are not evicted early (on Redis a deleted value still counted until it was
    the oldest: deleting the newest two of three, then storing two, evicted the one live value)."""
    bound = (3, 1 << 20)
    for i in range(3):
        broker.kv_put(f"response:r{i}", f"value {i}", 60 + i, bound=bound)
    broker.kv_delete("response:r1")
    broker.kv_delete("response:r2")
    for i in range(3, 5):
        broker.kv_put(f"response:r{i}", f"value {i}", 60 + i, bound=bound)
    assert [broker.kv_get(f"response:r{i}") for i in range(5)] == ["value 0", None, None, "value 3", "value 4"]
    broker.kv_put("response:r5", "value 5", 65, bound=bound)  # the bound still holds: the oldest live one goes
    assert [broker.kv_get(f"response:r{i}") for i in (0, 3, 4, 5)] == [None, "value 3", "value 4", "value 5"]
