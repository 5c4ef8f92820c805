"""`nodeagent gateway`: the fleet as one OpenAI endpoint. It holds no model: each request goes on the queue and
a node that serves its model answers it (``server/executors/fleet.py``). It registers like a node (marked a gateway) and
heartbeats, so `nodeagent status` lists it. Under systemd it speaks the notify protocol."""

from __future__ import annotations

import socket
from typing import Any

import click

from nodeagent.cli.common import SERVER_FLAGS, App, binding_options, page_line, say, setting_options
from nodeagent.errors import UsageError
from nodeagent.urls import shown


@click.command("gateway")
@setting_options("broker", *SERVER_FLAGS)
@binding_options
@click.pass_obj
def command(app: App, insecure: bool, insecure_token_argv: bool, **settings: Any) -> None:
    """The fleet as one endpoint: /v1/chat/completions, /v1/completions, /v1/extract and /v1/classify put on the
    queue and answered by the node that serves the request's model (streamed, with failover); /v1/models of the
    whole fleet; /v1/files and /v1/batches; /healthz, /readyz and /metrics."""
    from nodeagent.broker.open import open_broker
    from nodeagent.server.app import ServerConfig, check_binding, create_gateway_app
    from nodeagent.server.executors.fleet import gateway_record
    from nodeagent.server.runtime import Work, serve_http

    config = app.config.with_flags({k: v for k, v in settings.items() if v is not None})
    if not config.broker:
        raise UsageError("the gateway puts requests on the fleet's queue: give --broker URL (or NODEAGENT_BROKER)",
                         hint="e.g. nodeagent gateway --broker redis://queue-host:6379/0")
    sc = ServerConfig.from_config(config, insecure, any_model_name=True, token_argv_ok=insecure_token_argv)
    refused = check_binding(sc)
    if refused:
        raise UsageError(refused)
    broker = open_broker(config.broker, config.state_dir, config=config)
    host = socket.gethostname()
    ident = f"gateway-{host}-{sc.port}"
    record = gateway_record(ident, host, f"http://{sc.host}:{sc.port}", config.heartbeat_s)
    web = create_gateway_app(broker, sc, config, name=ident, record=record)
    say(f"gateway to {shown(broker.url)} on http://{sc.host}:{sc.port}")
    if page_line(config):
        say(page_line(config))
    # a signal hurries the broker at once: a start still reading it (registering, its settings) through an outage
    # does not ride out the failover's 30 s before the shutdown can begin
    serve_http(web, sc, config.drain_s, Work(ready=f"gateway to {shown(broker.url)} on {sc.host}:{sc.port}",
                                             stop=broker.hurry))
    broker.close()
    say("stopped")
