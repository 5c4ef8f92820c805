"""`nodeagent gateway`: the fleet as one OpenAI endpoint. It holds no model: each request goes on the queue and
a node that serves its model answers it (``server/gateway.py``). It registers like a node (marked a gateway) and
heartbeats, so `nodeagent status` lists it. Under systemd it speaks the notify protocol."""

from __future__ import annotations

import socket
import threading
from typing import Any

import click

from nodeagent.broker.urls import shown
from nodeagent.cli.common import SERVER_FLAGS, App, on_signals, page_line, say, setting_options
from nodeagent.errors import UsageError


@click.command("gateway")
@setting_options("broker", *SERVER_FLAGS)
@click.option("--insecure", is_flag=True, help="Allow a non-loopback address without a token (logged as a warning).")
@click.pass_obj
def command(app: App, insecure: bool, **settings: Any) -> None:
    """The fleet as one endpoint: /v1/chat/completions, /v1/completions, /v1/extract and /v1/classify put on the
    queue and answered by the node that serves the request's model (streamed, with failover); /v1/models of the
    whole fleet; /v1/files and /v1/batches; /healthz, /readyz and /metrics."""
    import uvicorn

    from nodeagent import __version__
    from nodeagent.broker.base import CONTRACT, NodeRecord
    from nodeagent.broker.open import open_broker
    from nodeagent.fleet.worker import log_broker_advice
    from nodeagent.server.app import ServerConfig, check_binding, create_gateway_app
    from nodeagent.server.transport import listen_config
    from nodeagent.service.notify import Liveness, Notifier

    config = app.config.with_flags({k: v for k, v in settings.items() if v is not None})
    if not config.broker:
        raise UsageError("the gateway puts requests on the fleet's queue: give --broker URL (or NODEAGENT_BROKER)",
                         hint="e.g. nodeagent gateway --broker redis://queue-host:6379/0")
    sc = ServerConfig.from_config(config, insecure, any_model_name=True)
    refused = check_binding(sc)
    if refused:
        raise UsageError(refused)
    broker = open_broker(config.broker, config.state_dir, config=config)
    host = socket.gethostname()
    ident = f"gateway-{host}-{sc.port}"
    web = create_gateway_app(broker, sc, config, name=ident)
    record = NodeRecord(id=ident, hostname=host, agent_version=__version__, contract=CONTRACT, os="-", arch="-",
                        backend="gateway", role="gateway", state="ready", endpoint=f"http://{sc.host}:{sc.port}",
                        heartbeat_s=config.heartbeat_s)
    stopping = threading.Event()

    def beat() -> None:  # the record, and the wake-up log the gateway's reader listens on, kept fresh
        executor = web.state.served.executor
        while not stopping.wait(config.heartbeat_s):
            try:
                broker.heartbeat(ident, {"state": "ready"})
                executor.reader.refresh()
            except Exception as exc:  # noqa: BLE001  (a broker blip: the next beat tries again)
                say(f"heartbeat failed: {exc}", "warning")

    broker.register(record)
    log_broker_advice(broker)
    notifier = Notifier()
    alive = Liveness(stale_s=max(5.0, (notifier.watchdog_s or 10.0)))

    @web.on_event("startup")
    async def ticking() -> None:
        import asyncio

        async def tick() -> None:
            while True:
                alive.tick()
                await asyncio.sleep(1.0)

        asyncio.get_running_loop().create_task(tick())
        notifier.ready(f"gateway to {shown(broker.url)} on {sc.host}:{sc.port}")

    def announce() -> None:
        stopping.set()
        notifier.stopping()

    drain = on_signals(lambda: None, also=announce)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            drain()
            super().handle_exit(sig, frame)

    threading.Thread(target=beat, name="gateway-heartbeat", daemon=True).start()
    notifier.start_watchdog(alive)
    say(f"gateway to {shown(broker.url)} on http://{sc.host}:{sc.port}")
    if page_line(config):
        say(page_line(config))
    server = Server(listen_config(web, sc, config.drain_s))
    server.run()
    stopping.set()
    try:
        broker.heartbeat(ident, {"state": "stopped"})
    except Exception:  # noqa: BLE001
        pass
    broker.close()
    say("stopped")
