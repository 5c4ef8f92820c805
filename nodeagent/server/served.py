"""What every route of the server shares: its config (built from the resolved settings), the gate in front of
the model's slots, and the node, its metrics, guard, broker and worker loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from pydantic import Field

from nodeagent.config import NodeConfig, default_of
from nodeagent.errors import HttpError
from nodeagent.values import Frozen

if TYPE_CHECKING:
    from nodeagent.server.executors import Executor


def _setting(name: str) -> Any:
    return Field(default_factory=lambda: default_of(name))


class ServerConfig(Frozen):
    """``from_config`` builds it from the resolved settings; a field left out (a test's) takes its setting's one
    default."""

    host: str = _setting("host")
    port: int = _setting("port")
    token: str | None = _setting("token")
    insecure: bool = False
    max_body_bytes: int = _setting("max_body_bytes")
    max_batch_bytes: int = _setting("max_batch_bytes")
    max_tokens: int = _setting("max_tokens")
    max_n: int = _setting("max_n")
    queue_size: int = _setting("server_queue")
    client_timeout_s: float = _setting("client_timeout_s")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names answered besides loopback's")
    max_connections: int = _setting("max_connections")
    ui_session_s: float = _setting("ui_session_s")
    responses_keep_s: float = _setting("responses_keep_s")
    any_model_name: bool = False
    retry_after_s: int = 2

    @classmethod
    def from_config(cls, config: NodeConfig, insecure: bool = False, any_model_name: bool = False) -> "ServerConfig":
        return cls(host=config.host, port=config.port, token=config.token, insecure=insecure,
                   max_body_bytes=config.max_body_bytes, max_batch_bytes=config.max_batch_bytes,
                   max_tokens=config.max_tokens, max_n=config.max_n,
                   queue_size=config.server_queue, client_timeout_s=config.client_timeout_s,
                   allowed_hosts=[h.strip().lower() for h in (config.allowed_hosts or "").split(",") if h.strip()],
                   max_connections=config.max_connections, ui_session_s=config.ui_session_s,
                   responses_keep_s=config.responses_keep_s, any_model_name=any_model_name)


class Gate:
    """At most ``slots`` requests inside the model, at most ``queue_size`` waiting; the rest are refused."""

    def __init__(self, slots: int, queue_size: int, retry_after_s: int = 2) -> None:
        self.slots, self.queue_size, self.retry_after_s = slots, queue_size, retry_after_s
        self.inside = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(slots)

    async def __aenter__(self) -> "Gate":
        if self.inside >= self.slots and self.waiting >= self.queue_size:
            raise HttpError(429, f"busy: {self.inside} requests running and {self.waiting} waiting",
                            "rate_limit_exceeded", "queue_full", headers={"Retry-After": str(self.retry_after_s)})
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.inside += 1
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.inside -= 1
        self._sem.release()


@dataclass
class Served:
    """The server's shared state, handed to each router."""

    node: Any
    config: ServerConfig
    metrics: Any
    gate: Gate
    guard: Any = None
    broker: Any = None
    worker: Any = None
    batches: Any = None  # the Batch API's service (fleet/batches.py), made on first use
    models: Any = None  # a ModelSet when the server holds several models (requests routed by their model)
    executor: "Executor | None" = None  # what runs a request: executors/local.py (this node), queue.py (the fleet)
    snapshots: Any = None  # the operator's page's shared snapshot of the fleet (ui/snapshot.py), when it is served
    sessions: Any = None  # the page's sign-ins (ui/sessions.py)
    throttle: Any = None  # failed sign-ins and bad tokens per client address (server/throttle.py)

    @functools.cached_property
    def model_id(self) -> str:
        """The model's id for clients: its catalog name, or its file's name without the extension (never a
        path of this machine)."""
        from nodeagent.tasks.completion import model_id

        return model_id(str(self.node.model or self.node.plan.model))

    @functools.cached_property
    def names(self) -> set[str]:
        """Every name a request's ``model`` may give this node's model: its id, the spec it was started with,
        the file's name and stem, the catalog's name and sha256 of the file."""
        from nodeagent.fleet.registration import routing_names

        plan_file = Path(self.node.plan.model)
        return {self.model_id, plan_file.name, plan_file.stem, *routing_names(self.node)}

    def answers_to(self, model: str) -> bool:
        if self.models is not None:
            return self._member(model) is not None
        return model in self.names or model.lower() in {n.lower() for n in self.names}

    def _member(self, model: str | None) -> Any:
        """The model set's member a request names (the set's own lookup), or None for a name it does not hold."""
        from nodeagent.errors import TaskFailed

        try:
            return self.models.member(model)
        except TaskFailed:
            return None

    def batch_service(self) -> Any:
        """The Batch API over the server's broker (``fleet/batches.py``), made on first use."""
        if self.batches is None:
            from nodeagent.fleet.batches import Batches

            self.batches = Batches(self.broker, max_bytes=self.config.max_batch_bytes)
        return self.batches

    @contextlib.asynccontextmanager
    async def use(self, model: str | None, keep_alive_s: float | None = None) -> AsyncIterator[Any]:
        """The node that serves a request naming ``model`` (the first of a set when it names none), held loaded
        for the request; 404 for a model the set does not hold, 503 (retryable) when no room comes in time."""
        if self.models is None:
            yield self.node
            return
        m = self._member(model)
        if m is None:
            raise HttpError(404, f"The model `{model}` does not exist on this node", "invalid_request_error",
                            "model_not_found", param="model")
        from nodeagent.errors import TaskFailed

        try:
            await asyncio.to_thread(self.models.acquire, m)
        except TaskFailed as exc:
            raise HttpError(503, str(exc), "server_error", exc.code, headers={"Retry-After": "5"}) from None
        try:
            yield m.node
        finally:
            self.models.release(m, keep_alive_s)

    def listed(self) -> list[tuple[str, dict[str, Any]]]:
        """Every model this server answers for, with its state: (id, extra fields of /v1/models)."""
        if self.models is None:
            return [(self.model_id, {})]
        from nodeagent.tasks.completion import model_id

        return [(model_id(state["model"]), {k: state[k] for k in ("loaded", "pinned", "slots", "ctx_per_slot")})
                for state in self.models.state()]

    async def in_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn`` on a worker thread, once the gate lets the request into the model."""
        async with self.gate:
            return await asyncio.to_thread(fn, *args, **kwargs)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback: ``localhost``, or an address in 127.0.0.0/8 or ::1 (an IP
    address, read as one: a name that merely starts with 127. is not)."""
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False
