"""uvicorn's HTTP/1.1 protocol with the limits a server facing clients it does not trust needs, and uvicorn's
settings for both doors.

- **Headers in time.** uvicorn closes a kept-alive connection idle past NODEAGENT_IDLE_TIMEOUT_S, but a client that
  drips its headers a byte at a time would hold a connection (and a file descriptor) for ever. Here a request's head
  must arrive within NODEAGENT_HEADER_TIMEOUT_S of its first byte (or of the connection's opening), a time shorter
  than the idle one; else the connection is closed. (Bodies are bounded in time by the server's middleware.)
- **Connections per client.** At most NODEAGENT_MAX_CLIENT_CONNECTIONS from one address at once (a trusted proxy's
  are not counted): past it a new connection is answered 503 and closed, so one client cannot fill the server's
  NODEAGENT_MAX_CONNECTIONS (past which uvicorn answers everyone 503).
- **Who the client is.** Forwarded headers are believed only from NODEAGENT_TRUSTED_PROXIES (none by default): the
  address the throttles, the body budget and the audit log see is the connection's own, not one a client chose.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 5\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


def trusted(address: str | None, proxies: list[str]) -> bool:
    """Whether ``address`` is one of ``proxies`` (addresses or networks)."""
    if not address or not proxies:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    for p in proxies:
        try:
            if ip in ipaddress.ip_network(p, strict=False):
                return True
        except ValueError:
            continue
    return False


def protocol_class(header_timeout_s: float, max_client_connections: int, proxies: list[str]) -> type:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    body = json.dumps({"error": {"message": f"this client holds {max_client_connections} connections already: "
                                            "close one, or try again", "type": "server_error",
                                 "code": "too_many_connections"}}).encode()
    busy = BUSY % (len(body), body)

    class GuardedProtocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._armed_for: Any = ()
            peer = self.client[0] if self.client else None
            if peer and not trusted(peer, proxies):
                held = sum(1 for c in self.connections if c.client and c.client[0] == peer)
                if held > max_client_connections:
                    transport.write(busy)
                    transport.close()
                    return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:  # the first bytes of a request's head
                self._arm()
            super().data_received(data)

        def _arm(self) -> None:
            if self._armed_for is self.cycle:  # armed already for this wait
                return
            self._armed_for = self.cycle
            self.loop.call_later(header_timeout_s, self._expire, self.cycle)

        def _expire(self, cycle: Any) -> None:
            waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)  # no request began since
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


def listen_config(web: Any, server: Any, drain_s: float) -> Any:
    """uvicorn's settings for ``serve`` and ``gateway``: ``server`` (a ServerConfig) says where and how much.
    log_config None: uvicorn's loggers go through nodeagent's handler (JSON lines under a service manager)."""
    import uvicorn

    return uvicorn.Config(web, host=server.host, port=server.port, log_level="warning", access_log=False,
                          lifespan="on", timeout_graceful_shutdown=int(drain_s), log_config=None,
                          http=protocol_class(server.header_timeout_s, server.max_client_connections,
                                              server.trusted_proxies),
                          limit_concurrency=server.max_connections, timeout_keep_alive=int(server.idle_timeout_s),
                          proxy_headers=bool(server.trusted_proxies),
                          forwarded_allow_ips=",".join(server.trusted_proxies) or "")
