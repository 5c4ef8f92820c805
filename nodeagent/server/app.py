"""The HTTP API, assembled: the OpenAI-compatible routes, the typed routes and the operations routes
(``server/*_routes.py``), behind the middleware (``server/middleware.py``).

Built on Starlette through FastAPI (request and response models from the pydantic contracts, so
``/openapi.json`` documents them), served by uvicorn. Up to the plan's slots requests run at once, each on a
slot of the node (decoded together in one batch); the rest wait in a bounded queue and past it get 429 with
Retry-After. Every error is JSON in OpenAI's shape; a traceback never reaches a client.
"""

from __future__ import annotations

import logging
from typing import Any

from nodeagent.node import Node
from nodeagent.server import middleware, openai_routes, ops_routes, typed_routes
from nodeagent.server.metrics import Metrics
from nodeagent.server.state import Gate, Served, ServerConfig

log = logging.getLogger(__name__)


def create_app(node: Node, config: ServerConfig, metrics: Metrics | None = None, guard: Any = None,
               broker: Any = None, worker: Any = None) -> Any:
    from fastapi import FastAPI

    metrics = metrics or Metrics(node, guard=guard, broker=broker)
    # the plan's slots run at once inside the model (Node.slot() hands each request a slot of its own)
    gate = Gate(max(1, node.plan.settings.slots), config.queue_size, config.retry_after_s)
    served = Served(node=node, config=config, metrics=metrics, gate=gate, guard=guard, broker=broker, worker=worker)
    app = FastAPI(title="nodeagent", version=__import__("nodeagent").__version__,
                  description="A local-inference node: OpenAI-compatible chat, typed extraction and classification.")
    app.state.served = served
    paths: set[str] = set()
    for routes in (openai_routes, typed_routes, ops_routes):
        api = routes.router(served)
        paths |= {route.path for route in api.routes}
        app.include_router(api)
    middleware.install(app, served, paths)  # metrics label requests by these paths, the rest as "other"
    return app


def check_binding(config: ServerConfig) -> str | None:
    """None when this host/token combination may serve; else why not. Loopback needs nothing; any other address
    needs a token, or --insecure (which is logged as a warning). A blank token is never accepted."""
    if config.token is not None and not config.token.strip():
        return "the bearer token is blank: give a real one (--token or NODEAGENT_TOKEN), or none on loopback"
    loopback = config.host in ("127.0.0.1", "localhost", "::1") or config.host.startswith("127.")
    if loopback or config.token:
        return None
    if config.insecure:
        log.warning("serving on %s without a token (--insecure): anyone who reaches it can use the model",
                    config.host)
        return None
    return (f"binding {config.host} needs a bearer token (--token or NODEAGENT_TOKEN), or --insecure to serve "
            "without one")


__all__ = ["ServerConfig", "check_binding", "create_app"]
