"""The Redis engine's connection, shared by its stores: the link (``broker/redis_link.py``), the Lua scripts (the
files of ``broker/lua/``), the server's time, the key layout's names, and what the broker says of itself."""

from __future__ import annotations

import functools
from typing import Any

from nodeagent.broker.base import CONTRACT
from nodeagent.broker.redis_link import Link
from nodeagent.clock import BrokerClock
from nodeagent.urls import shown

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


class RedisConnection:
    """The connection every store of the Redis engine shares (``RedisBroker`` composes them over it)."""

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

    def _dead_by(self, code: str) -> str:
        return f"{PREFIX}deadby:{code or 'unknown'}"

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
