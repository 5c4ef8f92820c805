"""The Redis engine's task queue: the queues' streams (``q:<queue>[@<model>]``, consumer group ``workers``), each
task's hash (``task:<id>``), its result (``result:<id>``, written once), the delayed and dead-letter sets, the
idempotency keys and the done counters (the key layout: ``broker/redis/__init__.py``); claims, finishes, cancels and
replays in Lua; and its retention, the dead-letter sets trimmed by time."""

from __future__ import annotations

import json
import uuid
from typing import Any

from nodeagent.broker.base import (
    UNPARSABLE,
    Attempt,
    Claim,
    DeadGroup,
    Demand,
    Envelope,
    QueueStats,
    TaskView,
    base_queue,
    error_result,
    kept_from,
    parse_envelope,
    routes,
)
from nodeagent.broker.redis.connection import (
    DEADSETS,
    GROUP,
    LOG_MAX_ENTRIES,
    PREFIX,
    STREAMS,
    TOLD_MAX_ENTRIES,
    RedisConnection,
    _retried,
)
from nodeagent.errors import ConflictError
from nodeagent.tasks.contracts import ErrorInfo, Result


class RedisTasks(RedisConnection):
    """The ``TaskQueue`` store on Redis."""

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

    @_retried
    def forget(self, task_id: str, after_s: float = 0.0) -> bool:
        return bool(self._scripts["forget"](keys=[self._task(task_id), f"{PREFIX}result:{task_id}",
                                                  self._log(task_id)], args=[task_id, PREFIX, after_s]))

    @_retried
    def keep(self, task_ids: list[str], since: float) -> None:
        for start in range(0, len(task_ids), 500):
            self.link.confirmed(self._scripts["keep"], [], [since, self.retention_s, PREFIX,
                                                            *task_ids[start:start + 500]])

    @_retried
    def purge_tasks(self, older_than_s: float) -> int:
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


def _float(value: Any) -> float | None:
    return float(value) if value not in (None, "") else None
