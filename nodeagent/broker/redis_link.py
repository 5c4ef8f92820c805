"""The link to Redis: one connection pool, to a standalone server or to the primary the Sentinels name, and the rules
by which an operation is retried through a blip or a failover, and confirmed on replicas.

- **Where.** ``redis://``, ``rediss://`` and ``unix://`` connect to that server. ``redis+sentinel://`` and
  ``rediss+sentinel://`` ask the Sentinels for the primary of the service (redis-py's ``Sentinel``), at every new
  connection: after a failover the next connection reaches the new primary. A reply that says the server is no
  longer the primary (``READONLY``, or ``UNBLOCKED`` for a blocked read) closes the connection, and the next one asks
  the Sentinels again.
- **Retried, or not.** redis-py's own retry is off (it would resend any command, a non-idempotent one too). An
  operation the broker marks as retryable (``call(..., retry=True)``) is tried again after a connection error, a
  timeout or a reply that says the server is changing roles or loading, with the worker's backoff for blips (full
  jitter from 0.1 s doubling to 5 s), for up to ``retry_s`` (NODEAGENT_BROKER_RETRY_S); past that its caller sees
  the error. The operation is told when it is a retry, so one whose first try may have landed can recognise its
  own write (``RedisBroker`` documents each operation's rule).
- **Confirmed.** With ``min_replicas`` (NODEAGENT_REDIS_MIN_REPLICAS) at 1 or more, a write the fleet reports as
  done is sent with a fence write and ``WAIT min_replicas timeout`` on the same connection (a pipeline; the fence
  because since Redis 7.2 ``WAIT`` counts only its own connection's writes, and a retry may write nothing); fewer
  replicas confirming it in time is ``NotReplicated``, an error the caller sees (it is retried like a blip while
  ``retry_s`` lasts: every such write is idempotent), never a silent success. Claims and lease renewals are
  confirmed the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

from nodeagent.broker.base import blip_delay_s
from nodeagent.errors import BrokerError, ConfigError
from nodeagent.urls import is_sentinel, masked, parse_sentinel, shown

log = logging.getLogger(__name__)
T = TypeVar("T")
# replies that say the server is changing roles, loading, or lacks the replicas it was told to write with: the
# operation may succeed on the next try, on this server or on the new primary
TRANSIENT_REPLIES = ("UNBLOCKED", "MASTERDOWN", "NOREPLICAS")
CONNECT_TIMEOUT_S = 10.0
SOCKET_TIMEOUT_S = 30.0
SENTINEL_TIMEOUT_S = 2.0  # one Sentinel that does not answer: the next one is asked
FENCE = "nodeagent:v1:fence"  # the write a confirmed write makes of its own before WAIT (see Link.wait)


class NotReplicated(BrokerError):
    """A write reached the primary, but fewer replicas than NODEAGENT_REDIS_MIN_REPLICAS confirmed it in time: it
    would be lost if the primary failed now."""


class Link:
    """The connection pool and its retry rules (see the module's docstring)."""

    def __init__(self, url: str, *, retry_s: float = 30.0, min_replicas: int = 0, wait_timeout_s: float = 1.0,
                 check: bool = True) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.retry_s, self.min_replicas, self.wait_timeout_s = retry_s, min_replicas, wait_timeout_s
        self.sentinel: Any = None
        self.service: str | None = None
        self.hurried = threading.Event()  # set by hurry(): a transient error is no longer ridden out
        # text written by hand that is not UTF-8 is read with replacement characters: it must not fail the claim
        # that reads it (the worker dead-letters what does not parse)
        common = dict(decode_responses=True, encoding_errors="replace", socket_timeout=SOCKET_TIMEOUT_S,
                      socket_connect_timeout=CONNECT_TIMEOUT_S, health_check_interval=30,
                      retry=Retry(NoBackoff(), 0))
        try:
            if is_sentinel(url):
                self.r = self._through_sentinels(common)
            else:
                self.r = redis.Redis.from_url(url, **common)
            if check:
                self.r.ping()
        except (redis.RedisError, ValueError) as exc:
            raise ConfigError(f"cannot reach the Redis broker at {shown(url)}: {masked(self.why(exc), url)}",
                              hint="check NODEAGENT_BROKER, that redis-server (and for a Sentinel URL, the "
                                   "Sentinels) are running, the password, and for TLS ssl_ca_certs") from None

    def _through_sentinels(self, common: dict[str, Any]) -> Any:
        from redis.sentinel import Sentinel

        target = parse_sentinel(self.url)
        tls: dict[str, Any] = {"ssl": True, **target.tls_options} if target.tls else {}
        sentinel_kwargs = dict(socket_timeout=SENTINEL_TIMEOUT_S, socket_connect_timeout=SENTINEL_TIMEOUT_S,
                               decode_responses=True, username=target.sentinel_username,
                               password=target.sentinel_password, **tls)
        self.sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_kwargs)
        self.service = target.service
        return self.sentinel.master_for(target.service, db=target.db, username=target.username,
                                        password=target.password, **common, **tls)

    def why(self, exc: BaseException) -> str:
        """One line for an error; for a primary no Sentinel named, what each Sentinel answered (redis-py's message
        is the clients' reprs)."""
        from redis.sentinel import MasterNotFoundError

        if not isinstance(exc, MasterNotFoundError) or self.sentinel is None:
            return _one_line(exc)
        said = []
        for s in self.sentinel.sentinels:
            where = "{host}:{port}".format_map(s.connection_pool.connection_kwargs)
            try:
                known = s.sentinel_masters()
                said.append(f"{where}: " + ("names a primary that is down" if self.service in known
                                            else f"monitors no service {self.service!r}"))
            except redis_errors() as err:
                said.append(f"{where}: {_one_line(err)}")
        return f"no Sentinel named a primary for {self.service!r} ({'; '.join(said)})"

    # -- retries ------------------------------------------------------------------------------------------------
    def hurry(self) -> None:
        """From now on one try each: a process that is leaving (a node stopped during an outage) does not wait
        out a failover it will not serve through. The calls retrying now give up at their next failure."""
        self.hurried.set()

    def call(self, what: str, op: Callable[[bool], T], retry: bool = True) -> T:
        """``op(retried)``; for a retryable operation, again after a transient error while ``retry_s`` lasts."""
        start = time.monotonic()
        failures = 0
        while True:
            try:
                return op(failures > 0)
            except Exception as exc:  # noqa: BLE001  (sorted below: only transient errors are retried)
                if not retry or not self.transient(exc) or self.hurried.is_set():
                    raise
                failures += 1
                delay = blip_delay_s(failures)
                if time.monotonic() - start + delay > self.retry_s:
                    raise
                if failures == 1:
                    log.warning("broker %s: %s failed (%s); retrying for up to %g s", shown(self.url), what,
                                masked(_one_line(exc), self.url), self.retry_s)
                if self.sentinel is None and type(exc).__name__ == "ReadOnlyError":
                    self.r.connection_pool.disconnect()  # a demoted primary behind the same name: connect again
                self.hurried.wait(delay)  # hurry() ends the wait: the next failure is raised

    @staticmethod
    def transient(exc: BaseException) -> bool:
        """A connection error, a timeout, a reply that says the server changes roles or loads, or a write not yet
        confirmed on enough replicas: the same operation may succeed soon."""
        import redis
        from redis.exceptions import AuthenticationError, ReadOnlyError, TryAgainError

        if isinstance(exc, AuthenticationError):  # a ConnectionError to redis-py, but no retry mends a password
            return False
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, NotReplicated, ReadOnlyError, TryAgainError)):
            return True  # BusyLoadingError (a server loading its data) is a ConnectionError
        return isinstance(exc, redis.ResponseError) and _reply(exc).startswith(TRANSIENT_REPLIES)

    # -- confirmed writes ---------------------------------------------------------------------------------------
    def confirmed(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """A Lua script that writes what the fleet then reports as done: with ``min_replicas``, followed on the
        same connection by ``WAIT``; NotReplicated when fewer replicas confirm it within ``wait_timeout_s``."""
        if self.min_replicas <= 0:
            return script(keys=keys, args=args)
        from redis.exceptions import NoScriptError

        for _ in range(2):
            pipe = self.r.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            self.wait(pipe)
            got, _, acked = pipe.execute(raise_on_error=False)
            if isinstance(got, NoScriptError):  # a new primary (or a restarted one) that has not seen it yet
                script.sha = self.r.script_load(script.script)
                continue
            if isinstance(got, Exception):
                raise got
            self.replicated(acked)
            return got
        raise BrokerError("the Lua script could not be loaded on the primary")

    def wait(self, pipe: Any) -> None:
        """The fence and ``WAIT`` appended to a pipeline (executed by the caller, whose last reply it is). Since
        Redis 7.2 (and in Valkey) ``WAIT`` counts only the writes of its own connection: a retried write that finds
        its first try done writes nothing, and a ``WAIT`` after it would confirm nothing. So the pipeline writes a
        fence of its own first; the replication stream is one order, so a replica that has the fence has every
        write before it, this connection's or another's. (On 7.0 the fence is one more write, harmless.)"""
        if self.min_replicas > 0:
            pipe.incr(FENCE)
            pipe.execute_command("WAIT", self.min_replicas, int(self.wait_timeout_s * 1000))

    def settle(self) -> None:
        """Wait until what was written so far (on any connection) is on ``min_replicas`` replicas: a fence, then
        ``WAIT`` (NotReplicated when fewer confirm it in time). Nothing without ``min_replicas``."""
        if self.min_replicas > 0:
            pipe = self.r.pipeline(transaction=False)
            self.wait(pipe)
            self.replicated(pipe.execute(raise_on_error=False)[-1])

    def replicated(self, acked: Any) -> None:
        if isinstance(acked, Exception):
            raise acked
        if int(acked) < self.min_replicas:
            raise NotReplicated(f"only {int(acked)} of the {self.min_replicas} replicas NODEAGENT_REDIS_MIN_REPLICAS "
                                f"asks for confirmed the write within {self.wait_timeout_s:g} s",
                                hint="check the replicas (nodeagent doctor), or lower NODEAGENT_REDIS_MIN_REPLICAS")

    # -- the topology, for the doctor ---------------------------------------------------------------------------
    def sentinel_view(self) -> dict[str, Any]:
        """What the Sentinels say of the service: the primary, its replicas and the Sentinels that answer (only
        for a Sentinel URL)."""
        if self.sentinel is None:
            return {}
        answered: list[dict[str, Any]] = []
        errors: list[str] = []
        replicas: list[dict[str, Any]] = []
        for s in self.sentinel.sentinels:
            where = "{host}:{port}".format_map(s.connection_pool.connection_kwargs)
            try:
                master = s.sentinel_master(self.service)
                if not replicas:
                    replicas = s.sentinel_slaves(self.service)
                answered.append({"at": where, **{k: master.get(k) for k in (
                    "ip", "port", "quorum", "num-slaves", "num-other-sentinels", "is_odown", "is_sdown")}})
            except Exception as exc:  # noqa: BLE001  (a Sentinel that is down is what this reports)
                errors.append(f"{where}: {_one_line(exc)}")
        return {"service": self.service, "sentinels": len(self.sentinel.sentinels), "answered": answered,
                "errors": errors, "replicas": [{"ip": r.get("ip"), "port": r.get("port"),
                                                "down": bool(r.get("is_sdown") or r.get("is_odown")),
                                                "link": r.get("master-link-status")} for r in replicas]}

    def close(self) -> None:
        self.r.close()
        if self.sentinel is not None:
            self.sentinel.close()


def redis_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.RedisError, OSError)


def _reply(exc: BaseException) -> str:
    return str(exc).lstrip("-").upper()


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
