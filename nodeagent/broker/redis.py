"""The fleet broker: Redis Streams with consumer groups, and a thin layer of keys and Lua on top.

Key layout (contract version 1; ``schemas/redis-contract.md`` and ``schemas/envelope.schema.json``):

- ``nodeagent:v1:q:<queue>``           a stream per task type (``classify.v1``), consumer group ``workers``;
  ``nodeagent:v1:q:<queue>@<model>``   one per model a task is bound to. Each entry: ``envelope`` = the JSON.
- ``nodeagent:v1:task:<id>``           hash: envelope, queue, stream, entry, state, attempts, token, node,
                                       history (JSON), last_error (JSON), ready_at, updated_at.
- ``nodeagent:v1:delayed:<queue>``     sorted set of task ids by the time their retry is due.
- ``nodeagent:v1:dead:<queue>``        sorted set of dead-lettered task ids by the time they died.
- ``nodeagent:v1:result:<id>``         the Result JSON, written once (SET NX), kept for the retention period.
- ``nodeagent:v1:idem:<key>``          the task id an idempotency key was first used for.
- ``nodeagent:v1:done:<queue>``        a counter of completed tasks.
- ``nodeagent:v1:node:<id>`` and the set ``nodeagent:v1:nodes``: node records.

Claiming is ``XREADGROUP`` (new entries), then ``XAUTOCLAIM`` with min-idle = the lease (entries whose
worker stopped renewing; the lease is a fleet-wide setting, and an entry whose holder's own lease still runs
is handed back to it untouched). A renewal is ``XCLAIM ... JUSTID``, which resets the entry's idle time, done in Lua
only while the hash still names this lease's token. Completion writes the result (SET NX), then XACK and XDEL
and marks the hash, in one Lua script; so do retries (into the delayed set) and dead letters.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from nodeagent.broker.base import (
    RESULT_RETENTION_S,
    Attempt,
    Claim,
    Envelope,
    NodeRecord,
    QueueStats,
    TaskView,
    error_result,
    parse_envelope,
)
from nodeagent.errors import ConfigError, ConflictError
from nodeagent.tasks.contracts import ErrorInfo, Result

PREFIX = "nodeagent:v1:"
GROUP = "workers"

# KEYS: task hash, stream, idem key (or ""); ARGV: id, envelope json, queue, now. Returns the task's id (the
# first one's for an idempotency key already used), or {'exists'} when a task with this id is already there.
ENQUEUE = """
if KEYS[3] ~= '' then
  local first = redis.call('GET', KEYS[3])
  if first then return first end
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
if KEYS[3] ~= '' then redis.call('SET', KEYS[3], ARGV[1]) end
local entry = redis.call('XADD', KEYS[2], '*', 'envelope', ARGV[2])
redis.call('HSET', KEYS[1], 'envelope', ARGV[2], 'queue', ARGV[3], 'stream', KEYS[2], 'entry', entry,
           'state', 'ready', 'attempts', 0, 'history', '[]', 'created_at', ARGV[4], 'updated_at', ARGV[4],
           'idem', KEYS[3])
return ARGV[1]
"""

# Moves due retries of one delayed set back into their streams.
PROMOTE_FN = """
local function promote(delayed, now, prefix)
  local due = redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, 100)
  for _, id in ipairs(due) do
    local key = prefix .. 'task:' .. id
    redis.call('ZREM', delayed, id)
    if redis.call('HGET', key, 'state') == 'delayed' then
      local stream = redis.call('HGET', key, 'stream')
      local entry = redis.call('XADD', stream, '*', 'envelope', redis.call('HGET', key, 'envelope'))
      redis.call('HSET', key, 'state', 'ready', 'entry', entry, 'updated_at', now)
    end
  end
end
"""

# Claiming an entry: count the attempt, open it in the history (closing the previous one as lease_expired when
# its holder died), and stamp the lease token. Returns {status, attempts, envelope}: 'ok'; 'skip' (finished or
# cancelled: acknowledged and dropped); 'held' (reclaimed by idle time while its holder's lease still runs:
# handed back untouched).
CLAIM_ENTRY = """
local function claim_entry(key, stream, entry, envelope, queue, node, token, now, lease_until)
  local state = redis.call('HGET', key, 'state')
  if not state then
    redis.call('HSET', key, 'envelope', envelope, 'queue', queue, 'stream', stream, 'state', 'ready',
               'attempts', 0, 'history', '[]', 'created_at', now)
    state = 'ready'
  end
  if state == 'done' or state == 'dead' or state == 'cancelled' then
    redis.call('XACK', stream, 'workers', entry)
    redis.call('XDEL', stream, entry)
    return {'skip', 0, ''}
  end
  local holder = redis.call('HGET', key, 'node')
  if state == 'leased' and tonumber(redis.call('HGET', key, 'leased_until') or '0') > tonumber(now)
     and redis.call('HGET', key, 'entry') == entry and holder and holder ~= node then
    redis.call('XCLAIM', stream, 'workers', holder, 0, entry, 'JUSTID')
    return {'held', 0, ''}
  end
  local attempts = redis.call('HINCRBY', key, 'attempts', 1)
  local history = cjson.decode(redis.call('HGET', key, 'history'))
  local last = history[#history]
  if last and (last['ended_at'] == nil or last['ended_at'] == cjson.null) then
    last['ended_at'] = tonumber(now)
    last['error'] = {code='lease_expired', retryable=true,
                     message='the worker stopped renewing its lease (crashed or lost)'}
  end
  table.insert(history, {attempt=attempts, node=node, started_at=tonumber(now)})
  redis.call('HSET', key, 'state', 'leased', 'token', token, 'node', node, 'entry', entry, 'stream', stream,
             'leased_until', lease_until, 'history', cjson.encode(history), 'updated_at', now)
  return {'ok', attempts, redis.call('HGET', key, 'envelope')}
end
"""

# KEYS: task hash, stream; ARGV: entry id, envelope json, queue, node, token, now, lease_until
CLAIM = CLAIM_ENTRY + """
return claim_entry(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
"""

# Claiming an entry read from a stream: its envelope names the task (the hash it is claimed in). Returns
# {'raw', stream, entry, envelope} for an envelope that gives no id (Python parses it and claims it with CLAIM
# under a name made from the entry), else {status, attempts, envelope, stream, entry, id}.
TAKE_FN = """
local function take(stream, entry, fields, node, token, now, lease_until, prefix)
  local envelope = ''
  for i = 1, #(fields or {}), 2 do if fields[i] == 'envelope' then envelope = fields[i + 1] end end
  local ok, decoded = pcall(cjson.decode, envelope)
  local id = ok and type(decoded) == 'table' and decoded['id'] or nil
  if not ok then  -- too deep or not Unicode for cjson: the id written first, as the contract's producers do
    id = string.match(envelope, '^%s*{%s*"id"%s*:%s*"([%w%-_%.:]+)"')
  end
  if type(id) ~= 'string' or #id == 0 or #id > 200 then
    return {'raw', stream, entry, envelope}
  end
  local queue = string.match(stream, '^' .. prefix .. 'q:([^@]+)')
  local r = claim_entry(prefix .. 'task:' .. id, stream, entry, envelope, queue, node, token, now, lease_until)
  return {r[1], r[2], r[3], stream, entry, id}
end
"""

# The common case in one round trip: move due retries back into their streams, then take an entry whose lease
# expired (its worker died: reclaimed first, as on SQLite, however long the backlog of new entries), else the
# next new entry, and claim it. KEYS: the streams, then the delayed sets; ARGV: node, token, now, lease_until,
# prefix, number of streams, lease in ms. Returns {'none'} or what take returns.
CLAIM_NEXT = CLAIM_ENTRY + PROMOTE_FN + TAKE_FN + """
local n = tonumber(ARGV[6])
for i = n + 1, #KEYS do promote(KEYS[i], ARGV[3], ARGV[5]) end
for i = 1, n do
  local got = redis.call('XAUTOCLAIM', KEYS[i], 'workers', ARGV[1], ARGV[7], '0-0', 'COUNT', 1)
  local first = got[2][1]
  if first then return take(KEYS[i], first[1], first[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]) end
end
for i = 1, n do
  local got = redis.call('XREADGROUP', 'GROUP', 'workers', ARGV[1], 'COUNT', 1, 'STREAMS', KEYS[i], '>')
  if got then
    local e = got[1][2][1]
    return take(KEYS[i], e[1], e[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
  end
end
return {'none'}
"""

# An entry a blocking XREADGROUP delivered to this node. KEYS: the stream; ARGV: entry, node, token, now,
# lease_until, prefix. Returns {'none'} (the entry is gone) or what take returns.
CLAIM_READ = CLAIM_ENTRY + TAKE_FN + """
local got = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if #got == 0 then return {'none'} end
return take(KEYS[1], ARGV[1], got[1][2], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
"""

# KEYS: task hash; ARGV: token, node, lease_ms, now, leased_until. 1 when renewed, 0 when the lease is lost.
RENEW = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'state') ~= 'leased' then
  return 0
end
local stream = redis.call('HGET', KEYS[1], 'stream')
local entry = redis.call('HGET', KEYS[1], 'entry')
local got = redis.call('XCLAIM', stream, 'workers', ARGV[2], 0, entry, 'JUSTID')
if #got == 0 then return 0 end
redis.call('HSET', KEYS[1], 'leased_until', ARGV[5], 'updated_at', ARGV[4])
return 1
"""

# KEYS: task hash, result key, side key (done counter, delayed set or dead set); ARGV: token, state, attempt,
# now, error json or '', result json or '', retention s, score (ready_at or now), id.
# Writes the result once, acknowledges the entry, and moves the task to its next state.
FINISH = """
local written = 0
if ARGV[6] ~= '' then
  if redis.call('SET', KEYS[2], ARGV[6], 'NX', 'EX', ARGV[7]) then written = 1 end
end
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return written end
local stream = redis.call('HGET', KEYS[1], 'stream')
local entry = redis.call('HGET', KEYS[1], 'entry')
local owner = redis.call('HGET', KEYS[1], 'token') == ARGV[1]
if state == 'done' or state == 'dead' or state == 'cancelled' then
  if entry then redis.call('XACK', stream, 'workers', entry); redis.call('XDEL', stream, entry) end
  return written
end
if ARGV[2] == 'delayed' and not owner then return written end
local history = cjson.decode(redis.call('HGET', KEYS[1], 'history'))
for i = #history, 1, -1 do
  if history[i]['attempt'] == tonumber(ARGV[3]) then
    history[i]['ended_at'] = tonumber(ARGV[4])
    if ARGV[5] ~= '' then history[i]['error'] = cjson.decode(ARGV[5]) end
    break
  end
end
if entry then redis.call('XACK', stream, 'workers', entry); redis.call('XDEL', stream, entry) end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'token', '', 'history', cjson.encode(history), 'updated_at', ARGV[4])
redis.call('HDEL', KEYS[1], 'entry', 'leased_until')
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[5]) end
if ARGV[2] == 'done' then redis.call('INCR', KEYS[3]) end
if ARGV[2] == 'done' or ARGV[2] == 'dead' then  -- an idempotency key lasts as long as its task's result
  local idem = redis.call('HGET', KEYS[1], 'idem')
  if idem and idem ~= '' then redis.call('EXPIRE', idem, ARGV[7]) end
end
if ARGV[2] == 'delayed' then
  redis.call('HSET', KEYS[1], 'ready_at', ARGV[8])
  redis.call('ZADD', KEYS[3], ARGV[8], ARGV[9])
end
if ARGV[2] == 'dead' then redis.call('ZADD', KEYS[3], ARGV[8], ARGV[9]) end
return written
"""

# KEYS: task hash; ARGV: token, now. Gives a leased task back unrun: a new entry, the attempt uncounted.
RELEASE = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
local stream = redis.call('HGET', KEYS[1], 'stream')
local entry = redis.call('HGET', KEYS[1], 'entry')
redis.call('XACK', stream, 'workers', entry)
redis.call('XDEL', stream, entry)
local history = cjson.decode(redis.call('HGET', KEYS[1], 'history'))
table.remove(history)
local fresh = redis.call('XADD', stream, '*', 'envelope', redis.call('HGET', KEYS[1], 'envelope'))
redis.call('HSET', KEYS[1], 'state', 'ready', 'token', '', 'entry', fresh, 'history',
           #history == 0 and '[]' or cjson.encode(history), 'updated_at', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
return 1
"""

# KEYS: task hash, dead set, result key; ARGV: now, id. A dead task goes back to its stream.
REPLAY = """
if redis.call('HGET', KEYS[1], 'state') ~= 'dead' then return 0 end
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('DEL', KEYS[3])
local stream = redis.call('HGET', KEYS[1], 'stream')
local entry = redis.call('XADD', stream, '*', 'envelope', redis.call('HGET', KEYS[1], 'envelope'))
redis.call('HSET', KEYS[1], 'state', 'ready', 'attempts', 0, 'entry', entry, 'updated_at', ARGV[1])
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem and idem ~= '' then redis.call('PERSIST', idem) end
return 1
"""

# KEYS: task hash, delayed set; ARGV: now, id, retention s.
CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'ready' and state ~= 'delayed' and state ~= 'leased' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'token', '', 'updated_at', ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[2])
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem and idem ~= '' then redis.call('EXPIRE', idem, ARGV[3]) end
return 1
"""


class RedisBroker:
    blocks = True  # an idle claim waits on XREADGROUP BLOCK: a new task wakes a worker at once

    def __init__(self, url: str, retention_s: float = RESULT_RETENTION_S, check: bool = True) -> None:
        """``check``: ping the server now, so a command learns at once that it is down (a worker does not: it
        waits for the broker as it waits out any outage)."""
        import redis

        self.url = url
        self.retention_s = int(retention_s)
        try:
            # text written by hand that is not UTF-8 is read with replacement characters: it must not fail the
            # claim that reads it (the worker dead-letters what does not parse)
            self.r = redis.Redis.from_url(url, decode_responses=True, encoding_errors="replace", socket_timeout=30,
                                          socket_connect_timeout=10, health_check_interval=30)
            if check:
                self.r.ping()
        except (redis.RedisError, ValueError) as exc:
            raise ConfigError(f"cannot reach the Redis broker at {url}: {exc}",
                              hint="check NODEAGENT_BROKER and that redis-server is running") from None
        self._scripts = {name: self.r.register_script(src) for name, src in (
            ("enqueue", ENQUEUE), ("claim", CLAIM), ("claim_next", CLAIM_NEXT), ("claim_read", CLAIM_READ),
            ("renew", RENEW), ("finish", FINISH),
            ("release", RELEASE), ("replay", REPLAY), ("cancel", CANCEL))}
        self._groups: set[str] = set()

    # -- keys ------------------------------------------------------------------------------------------------
    @staticmethod
    def stream(queue: str, model: str | None = None) -> str:
        return f"{PREFIX}q:{queue}" + (f"@{model}" if model else "")

    @staticmethod
    def _task(task_id: str) -> str:
        return f"{PREFIX}task:{task_id}"

    def _group(self, stream: str) -> None:
        if stream in self._groups:
            return
        import redis

        try:  # from the start of the stream: entries an orchestrator added before any worker existed count
            self.r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups.add(stream)

    # -- tasks -----------------------------------------------------------------------------------------------
    def enqueue(self, envelope: Envelope) -> str:
        e = envelope
        stream = self.stream(e.queue, e.model)
        self._group(stream)
        idem = f"{PREFIX}idem:{e.idempotency_key}" if e.idempotency_key else ""
        got = self._scripts["enqueue"](keys=[self._task(e.id), stream, idem],
                                       args=[e.id, e.model_dump_json(), e.queue, time.time()])
        if isinstance(got, list):
            raise ConflictError(f"task {e.id} is already in the queue",
                                hint="give the task a new id, or an idempotency key to return the first")
        return str(got)

    def claim(self, queues: list[str], node: str, lease_s: float, models: list[str] | None = None,
              now: float | None = None, wait_s: float = 0.0) -> Claim | None:
        import redis

        try:
            return self._claim(queues, node, lease_s, models, now, wait_s)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._groups.clear()  # the server lost its streams (restarted without persistence): make them again
            return self._claim(queues, node, lease_s, models, now, wait_s)

    def _claim(self, queues: list[str], node: str, lease_s: float, models: list[str] | None, now: float | None,
               wait_s: float) -> Claim | None:
        now = time.time() if now is None else now
        delayed = [f"{PREFIX}delayed:{q}" for q in queues]
        streams = [self.stream(q, m) for q in queues for m in [None, *(models or [])]]
        for s in streams:
            self._group(s)
        waited = False
        for _ in range(64):  # entries of finished or cancelled tasks are skipped (and acknowledged)
            token = uuid.uuid4().hex
            got = self._scripts["claim_next"](keys=[*streams, *delayed],
                                              args=[node, token, now, now + lease_s, PREFIX, len(streams),
                                                    int(lease_s * 1000)])
            if got[0] == "none":
                if waited or wait_s <= 0:
                    return None
                waited = True  # nothing now: wait for a new entry (a due retry is promoted at the next claim)
                found = self._wait(streams, node, int(wait_s * 1000))
                if found is None:
                    return None
                now = time.time()
                got = self._scripts["claim_read"](keys=[found[0]], args=[found[1], node, token, now, now + lease_s,
                                                                          PREFIX])
                if got[0] == "none":
                    continue
            if got[0] == "raw":
                claim = self._claim_entry(got[1], got[2], {"envelope": got[3]}, node, lease_s, now)
            else:
                claim = self._made(got[0], got[1], got[2], got[3], got[5], token, node, lease_s, now)
            if claim is not None:
                return claim
        return None

    def _made(self, status: str, attempts: Any, stored: str, stream: str, task_id: str, token: str, node: str,
              lease_s: float, now: float) -> Claim | None:
        if status in ("skip", "held"):
            return None
        queue = stream.removeprefix(f"{PREFIX}q:").split("@", 1)[0]
        envelope = parse_envelope(stored, task_id, queue)
        return Claim(envelope=envelope, token=token, attempt=int(attempts), leased_until=now + lease_s, node=node)

    def _wait(self, streams: list[str], node: str, block_ms: int) -> tuple[str, str] | None:
        """(stream, entry) of a new entry of any of the streams within ``block_ms``, read into this node's
        pending list."""
        got = self.r.xreadgroup(GROUP, node, {s: ">" for s in streams}, count=1, block=block_ms)
        for stream, entries in got or []:
            for entry, _ in entries:
                return stream, entry
        return None

    def _claim_entry(self, stream: str, entry: str, fields: dict, node: str, lease_s: float,
                     now: float) -> Claim | None:
        queue = stream.removeprefix(f"{PREFIX}q:").split("@", 1)[0]
        raw = fields.get("envelope")
        envelope = parse_envelope(raw, f"entry-{entry}", queue)
        text = envelope.model_dump_json()  # normalised: the id stays the same however often it is re-queued
        token = uuid.uuid4().hex
        status, attempts, stored = self._scripts["claim"](
            keys=[self._task(envelope.id), stream], args=[entry, text, queue, node, token, now, now + lease_s])
        return self._made(status, attempts, stored or text, stream, envelope.id, token, node, lease_s, now)

    def renew(self, claim: Claim, lease_s: float, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return bool(self._scripts["renew"](keys=[self._task(claim.envelope.id)],
                                           args=[claim.token, claim.node, int(lease_s * 1000), now, now + lease_s]))

    def _finish(self, claim: Claim, state: str, side_key: str, error: ErrorInfo | None, result: Result | None,
                now: float, score: float) -> bool:
        e = claim.envelope
        return bool(self._scripts["finish"](
            keys=[self._task(e.id), f"{PREFIX}result:{e.id}", side_key],
            args=[claim.token, state, claim.attempt, now, error.model_dump_json() if error else "",
                  result.model_dump_json() if result else "", self.retention_s, score, e.id]))

    def complete(self, claim: Claim, result: Result) -> bool:
        now = time.time()
        return self._finish(claim, "done", f"{PREFIX}done:{claim.envelope.queue}", None, result, now, now)

    def retry(self, claim: Claim, error: ErrorInfo, delay_s: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._finish(claim, "delayed", f"{PREFIX}delayed:{claim.envelope.queue}", error, None, now, now + delay_s)

    def bury(self, claim: Claim, error: ErrorInfo, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._finish(claim, "dead", f"{PREFIX}dead:{claim.envelope.queue}", error,
                     error_result(claim.envelope, error, claim.attempt), now, now)

    def release(self, claim: Claim) -> None:
        self._scripts["release"](keys=[self._task(claim.envelope.id)], args=[claim.token, time.time()])

    def get(self, task_id: str) -> TaskView | None:
        h = self.r.hgetall(self._task(task_id))
        if not h:
            return None
        envelope = parse_envelope(h.get("envelope"), task_id, h.get("queue", "?"))
        return TaskView(id=task_id, queue=h.get("queue", "?"), state=h["state"], attempts=int(h.get("attempts", 0)),
                        max_attempts=envelope.max_attempts, model=envelope.model, batch=envelope.batch,
                        index=envelope.index, ready_at=_float(h.get("ready_at")),
                        leased_until=_float(h.get("leased_until")), node=h.get("node") or None,
                        history=[Attempt.model_validate(a) for a in json.loads(h.get("history") or "[]")],
                        last_error=ErrorInfo.model_validate_json(h["last_error"]) if h.get("last_error") else None,
                        result=self.result(task_id), created_at=_float(h.get("created_at")) or 0.0)

    def result(self, task_id: str) -> Result | None:
        text = self.r.get(f"{PREFIX}result:{task_id}")
        return None if text is None else Result.model_validate_json(text)

    def cancel(self, task_id: str) -> bool:
        queue = self.r.hget(self._task(task_id), "queue") or ""
        return bool(self._scripts["cancel"](keys=[self._task(task_id), f"{PREFIX}delayed:{queue}"],
                                            args=[time.time(), task_id, self.retention_s]))

    def dead(self, queue: str | None = None, limit: int = 100) -> list[TaskView]:
        keys = [f"{PREFIX}dead:{queue}"] if queue else sorted(self.r.scan_iter(f"{PREFIX}dead:*"))
        ids = [i for k in keys for i in self.r.zrange(k, 0, limit - 1)]
        return [v for i in ids[:limit] if (v := self.get(i)) is not None]

    def replay(self, task_id: str) -> bool:
        queue = self.r.hget(self._task(task_id), "queue") or ""
        return bool(self._scripts["replay"](keys=[self._task(task_id), f"{PREFIX}dead:{queue}",
                                                  f"{PREFIX}result:{task_id}"], args=[time.time(), task_id]))

    def _queues(self) -> list[str]:
        names = {k.removeprefix(f"{PREFIX}q:").split("@", 1)[0] for k in self.r.scan_iter(f"{PREFIX}q:*")}
        return sorted(names)

    def stats(self) -> list[QueueStats]:
        now = time.time()
        out = []
        for q in self._queues():
            ready = leased = 0
            for s in self.r.scan_iter(f"{PREFIX}q:{q}*"):
                if s != self.stream(q) and not s.startswith(self.stream(q) + "@"):
                    continue
                for g in self.r.xinfo_groups(s):
                    if g["name"] == GROUP:
                        leased += int(g["pending"])
                        ready += int(g["lag"]) if g.get("lag") is not None else self._undelivered(s, g)
            delayed_key = f"{PREFIX}delayed:{q}"
            due = self.r.zcount(delayed_key, "-inf", now)
            out.append(QueueStats(queue=q, ready=ready + due, leased=leased,
                                  delayed=self.r.zcard(delayed_key) - due,
                                  dead=self.r.zcard(f"{PREFIX}dead:{q}"),
                                  done=int(self.r.get(f"{PREFIX}done:{q}") or 0)))
        return out

    def _undelivered(self, stream: str, group: dict) -> int:
        last = group.get("last-delivered-id", "0-0")
        return len(self.r.xrange(stream, min=f"({last}", max="+"))

    def outstanding(self, queues: list[str], models: list[str] | None = None) -> int:
        n = sum(self.r.zcard(f"{PREFIX}delayed:{q}") for q in queues)
        for s in (self.stream(q, m) for q in queues for m in [None, *(models or [])]):
            if not self.r.exists(s):
                continue
            for g in self.r.xinfo_groups(s):
                if g["name"] == GROUP:
                    n += int(g["pending"]) + (int(g["lag"]) if g.get("lag") is not None else self._undelivered(s, g))
        return n

    # -- nodes -----------------------------------------------------------------------------------------------
    def register(self, node: NodeRecord) -> None:
        pipe = self.r.pipeline()
        pipe.set(f"{PREFIX}node:{node.id}", node.model_dump_json(), ex=self.retention_s)
        pipe.sadd(f"{PREFIX}nodes", node.id)
        pipe.execute()

    def heartbeat(self, node_id: str, fields: dict[str, Any]) -> None:
        key = f"{PREFIX}node:{node_id}"
        text = self.r.get(key)
        if text is None:
            return
        record = {**json.loads(text), **fields, "heartbeat_at": time.time()}
        self.r.set(key, json.dumps(record), ex=self.retention_s)

    def nodes(self) -> list[NodeRecord]:
        ids = sorted(self.r.smembers(f"{PREFIX}nodes"))
        texts = self.r.mget([f"{PREFIX}node:{i}" for i in ids]) if ids else []
        return [NodeRecord.model_validate_json(t) for t in texts if t]

    def purge(self, older_than_s: float = RESULT_RETENTION_S, now: float | None = None) -> int:
        """Results expire on their own (EX); dead letters and finished task hashes past retention go too."""
        cutoff = (time.time() if now is None else now) - older_than_s
        n = 0
        for key in self.r.scan_iter(f"{PREFIX}task:*"):
            state, updated, queue, idem = self.r.hmget(key, "state", "updated_at", "queue", "idem")
            if state in ("done", "dead", "cancelled") and (_float(updated) or 0) < cutoff:
                task_id = key.removeprefix(f"{PREFIX}task:")
                self.r.delete(key, f"{PREFIX}result:{task_id}", *([idem] if idem else []))
                self.r.zrem(f"{PREFIX}dead:{queue or ''}", task_id)
                n += 1
        return n

    def record_depths(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        depths = {s.queue: s.ready + s.delayed + s.leased for s in self.stats()}
        self.r.xadd(f"{PREFIX}depths", {"at": now, "depths": json.dumps(depths)}, maxlen=2000, approximate=True)

    def depth_history(self, since: float) -> list[tuple[float, dict[str, int]]]:
        entries = self.r.xrange(f"{PREFIX}depths", min=f"{int(since * 1000)}-0", max="+")
        return [(float(f["at"]), json.loads(f["depths"])) for _, f in entries]

    def close(self) -> None:
        self.r.close()


def _float(value: Any) -> float | None:
    return float(value) if value not in (None, "") else None
