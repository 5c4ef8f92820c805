"""The broker outlives a lost reply, its primary's host and its own replicas' lag: Sentinel URLs, retries only where
a second try cannot do harm (each operation's rule in broker/redis/), and WAIT for the replicas a reported write
needs. Every Redis here is a real redis-server; a lost reply is made by a real TCP proxy that lets the command run
and closes the connection before its answer (tests/tcpproxy.py); a failover is the Sentinels' own, after a SIGKILL
of the primary (tests/redisha.py)."""

from __future__ import annotations

import json
import time

import pytest
import redis
from redisha import DataNode
from tcpproxy import LossyProxy

from nodeagent.broker.base import CONTRACT, Envelope, Result
from nodeagent.broker.open import open_broker
from nodeagent.broker.redis_link import NotReplicated
from nodeagent.errors import ConfigError, ConflictError
from nodeagent.urls import is_sentinel, masked, parse_sentinel, scheme, shown

TASK = {"type": "classify.v1", "input": "the app crashes", "labels": ["bug", "question"]}


def envelope(**fields) -> Envelope:
    return Envelope(queue="classify.v1", task=TASK, **fields)


def done(e: Envelope) -> Result:
    return Result(task_id=e.id, type="classify.v1", status="ok",
                  output={"label": "bug", "probabilities": {"bug": 0.9, "question": 0.1}})


# -- URLs ----------------------------------------------------------------------------------------------------------
def test_a_sentinel_url_names_its_sentinels_service_database_and_secrets():
    t = parse_sentinel("redis+sentinel://app:p%40ss@10.0.0.1:26379,[::1]:26380,sentinel-c/mymaster/2"
                       "?sentinel_password=s3cret")
    assert t.sentinels == (("10.0.0.1", 26379), ("::1", 26380), ("sentinel-c", 26379))
    assert (t.service, t.db, t.username, t.password, t.sentinel_password, t.tls) == \
        ("mymaster", 2, "app", "p@ss", "s3cret", False)
    tls = parse_sentinel("rediss+sentinel://h1:26379/svc?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required")
    assert tls.tls and tls.tls_options == {"ssl_ca_certs": "/etc/ca.pem", "ssl_cert_reqs": "required"}
    assert parse_sentinel("redis+sentinel://h1/svc").db == 0
    assert is_sentinel("redis+sentinel://h/s") and not is_sentinel("redis://h:6379/0")
    assert scheme("redis+sentinel://h/s") == scheme("rediss://h") == "redis" and scheme(None) == "sqlite"


@pytest.mark.parametrize("url, why", [
    ("redis+sentinel://h1:26379", "no service name"),
    ("redis+sentinel:///mymaster", "no Sentinel host"),
    ("redis+sentinel://h1:port/mymaster", "no port number"),
    ("redis+sentinel://h1:26379/mymaster/zero", "/service_name/db"),
    ("redis+sentinel://h1/mymaster?sentinal_password=x", "unknown option 'sentinal_password'"),
    ("redis+sentinel://h1/mymaster?ssl_ca_certs=/ca.pem", "need TLS"),
])
def test_a_bad_sentinel_url_is_one_line_that_names_the_form(url, why):
    with pytest.raises(ConfigError) as err:
        parse_sentinel(url)
    assert why in str(err.value) and "redis+sentinel://[user:password@]host:port" in err.value.hint


def test_an_unknown_scheme_is_refused_with_every_form_named():
    with pytest.raises(ConfigError) as err:
        scheme("sentinel://:pw@h/mymaster")
    assert "unknown broker URL" in str(err.value) and "pw" not in str(err.value)
    assert "redis+sentinel://" in err.value.hint and "rediss://" in err.value.hint


def test_passwords_are_masked_wherever_a_url_is_shown():
    url = "redis+sentinel://app:hunter22@h1:26379,h2/mymaster/0?sentinel_password=s3cret&ssl_ca_certs=/ca.pem"
    assert shown(url) == ("redis+sentinel://app:***@h1:26379,h2/mymaster/0?sentinel_password=***"
                          "&ssl_ca_certs=/ca.pem")
    assert shown("redis://:hunter22@queue-host:6379/0") == "redis://:***@queue-host:6379/0"
    assert shown("redis://queue-host:6379/0") == "redis://queue-host:6379/0"
    said = masked(f"cannot reach {url}: WRONGPASS for hunter22 (s3cret)", url)
    assert "hunter22" not in said and "s3cret" not in said and "h1:26379" in said


def test_config_show_masks_the_brokers_password(isolated_env):
    from conftest import cli

    url = "redis+sentinel://app:hunter22@s1:26379,s2/nodeagent?sentinel_password=s3cret"
    out = cli(["config", "show", "--json"], {**isolated_env, "NODEAGENT_BROKER": url}).stdout
    shown_value = json.loads(out)["settings"]["broker"]["value"]
    assert shown_value == "redis+sentinel://app:***@s1:26379,s2/nodeagent?sentinel_password=***"
    assert "hunter22" not in out and "s3cret" not in out


def test_a_client_given_a_sentinel_url_before_this_release_worked_now_opens_it(tmp_path):
    """What a new user tried (issue 43): no Sentinel answers here, and the error says so, not 'unknown broker URL'."""
    with pytest.raises(ConfigError) as err:
        open_broker("redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster/0", tmp_path)
    assert "cannot reach the Redis broker at redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster/0" in str(err.value)
    assert "no Sentinel named a primary for 'mymaster' (127.0.0.1:1: ConnectionError: Error 111" in str(err.value)


# -- a reply lost after the command ran --------------------------------------------------------------------------
@pytest.fixture
def lossy(redis_server, tmp_path):
    """A broker that reaches the test's Redis through a proxy that can lose a reply."""
    redis.Redis.from_url(redis_server.url).flushall()
    proxy = LossyProxy(redis_server.port)
    b = open_broker(f"redis://127.0.0.1:{proxy.port}/0", tmp_path)
    raw = redis.Redis.from_url(redis_server.url, decode_responses=True)
    for script in b._scripts.values():  # loaded: a lost EVALSHA reply is then one whose script ran (not NOSCRIPT)
        raw.script_load(script.script)
    yield b, proxy, raw
    b.close()
    proxy.close()


def test_an_enqueue_whose_reply_was_lost_is_one_task_and_says_its_id(lossy):
    b, proxy, raw = lossy
    e = envelope()
    proxy.lose_next_reply()
    assert b.enqueue(e) == e.id  # the retry found its own first try's task, not a conflict
    assert proxy.lost == 1 and raw.xlen("nodeagent:v1:q:classify.v1") == 1
    with pytest.raises(ConflictError):  # another enqueue of that id is still refused
        b.enqueue(e)


def test_a_claim_whose_reply_was_lost_gets_the_task_its_first_try_claimed(lossy):
    b, proxy, raw = lossy
    first, second = envelope(), envelope()
    b.enqueue(first)
    b.enqueue(second)
    proxy.lose_next_reply()
    claim = b.claim(["classify.v1"], "n1", 30)
    assert proxy.lost == 1 and claim.envelope.id == first.id and claim.attempt == 1
    assert raw.hget(f"nodeagent:v1:task:{first.id}", "attempts") == "1"  # counted once
    assert raw.hget(f"nodeagent:v1:task:{second.id}", "state") == "ready"  # not claimed behind the lost reply
    assert b.complete(claim, done(first))
    nxt = b.claim(["classify.v1"], "n1", 30)
    assert nxt.envelope.id == second.id and nxt.attempt == 1


def test_a_finish_cancel_replay_and_document_whose_replies_were_lost_are_done_once(lossy):
    b, proxy, raw = lossy
    e = envelope()
    b.enqueue(e)
    claim = b.claim(["classify.v1"], "n1", 30)
    proxy.lose_next_reply()
    b.complete(claim, done(e))
    assert proxy.lost == 1 and b.get(e.id).state == "done" and b.result(e.id).output.label == "bug"
    assert raw.get("nodeagent:v1:done:classify.v1") == "1"  # counted once

    c = envelope()
    b.enqueue(c)
    proxy.lose_next_reply()
    assert b.cancel(c.id) is True and b.get(c.id).state == "cancelled"

    d = envelope(max_attempts=1)
    b.enqueue(d)
    from nodeagent.tasks.contracts import ErrorInfo

    b.bury(b.claim(["classify.v1"], "n1", 30), ErrorInfo(code="invalid_task", message="x", retryable=False))
    proxy.lose_next_reply()
    assert b.replay(d.id) is True and b.get(d.id).state == "ready"

    proxy.lose_next_reply()
    assert b.doc_put("batch", "batch_1", {"id": "batch_1"}, body="line") is True
    assert b.doc_get("batch", "batch_1") == ({"id": "batch_1"}, 1) and b.doc_body("batch", "batch_1") == "line"
    assert raw.zcard("nodeagent:v1:docs:batch") == 1
    proxy.lose_next_reply()
    assert b.doc_put("batch", "batch_1", {"id": "batch_1", "status": "done"}, version=1) is True
    assert b.doc_get("batch", "batch_1") == ({"id": "batch_1", "status": "done"}, 2)
    assert b.doc_put("batch", "batch_1", {"id": "stale"}, version=1) is False  # a writer that read before still loses
    assert proxy.lost == 5


def test_a_progress_event_whose_reply_was_lost_leaves_a_copy_with_the_same_seq(lossy):
    """The worker numbers an attempt's progress events; the gateway drops the copy a retried write leaves."""
    b, proxy, raw = lossy
    b.open_log("t1", 60)
    proxy.lose_next_reply()
    b.publish("t1", {"kind": "piece", "attempt": 1, "seq": 1, "index": 0, "what": "content", "value": "Hi"})
    events = [json.loads(f["e"]) for _, f in raw.xrange("nodeagent:v1:log:t1")]
    pieces = [e for e in events if e["kind"] == "piece"]
    assert len(pieces) == 2 and {p["seq"] for p in pieces} == {1} and pieces[0]["contract"] == CONTRACT


def test_an_operation_is_not_retried_past_the_window_nor_for_a_wrong_password(tmp_path):
    solo = DataNode(tmp_path / "solo").start()
    b = open_broker(f"redis://127.0.0.1:{solo.port}/0", tmp_path, config=_config(broker_retry_s=0.6))
    solo.kill()
    t = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        b.stats()
    assert 0.3 <= time.monotonic() - t < 3  # retried with backoff for the window, then the caller sees it
    b.close()
    locked = DataNode(tmp_path / "locked", extra=("--requirepass", "right-one")).start()
    try:
        t = time.monotonic()
        with pytest.raises(ConfigError) as err:
            open_broker(f"redis://:wrong-one@127.0.0.1:{locked.port}/0", tmp_path)
        assert time.monotonic() - t < 2 and "wrong-one" not in str(err.value)
        assert "redis://:***@127.0.0.1" in str(err.value)
    finally:
        locked.stop()


def _config(**settings):
    from nodeagent.config import resolve

    return resolve({}, {f"NODEAGENT_{k.upper()}": str(v) for k, v in settings.items()})


def _until(test, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not test():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


# -- WAIT: a write reported done is on the replicas ---------------------------------------------------------------
def test_a_reported_write_waits_for_its_replicas_and_fails_loudly_without_them(tmp_path):
    primary = DataNode(tmp_path / "p").start()
    replica = DataNode(tmp_path / "r", replica_of=primary.port).start()
    raw = redis.Redis(port=primary.port, decode_responses=True)

    def replicas() -> int:  # online: synced, and acknowledging what it applies
        info = raw.info("replication")
        return sum(1 for i in range(int(info["connected_slaves"])) if info[f"slave{i}"]["state"] == "online")

    _until(lambda: replicas() == 1)
    b = open_broker(f"redis://127.0.0.1:{primary.port}/0", tmp_path,
                    config=_config(redis_min_replicas=1, redis_wait_timeout_s=0.3, broker_retry_s=0.5))
    try:
        e = envelope(idempotency_key="k-1")
        assert b.enqueue(e) == e.id
        assert redis.Redis(port=replica.port).exists(f"nodeagent:v1:task:{e.id}")  # there when reported
        claim = b.claim(["classify.v1"], "n1", 30)
        assert b.complete(claim, done(e))
        assert redis.Redis(port=replica.port).exists(f"nodeagent:v1:result:{e.id}")
        replica.kill()
        _until(lambda: replicas() == 0)
        late = envelope(idempotency_key="k-2")
        with pytest.raises(NotReplicated) as err:
            b.enqueue(late)
        assert "only 0 of the 1 replicas" in str(err.value) and "NODEAGENT_REDIS_MIN_REPLICAS" in err.value.hint
        assert b.get(late.id).state == "ready"  # on the primary, but never reported as enqueued
        replica.start()
        _until(lambda: replicas() == 1)
        assert b.enqueue(envelope(idempotency_key="k-2")) == late.id  # the same key, resubmitted: the same task
    finally:
        b.close()
        primary.stop()
        replica.stop()


@pytest.mark.parametrize("engine", ["redis", "valkey"])
def test_wait_confirms_a_resent_write_and_a_claim_on_redis_7_0_and_the_7_2_line(tmp_path, engine):
    """Since Redis 7.2 (and in Valkey) WAIT counts only its own connection's writes: a submit resent with its key
    after a NotReplicated writes nothing, so a bare WAIT would report it replicated though the replica never got
    it. Each confirmed write makes a write of its own (a fence) first. Claims are confirmed the same way: a claim
    is handed to its worker only once the replicas have it (one lost with a primary would let a second node run the
    task). The replica is stopped (SIGSTOP: connected, acknowledging nothing) and let go again; the resend comes on
    another connection, as from an orchestrator started again."""
    import signal
    import threading

    primary = DataNode(tmp_path / "p", engine=engine).start()
    replica = DataNode(tmp_path / "r", replica_of=primary.port, engine=engine).start()
    raw = redis.Redis(port=primary.port, decode_responses=True)
    _until(lambda: raw.info("replication").get("slave0", {}).get("state") == "online")
    b = open_broker(f"redis://127.0.0.1:{primary.port}/0", tmp_path,
                    config=_config(redis_min_replicas=1, redis_wait_timeout_s=0.3, broker_retry_s=0.5))
    try:
        replica.proc.send_signal(signal.SIGSTOP)
        late = envelope(idempotency_key="k-late")
        with pytest.raises(NotReplicated):
            b.enqueue(late)
        again = open_broker(f"redis://127.0.0.1:{primary.port}/0", tmp_path,
                            config=_config(redis_min_replicas=1, redis_wait_timeout_s=0.3, broker_retry_s=0.5))
        with pytest.raises(NotReplicated):  # resent with its key (another connection): still not on the replica
            again.enqueue(envelope(idempotency_key="k-late"))
        again.close()
        with pytest.raises(NotReplicated):  # a claim the replicas do not have is not handed out
            b.claim(["classify.v1"], "n1", 30)
        replica.proc.send_signal(signal.SIGCONT)
        assert b.enqueue(envelope(idempotency_key="k-late")) == late.id  # now on the replica: reported
        fresh = envelope()
        assert b.enqueue(fresh) == fresh.id
        b.link.retry_s = 10.0
        replica.proc.send_signal(signal.SIGSTOP)
        got: dict = {}
        start = time.monotonic()
        t = threading.Thread(target=lambda: got.setdefault("claim", b.claim(["classify.v1"], "n2", 30)))
        t.start()
        time.sleep(1.0)
        assert "claim" not in got  # held until the replica has it
        replica.proc.send_signal(signal.SIGCONT)
        t.join(15)
        claim = got["claim"]
        assert claim is not None and claim.attempt == 1 and time.monotonic() - start >= 1.0
        assert redis.Redis(port=replica.port).hget(f"nodeagent:v1:task:{claim.envelope.id}", "token") == \
            claim.token.encode()  # the replica holds this very claim
    finally:
        if replica.proc is not None:
            replica.proc.send_signal(signal.SIGCONT)
        b.close()
        primary.stop()
        replica.stop()


# -- a failover of the broker's host, with the fleet running ------------------------------------------------------
def test_a_sentinel_failover_loses_no_task_and_ends_each_once(tmp_path):
    """180 tasks at a steady rate through a `redis+sentinel://` URL, each with its own idempotency key (resubmitted
    with the same key when a submit raises), two workers; the replica lags (its link held 1 s) and then the primary is
    killed with SIGKILL a third of the way in. With NODEAGENT_REDIS_MIN_REPLICAS=1: every task ends done, once,
    within 120 s of the last submit; no key has two tasks; the workers keep running. (benchmarks/failover.py runs
    the same with 0 too, and commits what each loses.)"""
    from benchmarks.failover import scenario

    run = scenario(tmp_path, min_replicas=1, tasks=180, rate_per_s=15.0, lag_s=1.0)
    print(f"min replicas 1: submits resumed {run['resume_submit_s']} s after the kill, the first task done after "
          f"{run['resume_done_s']} s, all settled {run['settled_s']} s after the last submit")
    assert len(run["keys"]) == 180 and run["two_tasks_for_a_key"] == 0 and run["lost"] == 0, run
    assert run["done"] == run["done_counter"] == 180 and run["dead"] == 0 and not run["other"], run
    assert run["settled_s"] <= 120 and run["workers_running"] == 2
    assert run["resume_submit_s"] is not None and run["resume_done_s"] is not None


def test_the_gateway_rides_through_a_failover_and_nothing_hangs(tmp_path):
    """Six clients (three streaming) on the gateway, on a Sentinel URL, for 20 s; the primary killed a third of the
    way in. No request hangs, none fails for good, and the gateway and the workers keep running (the 2-minute run
    is benchmarks/failover.py's)."""
    from benchmarks.failover import gateway_scenario

    run = gateway_scenario(tmp_path, seconds=20, clients=6)
    print(f"the gateway across a failover: {run['ok']} ok, {run['retried']} ok after a retry, {run['failed']} "
          f"failed, {run['hung']} hung; the longest {run['longest_s']} s")
    assert run["hung"] == 0 and run["failed"] == 0 and run["requests"] >= 30, run
    assert run["gateway_running"] and run["workers_running"] == 2
    assert run["longest_s"] < 60


def test_a_sentinel_url_over_tls_checks_the_certificates(tmp_path):
    """`rediss+sentinel://`: TLS to the Sentinels and to the primary, with redis-py's own options in the query; a
    client that does not trust the CA is refused, and says so in one line."""
    from redisha import SentinelFleet, make_certs

    fleet = SentinelFleet(tmp_path / "ha", tls=make_certs(tmp_path / "certs")).start()
    try:
        b = open_broker(fleet.url, tmp_path)
        e = envelope()
        assert b.enqueue(e) == e.id and b.complete(b.claim(["classify.v1"], "n1", 30), done(e))
        assert b.settings()["sentinel"]["answered"] and b.get(e.id).state == "done"
        b.close()
        untrusted = fleet.url.split("?")[0]
        with pytest.raises(ConfigError) as err:
            open_broker(untrusted, tmp_path)
        assert "no Sentinel named a primary for 'mymaster' (127.0.0.1:" in str(err.value)
        assert "certificate verify failed" in str(err.value) and "\n" not in str(err.value)
    finally:
        fleet.stop()
