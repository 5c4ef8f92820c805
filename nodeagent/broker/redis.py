"""The fleet broker: Redis Streams with consumer groups, and a thin layer of keys and Lua on top.

Key layout (contract version 1; ``schemas/redis-contract.md`` and ``schemas/envelope.schema.json``):

- ``nodeagent:v1:q:<queue>``           a stream per task type (``classify.v1``), consumer group ``workers``;
  ``nodeagent:v1:q:<queue>@<model>``   one per model a task is bound to. Each entry: ``envelope`` = the JSON.
- ``nodeagent:v1:task:<id>``           hash: envelope, queue, stream, entry, state, attempts, token, node,
                                       history (JSON), last_error (JSON), ready_at, updated_at.
- ``nodeagent:v1:delayed:<queue>``     sorted set of task ids by the time their retry is due.
- ``nodeagent:v1:dead:<queue>``        sorted set of dead-lettered task ids by the time they died;
  ``nodeagent:v1:deadby:<code>``       the same, by the error code they died with (the failures page's groups).
- ``nodeagent:v1:result:<id>``         the Result JSON, written once (SET NX), kept for the retention period.
- ``nodeagent:v1:idem:<key>``          the task id an idempotency key was first used for.
- ``nodeagent:v1:done:<queue>``        a counter of completed tasks.
- ``nodeagent:v1:log:<id>``             stream: a task's event log, for a gateway waiting on it (opened with a TTL;
                                       entries ``e`` = the event's JSON).
- ``nodeagent:v1:hist:<minute>``       hash: the fleet's history of that minute (``fleet/history.py``), numbers by
                                       field, kept NODEAGENT_HISTORY_DAYS (a TTL).
- ``nodeagent:v1:events``              stream: the fleet's event log (placements, evictions, operators' actions),
                                       capped at about EVENTS_KEPT entries; ``e`` = the event's JSON.
- ``nodeagent:v1:node:<id>``            hash: record (the NodeRecord's JSON), started_at and heartbeat_at (the
                                       server's time); the set ``nodeagent:v1:nodes`` lists the ids.

Time: every script takes "now" from the server (``TIME``): leases, claims, renewals, retries and their promotion,
completions, heartbeats. Python code reads the server's time through ``BrokerClock`` (``now()``), for what it
compares (due retries in the stats, the documents' leases, deadlines). No client's clock is ever compared.

Claiming is ``XAUTOCLAIM`` with min-idle = the lease (entries whose worker stopped renewing, first; the lease
is a fleet-wide setting, and an entry whose holder's own lease still runs is handed back to it untouched),
then ``XREADGROUP`` (new entries). The Lua scripts are the files of ``broker/lua/``. A renewal is ``XCLAIM ...
JUSTID``, which resets the entry's idle time, done in Lua only while the hash still names this lease's token.
Completion writes the result (SET NX), then XACK and XDEL and marks the hash, in one Lua script; so do retries
(into the delayed set) and dead letters.

Failover (``broker/redis_link.py``): the connection is to a standalone server or to the primary the Sentinels name,
and each operation is retried through a blip or a failover only where a second try cannot do harm:

- reads, renewals, heartbeats, registrations, event-log reads and purges repeat harmlessly: retried as they are;
- a finish (complete, retry, dead letter) writes the result once (SET NX) and moves only a task still in hand: a
  second try after a first that landed only acknowledges; a release checks its lease token;
- an enqueue whose first try may have landed finds the task there with its own envelope, and returns its id (an
  idempotency key returns the first id anyway); a cancel, a replay and a document's write or removal that find
  their own change done say so;
- a claim is retried with the same lease token: the claim scripts first look for a claim that token made (a
  marker kept for one lease), so a retry gets the task its first try claimed instead of a second;
- a progress event is retried: its ``seq`` lets a reader drop the copy;
- not retried: the blocking read that waits for a new task (an entry it delivered but whose reply was lost is
  claimed by any node once it has been idle a lease, with no attempt counted), the fleet's history counters
  (``HINCRBYFLOAT``: a second try would count twice; a lost minute's count is the cost) and the fleet's event log
  (an ``XADD``).

With NODEAGENT_REDIS_MIN_REPLICAS at 1 or more, every write the fleet reports as done (an enqueue, a finish, a
dead letter, a cancel, a replay, a batch's documents) is followed by ``WAIT`` on its connection, and fewer
replicas than asked is an error, never a silent success.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import Any, BinaryIO

from nodeagent.broker.base import (
    CONTRACT,
    EVENTS_KEPT,
    UNPARSABLE,
    Attempt,
    Claim,
    DeadGroup,
    Demand,
    Envelope,
    NodeRecord,
    QueueStats,
    TaskView,
    base_queue,
    error_result,
    kept_from,
    parse_envelope,
    routes,
)
from nodeagent.broker.redis_link import Link
from nodeagent.clock import BrokerClock
from nodeagent.errors import ConflictError
from nodeagent.tasks.contracts import ErrorInfo, Result
from nodeagent.tasks.events import Queued
from nodeagent.urls import shown

log = logging.getLogger(__name__)
PREFIX = "nodeagent:v1:"
GROUP = "workers"

# Each script is a file of nodeagent/broker/lua/, read once; a script that calls shared functions gets those
# files first (claim_entry, promote, take are functions, not scripts).
SCRIPTS = {"enqueue": (), "claim": ("claimed", "claim_entry"),
           "claim_next": ("claimed", "claim_entry", "promote", "take"),
           "claim_read": ("claimed", "claim_entry", "take"),
           "renew": (), "finish": (), "release": (), "replay": (), "cancel": (), "register": (), "heartbeat": (),
           "append": (), "doc_put": (), "kv_keep": (), "keep": (), "trim_dead": (), "forget": (), "kv_drop": ()}
LOG_MAX_ENTRIES = 100_000  # a task's event log: a long answer's pieces, capped
# a log told how many tasks end (a gateway's): its reader trims what it read; this caps one whose reader fell far
# behind or died (a reader that finds an event gone reads the task's state itself)
TOLD_MAX_ENTRIES = 10_000
DEADSETS = f"{PREFIX}deadsets"  # the registry of dead-letter sets (by queue, by code): trimmed by time, never scanned
STREAMS = f"{PREFIX}streams"  # the registry of the queues' streams (each enqueue and each reader adds its own)


@functools.lru_cache(maxsize=1)
def _sources() -> dict[str, str]:
    """Every script's source (read once per process): the contract version its events carry, its functions, then its
    own file."""
    from importlib.resources import files

    folder = files("nodeagent.broker") / "lua"
    head = f"local CONTRACT = '{CONTRACT}'\n"
    return {name: head + "".join((folder / f"{part}.lua").read_text() for part in ("now", *parts, name))
            for name, parts in SCRIPTS.items()}


def _retried(method):  # type: ignore[no-untyped-def]
    """An operation retried as it is through a blip or a failover (a read, or a write that repeats harmlessly)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.link.call(method.__name__, lambda _retry: method(self, *args, **kwargs))
    return run


class RedisBroker:
    blocks = True  # an idle claim waits on XREADGROUP BLOCK: a new task wakes a worker at once

    def __init__(self, url: str, retention_s: float, check: bool = True, retry_s: float = 30.0,
                 min_replicas: int = 0, wait_timeout_s: float = 1.0) -> None:
        """``check``: ping the server now, so a command learns at once that it is down (a worker does not: it
        waits for the broker as it waits out any outage). ``retry_s``: how long an operation is retried through a
        blip or a failover; ``min_replicas``, ``wait_timeout_s``: the replicas a reported write waits for, and how
        long (see the module's docstring)."""
        self.url = url
        self.retention_s = int(retention_s)
        self.link = Link(url, retry_s=retry_s, min_replicas=min_replicas, wait_timeout_s=wait_timeout_s, check=check)
        self.r = self.link.r
        self._scripts = {name: self.r.register_script(source) for name, source in _sources().items()}
        self._groups: set[str] = set()
        self.clock = BrokerClock(self._server_time)

    # -- time ------------------------------------------------------------------------------------------------
    @_retried
    def _server_time(self) -> float:
        seconds, micros = self.r.time()
        return seconds + micros / 1e6

    def now(self) -> float:
        """The server's time (cached: one TIME now and then, the local monotonic clock in between)."""
        return self.clock.now()

    # -- keys ------------------------------------------------------------------------------------------------
    @staticmethod
    def stream(queue: str, model: str | None = None) -> str:
        return f"{PREFIX}q:{queue}" + (f"@{model}" if model else "")

    @staticmethod
    def _task(task_id: str) -> str:
        return f"{PREFIX}task:{task_id}"

    @staticmethod
    def _log(task_id: str) -> str:
        return f"{PREFIX}log:{task_id}"

    def _group(self, stream: str) -> None:
        if stream in self._groups:
            return
        import redis

        # from the start of the stream: entries an orchestrator added before any worker existed count (and a retried
        # operation's XGROUP CREATE repeats harmlessly)
        try:
            self.r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self.r.sadd(STREAMS, stream)
        self._groups.add(stream)

    # -- tasks -----------------------------------------------------------------------------------------------
    def enqueue(self, envelope: Envelope) -> str:
        e = envelope
        stream = self.stream(e.route, e.model)
        text = e.model_dump_json()

        def put(retried: bool) -> str:
            self._group(stream)
            got = self.link.confirmed(self._scripts["enqueue"],
                                      [self._task(e.id), stream, f"{PREFIX}idem:{e.idempotency_key or ''}"],
                                      [e.id, text, e.queue, e.notify or "", "1" if e.idempotency_key else ""])
            if isinstance(got, list):
                if retried and got[1] == text:  # this enqueue's own first try landed before its reply was lost
                    return e.id
                raise ConflictError(f"task {e.id} is already in the queue",
                                    hint="give the task a new id, or an idempotency key to return the first")
            return str(got)

        return self.link.call("enqueue", put)

    def claim(self, queues: list[str], node: str, lease_s: float, models: list[str] | None = None,
              wait_s: float = 0.0) -> Claim | None:
        import redis

        try:
            return self._claim(queues, node, lease_s, models, wait_s)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # the server lost its streams (restarted without persistence, or a new primary that never had them)
            self._groups.clear()
            return self._claim(queues, node, lease_s, models, wait_s)

    def _claim(self, queues: list[str], node: str, lease_s: float, models: list[str] | None,
               wait_s: float) -> Claim | None:
        delayed = [f"{PREFIX}delayed:{q}" for q in queues]
        streams = [self.stream(q, m) for q in routes(queues) for m in [None, *(models or [])]]
        for s in streams:
            self._group(s)
        waited = False
        for _ in range(64):  # entries of finished or cancelled tasks are skipped (and acknowledged)
            token = uuid.uuid4().hex  # a retry presents the same token, and gets what the first try claimed
            got = self.link.call("claim", lambda _retry: self._claimed(self._scripts["claim_next"](
                keys=[*streams, *delayed], args=[node, token, lease_s, PREFIX, len(streams), int(lease_s * 1000)])))
            if got[0] == "none":
                if waited or wait_s <= 0:
                    return None
                waited = True  # nothing now: wait for a new entry (a due retry is promoted at the next claim)
                found = self._wait(streams, node, int(wait_s * 1000))
                if found is None:
                    return None
                got = self.link.call("claim", lambda _retry: self._claimed(self._scripts["claim_read"](
                    keys=[found[0]], args=[found[1], node, token, lease_s, PREFIX])))
                if got[0] == "none":
                    continue
            if got[0] == "raw":
                claim = self._claim_entry(got[1], got[2], {"envelope": got[3]}, node, lease_s)
            else:
                claim = self._made(got[0], got[1], got[2], got[3], got[5], token, node, lease_s)
            if claim is not None:
                return claim
        return None

    def _claimed(self, got: Any) -> Any:
        """A claim script's answer, once a claim it made is on the replicas NODEAGENT_REDIS_MIN_REPLICAS asks for
        (a claim lost with a primary would let a second node run the task): retried with the same token, which
        finds the same claim, until it is."""
        if got and got[0] == "ok":
            self.link.settle()
        return got

    def _made(self, status: str, attempts: Any, stored: str, stream: str, task_id: str, token: str, node: str,
              lease_s: float) -> Claim | None:
        if status in ("skip", "held"):
            return None
        queue = stream.removeprefix(f"{PREFIX}q:").split("@", 1)[0]
        envelope = parse_envelope(stored, task_id, queue)
        return Claim(envelope=envelope, token=token, attempt=int(attempts), leased_until=self.now() + lease_s,
                     node=node)

    def _wait(self, streams: list[str], node: str, block_ms: int) -> tuple[str, str] | None:
        """(stream, entry) of a new entry of any of the streams within ``block_ms``, read into this node's
        pending list."""
        got = self.r.xreadgroup(GROUP, node, {s: ">" for s in streams}, count=1, block=block_ms)
        for stream, entries in got or []:
            for entry, _ in entries:
                return stream, entry
        return None

    def _claim_entry(self, stream: str, entry: str, fields: dict, node: str, lease_s: float) -> Claim | None:
        queue = stream.removeprefix(f"{PREFIX}q:").split("@", 1)[0]
        raw = fields.get("envelope")
        envelope = parse_envelope(raw, f"entry-{entry}", queue)
        text = envelope.model_dump_json()  # normalised: the id stays the same however often it is re-queued
        token = uuid.uuid4().hex
        status, attempts, stored = self.link.call("claim", lambda _retry: self._claimed(self._scripts["claim"](
            keys=[self._task(envelope.id), stream], args=[entry, text, queue, node, token, lease_s, PREFIX])))
        return self._made(status, attempts, stored or text, stream, envelope.id, token, node, lease_s)

    @_retried
    def renew(self, claim: Claim, lease_s: float) -> bool:
        """(Confirmed on the replicas when asked: a renewal lost with a primary would let the lease run out early.)"""
        return bool(self.link.confirmed(self._scripts["renew"], [self._task(claim.envelope.id)],
                                        [claim.token, claim.node, int(lease_s * 1000), lease_s]))

    def _finish(self, claim: Claim, state: str, side_key: str, error: ErrorInfo | None, result: Result | None,
                delay_s: float = 0.0) -> bool:
        e = claim.envelope
        keys = [self._task(e.id), f"{PREFIX}result:{e.id}", side_key, self._log(e.notify or e.id),
                self._dead_by(error.code if error else ""), DEADSETS]
        args = [claim.token, state, claim.attempt, delay_s, error.model_dump_json() if error else "",
                result.model_dump_json() if result else "", self.retention_s, e.id,
                TOLD_MAX_ENTRIES if e.notify else LOG_MAX_ENTRIES, kept_from(e) or ""]
        # a second try after a first that landed: the task finished, so it is only acknowledged again
        return int(self.link.call(state, lambda _retry: self.link.confirmed(self._scripts["finish"], keys, args))) == 2

    def complete(self, claim: Claim, result: Result) -> bool:
        """Whether this call wrote the result (only the claim holding the task finishes it)."""
        return self._finish(claim, "done", f"{PREFIX}done:{claim.envelope.queue}", None, result)

    def retry(self, claim: Claim, error: ErrorInfo, delay_s: float) -> None:
        self._finish(claim, "delayed", f"{PREFIX}delayed:{claim.envelope.queue}", error, None, delay_s)

    def bury(self, claim: Claim, error: ErrorInfo) -> None:
        self._finish(claim, "dead", f"{PREFIX}dead:{claim.envelope.queue}", error,
                     error_result(claim.envelope, error, claim.attempt))

    @_retried
    def release(self, claim: Claim, delay_s: float = 0.0) -> None:
        e = claim.envelope
        self._scripts["release"](keys=[self._task(e.id), f"{PREFIX}delayed:{e.queue}"],
                                 args=[claim.token, delay_s, e.id])

    @_retried
    def get(self, task_id: str) -> TaskView | None:
        h = self.r.hgetall(self._task(task_id))
        if not h:
            return None
        queue = base_queue(h.get("queue", "?"))
        envelope = parse_envelope(h.get("envelope"), task_id, queue)
        return TaskView(id=task_id, queue=queue, state=h["state"], attempts=int(h.get("attempts", 0)),
                        max_attempts=envelope.max_attempts, model=envelope.model, batch=envelope.batch,
                        index=envelope.index, ready_at=_float(h.get("ready_at")),
                        leased_until=_float(h.get("leased_until")), node=h.get("node") or None,
                        history=[Attempt.model_validate(a) for a in json.loads(h.get("history") or "[]")],
                        last_error=ErrorInfo.model_validate_json(h["last_error"]) if h.get("last_error") else None,
                        result=self.result(task_id), created_at=_float(h.get("created_at")) or 0.0,
                        input=None if UNPARSABLE in envelope.task else envelope.task)

    @_retried
    def result(self, task_id: str) -> Result | None:
        text = self.r.get(f"{PREFIX}result:{task_id}")
        return None if text is None else Result.model_validate_json(text)

    def cancel(self, task_id: str, free_key: bool = False) -> bool:
        def once(retried: bool) -> bool:
            queue = base_queue(self.r.hget(self._task(task_id), "queue") or "")
            done = self.link.confirmed(self._scripts["cancel"], [self._task(task_id), f"{PREFIX}delayed:{queue}",
                                                                 self._log(task_id)],
                                       [task_id, self.retention_s, f"{PREFIX}log:", "1" if free_key else "",
                                        TOLD_MAX_ENTRIES])
            # a retry finds the task cancelled by its own first try
            return bool(done) or (retried and self.r.hget(self._task(task_id), "state") == "cancelled")

        return self.link.call("cancel", once)

    @_retried
    def dead(self, queue: str | None = None, limit: int = 100, offset: int = 0, code: str | None = None
             ) -> list[TaskView]:
        if code or queue:  # one sorted set holds them in order: a page of it
            key = self._dead_by(code) if code else f"{PREFIX}dead:{queue}"
            if not (code and queue):
                return self._views(self.r.zrange(key, offset, offset + limit - 1))
            views = self._views(self.r.zrange(key, 0, -1))
            return [v for v in views if v.queue == queue][offset:offset + limit]
        # every queue's: the first offset + limit of each set, merged by the time they died
        scored = [(score, i) for k in self._dead_sets("dead:")
                  for i, score in self.r.zrange(k, 0, offset + limit - 1, withscores=True)]
        return self._views([i for _, i in sorted(scored)[offset:offset + limit]])

    def _views(self, ids: list[str]) -> list[TaskView]:
        return [v for i in ids if (v := self.get(i)) is not None]

    @_retried
    def dead_codes(self) -> list[DeadGroup]:
        keys = self._dead_sets("deadby:")
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.zcard(k)
            pipe.zrange(k, -1, -1)
        got = pipe.execute()
        out = []
        for k, n, newest in zip(keys, got[::2], got[1::2]):
            sample: dict[str, Any] = {}
            if newest:
                queue, error = self.r.hmget(self._task(newest[0]), "queue", "last_error")
                message = json.loads(error).get("message", "") if error else ""
                sample = {"id": newest[0], "queue": queue or "?", "message": message[:300]}
            out.append(DeadGroup(code=k.removeprefix(f"{PREFIX}deadby:"), count=int(n), sample=sample))
        return sorted((g for g in out if g.count), key=lambda g: (-g.count, g.code))

    def _dead_sets(self, kind: str) -> list[str]:
        """The dead-letter sets of one kind (``dead:`` by queue, ``deadby:`` by code), from their registry."""
        return sorted(k for k in self.r.smembers(DEADSETS) if k.startswith(PREFIX + kind))

    def _streams(self) -> list[str]:
        """Every queue's streams, from their registry (a stream is registered by its first enqueue or reader)."""
        return sorted(self.r.smembers(STREAMS))

    def _dead_by(self, code: str) -> str:
        return f"{PREFIX}deadby:{code or 'unknown'}"

    def _code_of(self, task_id: str) -> str:
        error = self.r.hget(self._task(task_id), "last_error")
        try:
            return json.loads(error).get("code", "") if error else ""
        except ValueError:
            return ""

    def replay(self, task_id: str) -> bool:
        def once(retried: bool) -> bool:
            queue = base_queue(self.r.hget(self._task(task_id), "queue") or "")
            done = self.link.confirmed(self._scripts["replay"], [self._task(task_id), f"{PREFIX}dead:{queue}",
                                                                 f"{PREFIX}result:{task_id}",
                                                                 self._dead_by(self._code_of(task_id))], [task_id])
            # a retry finds the task back in its queue, replayed by its own first try
            return bool(done) or (retried and self.r.hget(self._task(task_id), "state") in ("ready", "leased"))

        return self.link.call("replay", once)

    def _queues(self) -> list[str]:
        return sorted({base_queue(k.removeprefix(f"{PREFIX}q:").split("@", 1)[0]) for k in self._streams()})

    @_retried
    def stats(self) -> list[QueueStats]:
        now = self.now()
        out = []
        streams = self._streams()
        for q in self._queues():
            ready = leased = 0
            oldest: list[float] = []
            for s in streams:
                if base_queue(s.removeprefix(f"{PREFIX}q:").split("@", 1)[0]) != q:
                    continue
                pending, waiting = self._group_counts(s)
                leased += pending
                ready += waiting
                if waiting:
                    oldest += self._first_waiting(s)
            delayed_key = f"{PREFIX}delayed:{q}"
            due = self.r.zcount(delayed_key, "-inf", now)
            oldest += [score for _, score in self.r.zrangebyscore(delayed_key, "-inf", now, start=0, num=1,
                                                                   withscores=True)]
            out.append(QueueStats(queue=q, ready=ready + due, leased=leased,
                                  delayed=self.r.zcard(delayed_key) - due,
                                  dead=self.r.zcard(f"{PREFIX}dead:{q}"),
                                  done=int(self.r.get(f"{PREFIX}done:{q}") or 0),
                                  oldest_ready_at=min(oldest) if oldest else None))
        return out

    def _first_waiting(self, stream: str) -> list[float]:
        """When the stream's first entry not yet delivered was added (its id is the server's time in ms)."""
        for g in self.r.xinfo_groups(stream):
            if g["name"] == GROUP:
                got = self.r.xrange(stream, min=f"({g.get('last-delivered-id', '0-0')}", max="+", count=1)
                return [int(got[0][0].split("-")[0]) / 1000] if got else []
        return []

    @_retried
    def demand(self) -> list[Demand]:
        now = self.now()
        rows: dict[tuple[str, str | None], dict[str, int]] = {}
        for s in self._streams():
            route, _, model = s.removeprefix(f"{PREFIX}q:").partition("@")
            leased, ready = self._group_counts(s)
            try:
                added = int(self.r.xinfo_stream(s).get("entries-added") or 0)
            except Exception:  # noqa: BLE001  (Redis before 7.0 has no entries-added: the rate is then unknown)
                added = 0
            row = rows.setdefault((base_queue(route), model or None),
                                  {"ready": 0, "leased": 0, "delayed": 0, "enqueued": 0})
            for k, v in (("ready", ready), ("leased", leased), ("enqueued", added)):
                row[k] += v
        for q in {q for q, _ in rows}:  # a delayed retry's model is its stream's
            ids = self.r.zrange(f"{PREFIX}delayed:{q}", 0, 9999, withscores=True)
            pipe = self.r.pipeline(transaction=False)
            for task_id, _ in ids:
                pipe.hget(self._task(task_id), "stream")
            for (task_id, due), stream in zip(ids, pipe.execute()):
                model = (stream or "").partition("@")[2] or None
                row = rows.setdefault((q, model), {"ready": 0, "leased": 0, "delayed": 0, "enqueued": 0})
                row["ready" if due <= now else "delayed"] += 1
        return [Demand(queue=q, model=m, **v) for (q, m), v in sorted(rows.items(), key=lambda kv: (kv[0][0],
                                                                                                   kv[0][1] or ""))]

    def _undelivered(self, stream: str, group: dict) -> int:
        last = group.get("last-delivered-id", "0-0")
        return len(self.r.xrange(stream, min=f"({last}", max="+"))

    @_retried
    def outstanding(self, queues: list[str], models: list[str] | None = None) -> int:
        n = sum(self.r.zcard(f"{PREFIX}delayed:{q}") for q in queues)
        for s in (self.stream(q, m) for q in routes(queues) for m in [None, *(models or [])]):
            if self.r.exists(s):
                n += sum(self._group_counts(s))
        return n

    def _group_counts(self, stream: str) -> tuple[int, int]:
        """(leased, not yet delivered) entries of a stream, from the workers' consumer group."""
        for g in self.r.xinfo_groups(stream):
            if g["name"] == GROUP:
                return int(g["pending"]), int(g["lag"]) if g.get("lag") is not None else self._undelivered(stream, g)
        return 0, 0

    # -- event logs (a gateway waiting on its tasks) ----------------------------------------------------------
    @_retried
    def open_log(self, task_id: str, ttl_s: float) -> None:
        pipe = self.r.pipeline()
        pipe.xadd(self._log(task_id), {"e": json.dumps({**Queued().to_wire(), "contract": CONTRACT})})
        pipe.expire(self._log(task_id), max(1, int(ttl_s)))
        pipe.execute()

    @_retried
    def publish(self, task_id: str, event: dict[str, Any], keep: int = LOG_MAX_ENTRIES) -> None:
        """(Retried: a progress event's ``seq`` lets its reader drop a second copy.)"""
        self._scripts["append"](keys=[self._log(task_id)], args=[json.dumps({**event, "contract": CONTRACT}), keep])

    @_retried
    def read_logs(self, cursors: dict[str, str], wait_s: float = 0.0) -> list[tuple[str, str, dict[str, Any]]]:
        if not cursors:
            return []
        streams = {self._log(t): c for t, c in cursors.items()}
        got = self.r.xread(streams, count=1000, block=int(wait_s * 1000) if wait_s > 0 else None)
        out = []
        for key, entries in got or []:
            task_id = key.removeprefix(f"{PREFIX}log:")
            out += [(task_id, entry, json.loads(fields["e"])) for entry, fields in entries]
        return out

    @_retried
    def trim_log(self, task_id: str, cursor: str) -> None:
        ms, _, seq = cursor.partition("-")
        self.r.xtrim(self._log(task_id), minid=f"{ms}-{int(seq or 0) + 1}", approximate=False)

    # -- nodes -----------------------------------------------------------------------------------------------
    @_retried
    def register(self, node: NodeRecord) -> float:
        """The node's record; its start and heartbeat stamped on the server's clock (returned)."""
        return float(self._scripts["register"](keys=[f"{PREFIX}node:{node.id}", f"{PREFIX}nodes"],
                                               args=[node.id, node.model_dump_json(), self.retention_s]))

    @_retried
    def heartbeat(self, node_id: str, fields: dict[str, Any]) -> float | None:
        """The record refreshed with ``fields`` and its heartbeat stamped on the server's clock (returned; None
        for a node that is not registered)."""
        key = f"{PREFIX}node:{node_id}"
        text = self.r.hget(key, "record") if self.r.type(key) == "hash" else None
        if text is None:
            return None
        got = self._scripts["heartbeat"](keys=[key, f"{PREFIX}nodes"],
                                         args=[json.dumps({**json.loads(text), **fields}), self.retention_s, node_id])
        return float(got) if got else None

    @_retried
    def nodes(self) -> list[NodeRecord]:
        ids = sorted(self.r.smembers(f"{PREFIX}nodes"))
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hmget(f"{PREFIX}node:{i}", ["record", "started_at", "heartbeat_at"])
        out = []
        gone = []
        for node_id, got in zip(ids, pipe.execute(raise_on_error=False)):
            if isinstance(got, list) and not any(got):
                gone.append(node_id)  # its record expired (a node not heard from for the retention): unlisted
            if isinstance(got, Exception) or not got or got[0] is None:
                continue  # gone (expired), or an older version's record: it registers again when it starts
            try:
                record = NodeRecord.model_validate_json(got[0])
            except ValueError as exc:  # one unreadable record (another version's, hand-edited) hides only itself
                log.warning("a node record could not be read, left out: %s", str(exc).splitlines()[0])
                continue
            out.append(record.model_copy(update={"started_at": float(got[1] or record.started_at),
                                                 "heartbeat_at": float(got[2] or record.heartbeat_at)}))
        if gone:
            self.r.srem(f"{PREFIX}nodes", *gone)
        return out

    @_retried
    def forget(self, task_id: str) -> bool:
        return bool(self._scripts["forget"](keys=[self._task(task_id), f"{PREFIX}result:{task_id}",
                                                  self._log(task_id)], args=[task_id, PREFIX]))

    @_retried
    def keep(self, task_ids: list[str], since: float) -> None:
        for start in range(0, len(task_ids), 500):
            self.link.confirmed(self._scripts["keep"], [], [since, self.retention_s, PREFIX,
                                                            *task_ids[start:start + 500]])

    @_retried
    def purge(self, older_than_s: float) -> int:
        """What expiry leaves: a finished task's hash, its result and its idempotency key expire on their own
        (written with the retention), so only the dead-letter sets are trimmed here, by time, from their registry
        (a bury trims its own two as it writes): no key is scanned. A set is unregistered in the step that empties
        it (``trim_dead.lua``), never while a dead letter lands in it. Returns the ids dropped from them."""
        cutoff = self.now() - older_than_s
        n = 0
        for key in self.r.smembers(DEADSETS):
            n += int(self.r.zcount(key, "-inf", f"({cutoff}"))
            self._scripts["trim_dead"](keys=[key, DEADSETS], args=[cutoff])
        return n

    def history_add(self, minute: int, counts: dict[str, float], keep_s: float) -> None:
        key = f"{PREFIX}hist:{minute}"
        pipe = self.r.pipeline()
        for field, n in counts.items():
            pipe.hincrbyfloat(key, field, n)
        pipe.expire(key, int(keep_s) + 120)
        pipe.execute()

    @_retried
    def history_set(self, minute: int, values: dict[str, float], keep_s: float) -> None:
        if not values:
            return
        key = f"{PREFIX}hist:{minute}"
        pipe = self.r.pipeline()
        pipe.hset(key, mapping=values)
        pipe.expire(key, int(keep_s) + 120)
        pipe.execute()

    @_retried
    def history(self, first_minute: int, kinds: tuple[str, ...] | None = None) -> dict[int, dict[str, float]]:
        last = int(self.now() // 60)
        minutes = list(range(first_minute, last + 1))
        pipe = self.r.pipeline(transaction=False)
        for m in minutes:
            pipe.hgetall(f"{PREFIX}hist:{m}")
        out = {}
        for m, row in zip(minutes, pipe.execute()):
            kept = {k: float(v) for k, v in row.items() if not kinds or k[:1] in kinds}
            if kept:
                out[m] = kept
        return out

    def record_event(self, event: dict[str, Any]) -> None:
        self.r.xadd(f"{PREFIX}events", {"e": json.dumps({**event, "at": self.now(), "contract": CONTRACT})},
                    maxlen=EVENTS_KEPT, approximate=True)

    @_retried
    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        return [json.loads(f["e"]) for _, f in self.r.xrevrange(f"{PREFIX}events", count=limit)]

    # -- bulk reads (a batch's progress and its output) ---------------------------------------------------
    @_retried
    def states(self, task_ids: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for i in range(0, len(task_ids), 500):
            chunk = task_ids[i:i + 500]
            pipe = self.r.pipeline(transaction=False)
            for task_id in chunk:
                pipe.hget(self._task(task_id), "state")
            out.update({t: state for t, state in zip(chunk, pipe.execute()) if state})
        return out

    @_retried
    def results(self, task_ids: list[str]) -> dict[str, Result]:
        out: dict[str, Result] = {}
        for i in range(0, len(task_ids), 500):
            chunk = task_ids[i:i + 500]
            texts = self.r.mget([f"{PREFIX}result:{t}" for t in chunk])
            out.update({t: Result.model_validate_json(x) for t, x in zip(chunk, texts) if x is not None})
        return out

    # -- documents (the Batch API's files and batches): doc:<kind>:<id> (data, version, body), listed newest
    # first by the sorted set docs:<kind> --------------------------------------------------------------------
    def doc_put(self, kind: str, doc_id: str, data: dict[str, Any], body: str | bytes | BinaryIO | None = None,
                version: int | None = None) -> bool:
        if body is not None and not isinstance(body, (str, bytes)):  # a file: read once (a hash holds it whole)
            body.seek(0)
            body = body.read()
        key = f"{PREFIX}doc:{kind}:{doc_id}"
        text = json.dumps(data)

        def once(retried: bool) -> bool:
            written = self.link.confirmed(self._scripts["doc_put"], [key, f"{PREFIX}docs:{kind}", f"{PREFIX}docseq"],
                                          [doc_id, text, "" if version is None else version, body or "",
                                           "1" if body is not None and version is None else ""])
            if written or not retried:
                return bool(written)
            # a retry that finds its own first try's write there
            now = self.r.hmget(key, ["data", "version"])
            return now[0] == text and now[1] == str((version or 0) + 1)

        return self.link.call("doc_put", once)

    @_retried
    def doc_get(self, kind: str, doc_id: str) -> tuple[dict[str, Any], int] | None:
        data, version = self.r.hmget(f"{PREFIX}doc:{kind}:{doc_id}", ["data", "version"])
        return None if data is None else (json.loads(data), int(version))

    @_retried
    def doc_body(self, kind: str, doc_id: str) -> str | None:
        return self.r.hget(f"{PREFIX}doc:{kind}:{doc_id}", "body")

    @_retried
    def doc_list(self, kind: str, after: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        index = f"{PREFIX}docs:{kind}"
        top = "+inf"
        if after:
            score = self.r.zscore(index, after)
            if score is None:
                return []
            top = f"({score}"
        ids = self.r.zrevrangebyscore(index, top, "-inf", start=0, num=limit)
        texts = [self.r.hget(f"{PREFIX}doc:{kind}:{i}", "data") for i in ids]
        gone = [i for i, t in zip(ids, texts) if t is None]
        if gone:  # expired: the index forgets them as it meets them
            self.r.zrem(index, *gone)
        return [json.loads(t) for t in texts if t is not None]

    @_retried
    def doc_expire(self, kind: str, doc_id: str, at: float) -> None:
        self.r.expireat(f"{PREFIX}doc:{kind}:{doc_id}", max(1, int(at)))
        self._trim_index(kind)

    def _trim_index(self, kind: str, most: int = 10) -> None:
        """The oldest entries of a kind's index whose documents expired, dropped (a few at each expiry set: the
        index stays as long as what is kept)."""
        index = f"{PREFIX}docs:{kind}"
        for i in self.r.zrange(index, 0, most - 1):
            if self.r.exists(f"{PREFIX}doc:{kind}:{i}"):
                break
            self.r.zrem(index, i)

    def doc_delete(self, kind: str, doc_id: str) -> bool:
        def once(retried: bool) -> bool:
            pipe = self.r.pipeline()
            pipe.delete(f"{PREFIX}doc:{kind}:{doc_id}")
            pipe.zrem(f"{PREFIX}docs:{kind}", doc_id)
            got = pipe.execute()
            self.link.settle()  # on the replicas asked for (a fence, then WAIT)
            return bool(got[0]) or retried  # a retry: its first try removed it

        return self.link.call("doc_delete", once)

    # -- small values with an expiry: kv:<key> ------------------------------------------------------------------
    @_retried
    def kv_put(self, key: str, value: str, ttl_s: float, bound: tuple[int, int] | None = None) -> None:
        """(Retried: a second write of the same value repeats harmlessly.) A bounded collection keeps an index of
        its keys by expiry and their sizes (``kvindex:<collection>``, ``kvsize:<collection>``), trimmed as it is
        written (``lua/kv_keep.lua``)."""
        ttl = max(1, int(ttl_s))
        if bound is None:
            self.r.set(f"{PREFIX}kv:{key}", value, ex=ttl)
            return
        collection = key.split(":", 1)[0]
        self._scripts["kv_keep"](keys=[f"{PREFIX}kv:{key}", f"{PREFIX}kvindex:{collection}",
                                       f"{PREFIX}kvsize:{collection}", f"{PREFIX}kvbytes:{collection}"],
                                 args=[value, ttl, bound[0], bound[1], key, f"{PREFIX}kv:"])

    @_retried
    def kv_get(self, key: str) -> str | None:
        return self.r.get(f"{PREFIX}kv:{key}")

    @_retried
    def kv_delete(self, key: str) -> None:
        """(A value of a bounded collection leaves its index and its bytes with it: ``lua/kv_drop.lua``.)"""
        collection = key.split(":", 1)[0]
        self._scripts["kv_drop"](keys=[f"{PREFIX}kv:{key}", f"{PREFIX}kvindex:{collection}",
                                       f"{PREFIX}kvsize:{collection}", f"{PREFIX}kvbytes:{collection}"], args=[key])

    # -- the broker's own settings (the doctor's, and a starting worker's) ------------------------------------
    @_retried
    def settings(self) -> dict[str, Any]:
        import redis

        info: dict[str, Any] = {}
        for section in ("server", "persistence", "memory", "replication"):
            try:
                info.update(self.r.info(section))
            except redis.ResponseError:  # INFO renamed away or refused to this user: what it says stays unknown
                pass
        config: dict[str, Any] = {}
        for name in ("appendfsync", "save"):
            try:
                config.update(self.r.config_get(name))
            except redis.ResponseError:  # CONFIG is often refused on managed servers
                pass
        keys = ("redis_version", "role", "maxmemory_policy", "maxmemory", "aof_enabled", "aof_last_write_status",
                "rdb_last_save_time", "rdb_changes_since_last_save", "rdb_last_bgsave_status", "connected_slaves",
                "used_memory")
        return {"engine": "redis", "url": shown(self.url), "now": self._server_time(),
                **{k: info[k] for k in keys if k in info},
                **{k: v for k, v in config.items() if k in ("appendfsync", "save")},
                "min_replicas": self.link.min_replicas, "sentinel": self.link.sentinel_view(),
                **({"task_bytes": each} if (each := self._task_bytes()) else {})}

    def _task_bytes(self, samples: int = 12) -> int | None:
        """What one finished task keeps in memory (its hash, its result, its idempotency key: MEMORY USAGE), the mean
        over a few found at random (RANDOMKEY; none: None). For the doctor's sizing, not the fleet's work."""
        import redis

        found: set[str] = set()
        try:
            for _ in range(samples * 20):
                key = self.r.randomkey()
                if key is None:
                    break
                if key.startswith(f"{PREFIX}task:") and self.r.hget(key, "state") in ("done", "dead"):
                    found.add(key)
                    if len(found) >= samples:
                        break
            sizes = []
            for key in found:
                idem = self.r.hget(key, "idem")
                parts = [key, f"{PREFIX}result:{key.removeprefix(PREFIX + 'task:')}", *([idem] if idem else [])]
                sizes.append(sum(int(self.r.memory_usage(k, samples=0) or 0) for k in parts))
        except redis.ResponseError:  # MEMORY refused to this user
            return None
        return int(sum(sizes) / len(sizes)) if sizes else None

    def hurry(self) -> None:
        self.link.hurry()

    def close(self) -> None:
        self.link.close()


def _float(value: Any) -> float | None:
    return float(value) if value not in (None, "") else None
