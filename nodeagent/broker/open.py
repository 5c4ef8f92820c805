"""Opening a broker from its URL: the one place that knows both engines (each engine imports only the
protocol in ``base.py``, so nothing imports in a circle)."""

from __future__ import annotations

from typing import Any

from nodeagent.broker.base import Broker


def broker_errors() -> tuple[type[BaseException], ...]:
    """What the brokers' client libraries raise when the queue cannot be reached or refuses an operation."""
    import sqlite3

    try:
        import redis
    except ImportError:
        return (sqlite3.Error,)
    return (sqlite3.Error, redis.RedisError)


def open_broker(url: str | None, state_dir: Any, check: bool = True, retention_s: float | None = None) -> Broker:
    """``sqlite:///path`` (default: <state_dir>/queue.db) or ``redis://host:port/db``. ``check``: a Redis
    broker is pinged at once (False for a worker, which waits for a broker that is not up yet).
    ``retention_s``: how long Redis keeps results (default NODEAGENT_RESULT_RETENTION_S's)."""
    from pathlib import Path

    if not url or url.startswith("sqlite:"):
        from nodeagent.broker.sqlite import SqliteBroker

        path = url.removeprefix("sqlite://") if url else ""
        return SqliteBroker(Path(path) if path else Path(state_dir) / "queue.db")
    if url.startswith(("redis://", "rediss://", "unix://")):
        from nodeagent.broker.redis import RedisBroker
        from nodeagent.config import default_of

        return RedisBroker(url, default_of("result_retention_s") if retention_s is None else retention_s, check=check)
    from nodeagent.errors import ConfigError

    raise ConfigError(f"unknown broker URL {url!r}", hint="use sqlite:///path/queue.db or redis://host:6379/0")
