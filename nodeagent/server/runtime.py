"""One serving runtime for `serve` and `gateway` (as vLLM's one ``serve_http`` for every entrypoint): what runs
around an app, whichever door it is.

- ``serve_http``: the notify protocol (READY once the app has started, STATUS= as the state changes, STOPPING
  on a signal, WATCHDOG pings while the event loop is alive and the work behind the door is), SIGTERM and SIGINT
  starting the drain, uvicorn on the transport's settings (``transport.py``), until the server has shut down.
- ``every``: a function on a thread of its own every so often while the app runs (a failure is logged, not
  fatal): the one way the server's periodic work is run (the batch sweep, the model reaper, the gateway's
  heartbeat and its ``Purge``; a worker, which has no app, calls the same ``Purge`` from its heartbeat loop).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)


def every(app: Any, period_s: float, fn: Callable[[], Any], name: str) -> None:
    """``fn`` on a thread of its own every ``period_s`` while ``app`` runs (a failure is logged, not fatal)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(period_s):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                log.warning("%s failed: %s", name, exc)

    app.on_event("startup")(lambda: threading.Thread(target=loop, name=name, daemon=True).start())
    app.on_event("shutdown")(stop.set)


@dataclass(frozen=True)
class Work:
    """What runs behind the door, as the runtime needs to know it: the line READY carries, what starts it once
    signals are handled, what a signal stops (a drain: on a thread of its own), the state STATUS= reports, and
    whether it is alive (False: the watchdog's pings stop, and the service manager restarts the process)."""

    ready: str
    begin: Callable[[], Any] = lambda: None
    stop: Callable[[], Any] = lambda: None
    status: Callable[[], str] | None = None
    alive: Callable[[], bool] = lambda: True


def serve_http(web: Any, config: Any, drain_s: float, work: Work) -> None:
    """Serve ``web`` on ``config``'s address (a ServerConfig) until a signal's drain and uvicorn's graceful
    shutdown have ended (``drain_s`` bounds the wait for requests in flight)."""
    import uvicorn

    from nodeagent.server.transport import listen_config
    from nodeagent.service.notify import Liveness, Notifier
    from nodeagent.service.signals import on_signals

    notifier = Notifier()
    alive = Liveness(stale_s=max(5.0, (notifier.watchdog_s or 10.0)))
    stopping = threading.Event()

    async def tick() -> None:
        said = "serving"  # what READY says: STATUS= is sent when the state differs
        while True:  # the event loop is alive while this runs: the watchdog pings only then
            if work.alive() or stopping.is_set():
                alive.tick()
            now = work.status() if work.status is not None else None
            if now is not None and now != said:
                notifier.send(f"STATUS={now}")
                said = now
            await asyncio.sleep(1.0)

    @web.on_event("startup")
    async def ticking() -> None:
        asyncio.get_running_loop().create_task(tick())
        notifier.ready(work.ready)

    def announce() -> None:
        stopping.set()
        notifier.stopping()

    # our handler is what uvicorn restores and re-raises into after its graceful shutdown: no hard exit
    drain = on_signals(work.stop, also=announce)
    work.begin()

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            drain()
            super().handle_exit(sig, frame)

    notifier.start_watchdog(alive)
    Server(listen_config(web, config, drain_s)).run()
