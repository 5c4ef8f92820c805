"""What the broker's own settings mean for the queue: ``advise(settings)`` turns what a broker reports of itself
(``Broker.settings()``) into findings, each ok, warn or fail with the fix. `nodeagent doctor` shows them; a worker
logs the warnings and failures once at start. Pure: the reading is the broker's, the judgement is here.

Redis: the eviction policy (anything but ``noeviction`` drops queued tasks, results and idempotency keys without an
error under memory pressure), persistence (the append-only file, or a crash loses everything since the last
snapshot), the server's role and version, the replicas NODEAGENT_REDIS_MIN_REPLICAS needs, and for a Sentinel URL
the Sentinels and the replicas a failover could promote. SQLite: WAL, and the free disk beside the queue.
"""

from __future__ import annotations

from typing import Any, Literal

from nodeagent.units import GIB, MIB
from nodeagent.values import Frozen

DISK_WARN_BYTES = 2 * GIB  # below this much free disk beside the SQLite queue: a warning
DISK_FAIL_BYTES = 256 * MIB  # below this: a failure (a full disk fails every write)
MIN_REDIS = (6, 2)  # XAUTOCLAIM
CONF = "redis.conf (and at once with redis-cli CONFIG SET ..., then CONFIG REWRITE)"


class Finding(Frozen):
    name: str
    status: Literal["ok", "warn", "fail"]
    detail: str
    fix: str | None = None


def advise(settings: dict[str, Any]) -> list[Finding]:
    """The findings for a broker's settings (``Broker.settings()``)."""
    if settings.get("engine") == "sqlite":
        return [_journal(settings), _disk(settings)]
    return [f for f in (_role(settings), _eviction(settings), _memory(settings), _persistence(settings),
                        _replicas(settings), _sentinels(settings)) if f is not None]


def _memory(s: dict[str, Any]) -> Finding | None:
    """Whether Redis's memory holds what the fleet keeps at its rate: every finished task (its hash, its result, its
    key) for the result retention, and the stored responses at their bound (NODEAGENT_RESPONSES_MAX_BYTES); the rest
    is bounded by count (streams, logs, history, events). ``rate_per_s``, ``retention_s``: the fleet's finished
    tasks a second (the last hour's) and the retention, which the doctor adds; ``task_bytes``: a finished task's
    keys, measured on the server."""
    used, rate, keep, each = (s.get(k) for k in ("used_memory", "rate_per_s", "retention_s", "task_bytes"))
    if used is None or rate is None or keep is None:
        return None  # a starting worker's reading: the doctor sizes it
    limit = int(s.get("maxmemory") or 0)
    kept = float(rate) * float(keep)
    responses = int(s.get("responses_max_bytes") or 0)
    need = int(used) + int(kept * float(each or 0)) + responses if each else None
    said = (f"{int(used) // MIB} MiB used; {float(rate):.2f} tasks/s over the last hour, each kept "
            f"{float(keep) / 86400:g} days (NODEAGENT_RESULT_RETENTION_S): about {kept:,.0f} finished tasks at once")
    if need is None:
        return Finding(name="broker memory", status="ok",
                       detail=said + "; no finished task is kept now to measure one by")
    said += (f" of {int(each):,} bytes each (measured), and stored responses up to {responses // MIB} MiB "
             f"(NODEAGENT_RESPONSES_MAX_BYTES): at most about {need // MIB} MiB when it levels off")
    if not limit:
        return Finding(name="broker memory", status="warn", detail=said + "; no maxmemory set",
                       fix=f"set maxmemory to at least {need * 5 // 4 // MIB} MiB in {CONF}, or lower "
                           "NODEAGENT_RESULT_RETENTION_S")
    if need > limit:
        return Finding(name="broker memory", status="fail",
                       detail=said + f", over maxmemory {limit // MIB} MiB: Redis will refuse writes (noeviction)",
                       fix=f"raise maxmemory to at least {need * 5 // 4 // MIB} MiB, or lower "
                           "NODEAGENT_RESULT_RETENTION_S")
    status = "warn" if need > limit * 0.8 else "ok"
    return Finding(name="broker memory", status=status, detail=said + f", of maxmemory {limit // MIB} MiB",
                   fix="raise maxmemory or lower NODEAGENT_RESULT_RETENTION_S" if status == "warn" else None)


def _role(s: dict[str, Any]) -> Finding:
    version = str(s.get("redis_version") or "")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts and parts < MIN_REDIS:
        return Finding(name="broker server", status="fail",
                       detail=f"Redis {version} lacks XAUTOCLAIM: nodeagent needs Redis 6.2 or later (or Valkey)",
                       fix="upgrade redis-server (Debian 12 ships 7.0)")
    if s.get("role") not in (None, "master"):
        return Finding(name="broker server", status="fail",
                       detail=f"the broker URL reaches a {s.get('role')}, not the primary: every write fails "
                              "(READONLY)", fix="point NODEAGENT_BROKER at the primary, or at the Sentinels "
                                                "(redis+sentinel://...)")
    return Finding(name="broker server", status="ok",
                   detail=f"Redis {version or '?'}, the primary" + (" (found through the Sentinels)"
                                                                   if s.get("sentinel") else ""))


def _eviction(s: dict[str, Any]) -> Finding:
    policy = s.get("maxmemory_policy")
    if policy is None:
        return Finding(name="broker eviction", status="warn",
                       detail="maxmemory-policy could not be read (INFO refused to this user)",
                       fix="check that the server runs with maxmemory-policy noeviction")
    if policy != "noeviction":
        return Finding(name="broker eviction", status="fail",
                       detail=f"maxmemory-policy is {policy}: under memory pressure Redis evicts queued tasks, results "
                              "and idempotency keys without an error",
                       fix=f"set maxmemory-policy noeviction in {CONF}")
    limit = int(s.get("maxmemory") or 0)
    return Finding(name="broker eviction", status="ok",
                   detail="maxmemory-policy noeviction: a full Redis refuses writes, which producers see" +
                          (f" (maxmemory {limit // MIB} MiB)" if limit else " (no maxmemory: the host's memory)"))


def _persistence(s: dict[str, Any]) -> Finding:
    if "aof_enabled" not in s:
        return Finding(name="broker persistence", status="warn", detail="persistence could not be read",
                       fix="check that the server runs with appendonly yes")
    if int(s["aof_enabled"]):
        fsync = s.get("appendfsync")
        if s.get("aof_last_write_status", "ok") != "ok":
            return Finding(name="broker persistence", status="fail",
                           detail="the append-only file's last write failed: Redis refuses writes until it works",
                           fix="free disk space on the Redis host, and read its log")
        if fsync == "no":
            return Finding(name="broker persistence", status="warn",
                           detail="appendonly yes with appendfsync no: the OS flushes when it likes, and a power cut "
                                  "loses up to ~30 s of writes", fix=f"set appendfsync everysec in {CONF}")
        return Finding(name="broker persistence", status="ok",
                       detail=f"appendonly yes, appendfsync {fsync or '?'}: a crash loses at most "
                              f"{'no write' if fsync == 'always' else 'the last second of writes'}")
    last = s.get("rdb_last_save_time")
    snapshots = s.get("save")
    if snapshots or (snapshots is None and last):
        age = f"{max(0.0, float(s['now']) - float(last)):.0f} s ago" if last and s.get("now") else "at an unknown time"
        detail = (f"appendonly no: only RDB snapshots ({snapshots or '?'}); the last save was {age} with "
                  f"{s.get('rdb_changes_since_last_save', '?')} writes since, which a crash of the Redis host loses")
    else:
        detail = "appendonly no and no RDB snapshots: a restart of Redis loses the whole queue"
    return Finding(name="broker persistence", status="fail", detail=detail,
                   fix=f"set appendonly yes and appendfsync everysec in {CONF}")


def _replicas(s: dict[str, Any]) -> Finding | None:
    want = int(s.get("min_replicas") or 0)
    have = s.get("connected_slaves")
    if want <= 0:
        if s.get("sentinel"):
            return None  # the Sentinels' finding says what a failover could promote
        return Finding(name="broker replicas", status="ok",
                       detail=f"{have if have is not None else '?'} replicas; NODEAGENT_REDIS_MIN_REPLICAS 0: a write "
                              "is done when the primary has it (a failover can lose the last ones)")
    if have is None:
        return Finding(name="broker replicas", status="warn", detail="the replicas could not be read",
                       fix=f"check that {want} replicas are connected to the primary")
    if int(have) < want:
        return Finding(name="broker replicas", status="fail",
                       detail=f"NODEAGENT_REDIS_MIN_REPLICAS is {want} but the primary has {have} replicas connected: "
                              "every write the fleet reports as done fails",
                       fix=f"start {want - int(have)} more replica(s) (replicaof <primary> 6379), or lower "
                           "NODEAGENT_REDIS_MIN_REPLICAS")
    return Finding(name="broker replicas", status="ok",
                   detail=f"{have} replicas connected; each reported write waits for {want} (WAIT)")


def _sentinels(s: dict[str, Any]) -> Finding | None:
    view = s.get("sentinel")
    if not view:
        return None
    answered, total = view.get("answered", []), int(view.get("sentinels") or 0)
    quorum = max((int(a.get("quorum") or 0) for a in answered), default=0)
    up = [r for r in view.get("replicas", []) if not r.get("down")]
    if not answered:
        return Finding(name="broker sentinels", status="fail",
                       detail=f"none of the {total} Sentinels answers for {view.get('service')}: "
                              + "; ".join(view.get("errors", []))[:300],
                       fix="start the Sentinels, and check the service name in the URL")
    if len(answered) < quorum:
        return Finding(name="broker sentinels", status="fail",
                       detail=f"{len(answered)} of {total} Sentinels answer, fewer than the quorum of {quorum}: a "
                              "failover cannot be agreed", fix="start the Sentinels that are down")
    if not up:
        return Finding(name="broker sentinels", status="fail",
                       detail="the primary has no replica that is up: a failover has nothing to promote",
                       fix="start a replica (replicaof <primary> 6379)")
    problems = []
    if len(answered) < total:
        problems.append(f"{total - len(answered)} of the URL's {total} Sentinels do not answer")
    if total < 3:
        problems.append(f"only {total} Sentinels are named: three on separate hosts survive the loss of one")
    detail = (f"{len(answered)} of {total} Sentinels answer (quorum {quorum}); {len(up)} replica(s) up for a "
              "failover to promote")
    if problems:
        return Finding(name="broker sentinels", status="warn", detail=f"{detail}; " + "; ".join(problems),
                       fix="run three Sentinels on separate hosts, and name them all in the URL")
    return Finding(name="broker sentinels", status="ok", detail=detail)


def _journal(s: dict[str, Any]) -> Finding:
    mode = str(s.get("journal_mode") or "?").lower()
    if mode != "wal":
        return Finding(name="broker journal", status="fail",
                       detail=f"{s.get('path')} is in journal mode {mode}, not WAL: workers and readers block each "
                              "other", fix="stop every nodeagent process on this host, then start one (it sets WAL)")
    return Finding(name="broker journal", status="ok",
                   detail=f"{s.get('path')}: WAL, synchronous {_SYNC.get(s.get('synchronous'), s.get('synchronous'))} "
                          "(a process crash loses nothing; a power cut at most the last transactions)")


_SYNC = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}


def _disk(s: dict[str, Any]) -> Finding:
    free = s.get("disk_free_bytes")
    if free is None:
        return Finding(name="broker disk", status="warn", detail="the free disk beside the queue could not be read")
    size = f"; the queue takes {int(s.get('size_bytes') or 0) // MIB} MiB" if s.get("size_bytes") is not None else ""
    where = str(s.get("path", "the queue"))
    if free < DISK_FAIL_BYTES:
        return Finding(name="broker disk", status="fail",
                       detail=f"{free // MIB} MiB free beside {where}{size}: a full disk fails every enqueue and every "
                              "result", fix="free disk space, or move NODEAGENT_HOME to a larger disk")
    if free < DISK_WARN_BYTES:
        return Finding(name="broker disk", status="warn", detail=f"{free // MIB} MiB free beside {where}{size}",
                       fix="free disk space, or lower NODEAGENT_RESULT_RETENTION_S")
    return Finding(name="broker disk", status="ok", detail=f"{free / GIB:.1f} GiB free beside {where}{size}")
