"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers: uvicorn times out an idle keep-alive
connection, but a client that drips its headers a byte at a time holds a connection (and a file descriptor)
for ever. Here a connection that has not sent a whole request head within ``client_timeout_s`` of opening, or
of its last response, is closed. (Bodies are bounded in time by the server's middleware.) And the number of
connections held at once is bounded (NODEAGENT_MAX_CONNECTIONS): past it, uvicorn answers 503."""

from __future__ import annotations

from typing import Any


def protocol_class(client_timeout_s: float) -> type:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            self.loop.call_later(client_timeout_s, self._expire, self.cycle)

        def _expire(self, cycle: Any) -> None:
            waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)  # no request began since
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutProtocol


def listen_config(web: Any, server: Any, drain_s: float) -> Any:
    """uvicorn's settings for ``serve`` and ``gateway``: ``server`` (a ServerConfig) says where and how much.
    log_config None: uvicorn's loggers go through nodeagent's handler (JSON lines under a service manager)."""
    import uvicorn

    return uvicorn.Config(web, host=server.host, port=server.port, log_level="warning", access_log=False,
                          lifespan="on", timeout_graceful_shutdown=int(drain_s), log_config=None,
                          http=protocol_class(server.client_timeout_s), limit_concurrency=server.max_connections)
