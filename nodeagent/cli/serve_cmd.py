"""`nodeagent serve`: the HTTP API over one loaded model, and the worker loop over the same model when a
broker is configured. Under systemd it speaks the notify protocol (READY, WATCHDOG, STOPPING)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import click

from nodeagent.cli.common import (
    PLANNER_FLAGS,
    SERVER_FLAGS,
    App,
    binding_options,
    model_options,
    page_line,
    say,
    setting_options,
)
from nodeagent.errors import UsageError
from nodeagent.urls import shown

log = logging.getLogger(__name__)


@click.command("serve")
@model_options("request (routed by its model)")
@setting_options(*SERVER_FLAGS, "keep_alive_s")
@binding_options
@click.option("--any-model-name", is_flag=True, help="Answer requests whatever model they name (default: a name "
              "this node's model does not go by gets OpenAI's 404 model_not_found).")
@setting_options("broker", "types")
@click.option("--follow", is_flag=True, help="With --broker: also hold the models the scheduler assigns this node "
                                             "(the --model values to begin with; they too come and go).")
@setting_options("allow_pull")
@setting_options(*PLANNER_FLAGS)
@click.pass_obj
def command(app: App, models: tuple[str, ...], pins: tuple[str, ...], insecure: bool, insecure_token_argv: bool,
            any_model_name: bool, follow: bool, **settings: Any) -> None:
    """Serve MODEL over HTTP: OpenAI-compatible /v1/chat/completions and /v1/models, typed /v1/extract and
    /v1/classify, /healthz, /readyz and /metrics."""
    from nodeagent.fleet.registration import build_worker, parse_types
    from nodeagent.server.app import ServerConfig, check_binding, create_app
    from nodeagent.server.runtime import Work, serve_http

    nodes, pinned, aliases = app.loadable_nodes(models, pins, **settings)
    node, model = nodes[0], ", ".join(str(n.model) for n in nodes)
    config = node.config
    sc = ServerConfig.from_config(config, insecure, any_model_name, token_argv_ok=insecure_token_argv)
    refused = check_binding(sc)
    if refused:
        raise UsageError(refused)
    worker = broker = mset = None
    if follow and not config.broker:
        raise UsageError("--follow needs the fleet's queue, where the scheduler writes assignments",
                         hint="give --broker URL (or NODEAGENT_BROKER)")
    several = len(nodes) > 1 or bool(pinned) or follow
    if several:
        from nodeagent.fleet.registration import model_set

        mset = model_set(nodes, pinned, config, aliases)
    if config.broker:
        from nodeagent.broker.open import open_broker
        from nodeagent.fleet.registration import build_set_worker

        broker = open_broker(config.broker, config.state_dir, check=False, config=config)
        if follow:
            from nodeagent.fleet.registration import build_follow_worker

            worker = build_follow_worker(node.device, lambda m, _planned: app.node(m, **dict(settings)), broker,
                                         config, nodes, pinned, parse_types(config.types), models=mset)[0]
        else:
            worker = build_set_worker(nodes, pinned, broker, config, parse_types(config.types), models=mset)[0] \
                if several else build_worker(node, broker, config, parse_types(config.types))
    if mset is not None:
        mset.start()  # the pinned models now, the others at their first request
    else:
        node.load()
    guard = worker.guard if worker is not None else None
    web = create_app(node, sc, guard=guard, broker=broker, worker=worker, models=mset)
    work = Work(ready=f"serving {model} on {sc.host}:{sc.port}")
    thread = None
    if worker is not None:
        # a worker loop that died (not drained) stops the watchdog's pings: systemd restarts us
        thread = threading.Thread(target=worker.run, name="worker", daemon=True)
        work = Work(ready=work.ready, begin=thread.start, stop=worker.stop, alive=lambda: not worker.stopped.is_set(),
                    status=lambda: "serving" if worker.serving else "degraded: the broker is unreachable")
    say(f"serving {model} ({node.plan.quant}, {node.plan.backend}) on http://{sc.host}:{sc.port}"
        + (f", and tasks from {shown(broker.url)}" if broker is not None else ""))
    if page_line(config):
        say(page_line(config))
    serve_http(web, sc, config.drain_s, work)
    if thread is not None:
        thread.join(config.drain_s + 5)
    (mset or node).close()
    say("stopped")
