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
from nodeagent.server import batch_routes, middleware, openai_routes, ops_routes, responses_routes, typed_routes
from nodeagent.server.executors.local import Gate, LocalExecutor
from nodeagent.server.metrics import Metrics
from nodeagent.server.runtime import every
from nodeagent.server.served import Served, ServerConfig, is_loopback

log = logging.getLogger(__name__)


def create_app(node: Node, config: ServerConfig, metrics: Metrics | None = None, guard: Any = None,
               broker: Any = None, worker: Any = None, models: Any = None) -> Any:
    """``models``: a ModelSet whose first member is ``node``, when the server holds several models."""
    metrics = metrics or Metrics(node, guard=guard, broker=broker, models=models)
    # the plan's slots run at once inside the model (Node.slot() hands each request a slot of its own)
    nodes = [m.node for m in models.members] if models is not None else [node]
    gate = Gate(max(1, *(n.plan.settings.slots for n in nodes)), config.queue_size, config.retry_after_s)
    executor = LocalExecutor(node, config, metrics, gate, guard=guard, worker=worker, models=models)
    served = Served(config=config, metrics=metrics, executor=executor, node_config=node.config, broker=broker)
    app = _assemble(served, node.config, broker, None if broker is not None else lambda: _local_record(node, models),
                    "node", title="nodeagent",
                    description="A local-inference node: OpenAI-compatible chat, typed extraction and classification.")
    if broker is not None:
        _sweep_batches(app, served)
        # idempotent typed tasks go through the queue executor (made on their first): its wake-up log kept fresh
        every(app, node.config.heartbeat_s, lambda: served.queued.beat() if served.queued else None, "queue log")
        app.on_event("shutdown")(lambda: served.queued.close() if served.queued else None)
    if models is not None:
        every(app, 1.0, models.reap, "model-reaper")  # keep-alive: idle models unloaded
    return app


def create_gateway_app(broker: Any, config: ServerConfig, node_config: Any, name: str | None = None,
                       record: Any = None) -> Any:
    """The gateway: the same routers as `serve`, with the fleet's queue as their executor
    (server/executors/fleet.py); no model, no node, no gate of its own (the queue is the fleet's; backpressure is
    the executor's). ``record``: the gateway's own NodeRecord, registered when the app starts and kept fresh by
    its heartbeat (every ``heartbeat_s``), marked stopped when it shuts down. What expiry leaves past the retention
    is dropped every PURGE_EVERY_S (``Purge``: a SQLite queue with no worker still stays bounded)."""
    from nodeagent.broker.base import PURGE_EVERY_S, Purge
    from nodeagent.server.executors.fleet import FleetExecutor

    executor = FleetExecutor(broker, node_config, name)
    served = Served(config=config, metrics=Metrics(None, broker=broker), executor=executor, node_config=node_config,
                    broker=broker, queued=executor)
    app = _assemble(served, node_config, broker, None, "gateway", title="nodeagent gateway",
                    description="The fleet as one endpoint: OpenAI-compatible chat and completions, typed extraction "
                                "and classification, through the durable queue.")
    _sweep_batches(app, served)
    every(app, PURGE_EVERY_S, Purge(broker, node_config.result_retention_s), "purge")
    if record is not None:
        app.on_event("startup")(lambda: executor.start(record))
        every(app, node_config.heartbeat_s, executor.beat, "gateway heartbeat")
    app.on_event("shutdown")(executor.close)
    return app


def _assemble(served: Served, config: Any, broker: Any, local: Any, door_name: str, **about: str) -> Any:
    """The app both doors are: the same routers (one door, its executor in ``served``), the operator's page, the
    middleware, the OpenAPI document."""
    from fastapi import FastAPI

    from nodeagent.server.throttle import Throttle
    from nodeagent.ui.sessions import MemoryStore, Sessions

    app = FastAPI(version=__import__("nodeagent").__version__, **about)
    app.state.served = served
    served.sessions = Sessions(broker if broker is not None else MemoryStore(), served.config.token,
                               served.config.ui_session_s)
    served.throttle = Throttle()
    paths: set[str] = set()
    door = openai_routes.Door(served)
    for api in (openai_routes.router(served, door), responses_routes.router(served, door),
                *(routes.router(served) for routes in (batch_routes, typed_routes, ops_routes))):
        paths |= {route.path for route in api.routes}
        app.include_router(api)
    if config.ui:
        paths |= _page(app, served, config, broker, local, door_name)
    middleware.install(app, served, paths)  # metrics label requests by these paths, the rest as "other"
    app.openapi = lambda: _documented(app)  # type: ignore[method-assign]
    return app


def _page(app: Any, served: Served, config: Any, broker: Any, local: Any, title: str) -> set[str]:
    """The operator's page (``nodeagent/ui``) on this app: one shared snapshot of the fleet (or, with no queue,
    of this node), its routes and files. Returns the routes' paths."""
    from nodeagent.broker.base import lost_after
    from nodeagent.fleet.history import DepthSampler
    from nodeagent.ui.routes import UiConfig, install
    from nodeagent.ui.snapshot import Snapshots, local_snapshot, read_snapshot

    lost_after_s = lost_after(config.heartbeat_s)
    keep_s = config.history_days * 86400.0
    sampler = DepthSampler()
    read = ((lambda: read_snapshot(broker, lost_after_s, keep_s, sampler, config.clock_warn_s)) if broker is not None
            else (lambda: local_snapshot(local, lost_after_s)))
    snapshots = Snapshots(read, config.ui_refresh_s, config.ui_streams)
    served.snapshots = snapshots
    ui = UiConfig(admin=config.ui_admin, token=served.config.token, input_chars=config.ui_input_chars,
                  redact={k.strip().lower() for k in config.ui_redact.split(",") if k.strip()},
                  title=title)
    return install(app, snapshots, broker, ui, served.sessions, served.throttle)


def _local_record(node: Node, models: Any) -> Any:
    """This node as a record, for the page of a server that runs no queue."""
    import socket

    import psutil

    from nodeagent.fleet.registration import node_prefixes, record_for, suited_types

    record = record_for(node, socket.gethostname(), suited_types(node.model, node.kind))
    return record.model_copy(update={"state": "ready", "ram_available_bytes": psutil.virtual_memory().available,
                                     "model_set": models.state() if models is not None else [],
                                     "prefixes": models.prefix_usage() if models is not None
                                     else node_prefixes(node)})


SWEEP_S = 2.0


def _sweep_batches(app: Any, served: Served) -> None:
    """While the server runs, the broker's active batches are advanced every SWEEP_S (expansion taken over,
    expiry, finalization), so a batch ends without anyone polling it. Several servers may sweep one broker: each
    step is written over the version read."""
    every(app, SWEEP_S, lambda: served.batch_service().sweep(), "batch sweep")


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _documented(app: Any) -> dict[str, Any]:
    """The OpenAPI document as the server answers: a refused request is a 400 in OpenAI's error shape (FastAPI
    would document a 422 HTTPValidationError it never sends), and the OpenAI routes' bodies are their requests."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    from nodeagent.tasks.openai.requests import ChatRequest, CompletionRequest

    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["Error"] = ERROR_SCHEMA
    bodies = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest}
    for path, ops in doc.get("paths", {}).items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            responses.setdefault("400", {"description": "The request was refused: OpenAI's error shape",
                                         "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
            if path in bodies:
                schema = bodies[path].model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(schema.pop("$defs", {}))
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    app.openapi_schema = doc
    return doc


MIN_TOKEN_CHARS = 16


def check_binding(config: ServerConfig) -> str | None:
    """None when this host/token combination may serve; else why not. Loopback needs nothing; any other address
    needs a token, or --insecure (which is logged as a warning). A blank token is never accepted, nor one shorter
    than MIN_TOKEN_CHARS off loopback (a guess away)."""
    if config.token is not None and not config.token.strip():
        return "the bearer token is blank: give a real one (--token or NODEAGENT_TOKEN), or none on loopback"
    if is_loopback(config.host):
        return None
    if config.token and len(config.token.strip()) < MIN_TOKEN_CHARS:
        return (f"a token of {len(config.token.strip())} characters on {config.host}: off loopback it needs at least "
                f"{MIN_TOKEN_CHARS} (make one: python3 -c 'import secrets; print(secrets.token_urlsafe(32))', or "
                "`nodeagent service install --generate-token`)")
    if config.token and config.token_on_argv and not config.token_argv_ok:
        return (f"the bearer token was given on the command line (--token), where every user of this machine reads it "
                f"(ps), and {config.host} is not loopback: give --token-file PATH (a 0600 file) or NODEAGENT_TOKEN, "
                "or --insecure-token-on-command-line to accept it")
    if config.token:
        return None
    if config.insecure:
        log.warning("serving on %s without a token (--insecure): anyone who reaches it can use the model",
                    config.host)
        return None
    return (f"binding {config.host} needs a bearer token (--token or NODEAGENT_TOKEN), or --insecure to serve "
            "without one")


__all__ = ["ServerConfig", "check_binding", "create_app", "create_gateway_app", "is_loopback"]
