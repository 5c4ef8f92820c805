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


def open_broker(url: str | None, state_dir: Any, check: bool = True, retention_s: float | None = None,
                config: Any = None) -> Broker:
    """``sqlite:///path`` (default: <state_dir>/queue.db), ``redis://host:port/db`` (``rediss://``, ``unix://``)
    or ``redis+sentinel://host:port[,...]/service[/db]`` (``urls.py``). ``check``: a Redis broker is pinged
    at once (False for a worker, which waits for a broker that is not up yet). ``retention_s``: how long Redis keeps
    results; ``config``: the resolved settings (a ``NodeConfig``) that say it, and how long an operation is retried
    through a failover and the replicas a write waits for (without one: the settings' defaults)."""
    from pathlib import Path

    from nodeagent.config import default_of
    from nodeagent.urls import scheme

    if scheme(url) == "sqlite":
        from nodeagent.broker.sqlite import SqliteBroker

        path = url.removeprefix("sqlite://") if url else ""
        if path:
            return SqliteBroker(Path(path))
        from nodeagent.private import private_dir

        return SqliteBroker(private_dir(Path(state_dir)) / "queue.db")
    from nodeagent.broker.redis import RedisBroker

    def setting(name: str) -> Any:
        return getattr(config, name) if config is not None else default_of(name)

    assert url is not None
    files = {"password": (setting("broker_password_file"), "NODEAGENT_BROKER_PASSWORD_FILE"),
             "sentinel_password": (setting("broker_sentinel_password_file"), "NODEAGENT_BROKER_SENTINEL_PASSWORD_FILE")}
    if any(path for path, _ in files.values()):  # secrets kept in files (a service's credentials), for a URL without
        from nodeagent.config import read_secret
        from nodeagent.urls import with_secrets

        url = with_secrets(url, **{k: read_secret(path, env) for k, (path, env) in files.items() if path})
    return RedisBroker(url, setting("result_retention_s") if retention_s is None else retention_s, check=check,
                       retry_s=setting("broker_retry_s"), min_replicas=setting("redis_min_replicas"),
                       wait_timeout_s=setting("redis_wait_timeout_s"))
