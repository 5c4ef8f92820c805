"""What every route of the server shares (``Served``), and its config built from the resolved settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field

from nodeagent.config import NodeConfig, default_of
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
    header_timeout_s: float = _setting("header_timeout_s")
    idle_timeout_s: float = _setting("idle_timeout_s")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names answered besides loopback's")
    max_connections: int = _setting("max_connections")
    max_client_connections: int = _setting("max_client_connections")
    trusted_proxies: list[str] = Field(default_factory=list, description="Addresses or networks whose forwarded "
                                                                         "headers are believed")
    ui_session_s: float = _setting("ui_session_s")
    responses_keep_s: float = _setting("responses_keep_s")
    responses_max_count: int = _setting("responses_max_count")
    responses_max_bytes: int = _setting("responses_max_bytes")
    any_model_name: bool = False
    retry_after_s: int = 2
    token_on_argv: bool = Field(False, description="The token came as --token: every local user reads it (ps)")
    token_argv_ok: bool = Field(False, description="--insecure-token-on-command-line: accepted off loopback anyway")

    @classmethod
    def from_config(cls, config: NodeConfig, insecure: bool = False, any_model_name: bool = False,
                    token_argv_ok: bool = False) -> "ServerConfig":
        return cls(host=config.host, port=config.port, token=config.token, insecure=insecure,
                   token_on_argv=config.sources.get("token") == "flag", token_argv_ok=token_argv_ok,
                   max_body_bytes=config.max_body_bytes, max_batch_bytes=config.max_batch_bytes,
                   max_tokens=config.max_tokens, max_n=config.max_n,
                   queue_size=config.server_queue, client_timeout_s=config.client_timeout_s,
                   allowed_hosts=[h.strip().lower() for h in (config.allowed_hosts or "").split(",") if h.strip()],
                   max_connections=config.max_connections, ui_session_s=config.ui_session_s,
                   header_timeout_s=config.header_timeout_s, idle_timeout_s=config.idle_timeout_s,
                   max_client_connections=config.max_client_connections,
                   trusted_proxies=[p.strip() for p in (config.trusted_proxies or "").split(",") if p.strip()],
                   responses_keep_s=config.responses_keep_s, responses_max_count=config.responses_max_count,
                   responses_max_bytes=config.responses_max_bytes, any_model_name=any_model_name)


@dataclass
class Served:
    """What every route of both doors shares: the server's config, its metrics, the executor that runs a request
    (``server/executors/``: this process's node, or the fleet's queue), the broker when there is one, and the page's
    sign-ins and snapshot. Nothing here is one door's own: a node's model, gate and guard are its executor's."""

    config: ServerConfig
    metrics: Any
    executor: "Executor"
    node_config: Any = None  # the resolved NodeConfig (the queue executor's heartbeat, attempts, deadlines)
    broker: Any = None
    queued: "Executor | None" = None  # what runs a task whose idempotency key the queue honours (queue_executor)
    batches: Any = None  # the Batch API's service (fleet/batches.py), made on first use
    snapshots: Any = None  # the operator's page's shared snapshot of the fleet (ui/snapshot.py), when it is served
    sessions: Any = None  # the page's sign-ins (ui/sessions.py)
    throttle: Any = None  # failed sign-ins and bad tokens per client address (server/throttle.py)

    def batch_service(self) -> Any:
        """The Batch API over the server's broker (``fleet/batches.py``), made on first use."""
        if self.batches is None:
            from nodeagent.fleet.batches import Batches

            node = self.node_config
            self.batches = Batches(self.broker, max_bytes=self.config.max_batch_bytes,
                                   keep_s=node.result_retention_s if node else None,
                                   takeover_s=node.batch_takeover_s if node else None)
        return self.batches

    def queue_executor(self) -> "Executor | None":
        """What runs a typed task with an idempotency key: the fleet's queue executor (the queue honours the key:
        the same key again answers the first task's Result, whichever node ran it). The gateway's own executor;
        on `serve --broker` one made on first use; None with no queue."""
        if self.queued is None and self.broker is not None and self.node_config is not None:
            from nodeagent.server.executors.fleet import FleetExecutor

            self.queued = FleetExecutor(self.broker, self.node_config)
        return self.queued


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
