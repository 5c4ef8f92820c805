"""systemd's notify protocol, spoken directly over ``$NOTIFY_SOCKET`` (a unix datagram socket): READY=1 once
the model is loaded, WATCHDOG=1 at half of ``WatchdogSec`` while the process is alive, STOPPING=1 when it
drains. Without ``NOTIFY_SOCKET`` (not under systemd) every call does nothing."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable, Mapping

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET") or ""
        self.address = "\0" + addr[1:] if addr.startswith("@") else addr  # '@' is the abstract namespace
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and mine else None
        self._stop = threading.Event()

    def send(self, message: str) -> bool:
        if not self.address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.connect(self.address)
                s.sendall(message.encode())
            return True
        except OSError as exc:
            log.warning("could not notify systemd (%s): %s", self.address, exc)
            return False

    def ready(self, status: str = "") -> None:
        self.send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def stopping(self) -> None:
        self._stop.set()
        self.send("STOPPING=1")

    def start_watchdog(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Ping at half the watchdog period while ``alive()``; a hung process stops pinging and is restarted."""
        if self.watchdog_s is None or not self.address:
            return
        period = self.watchdog_s / 2

        def loop() -> None:
            while not self._stop.wait(period):
                if alive():
                    self.send("WATCHDOG=1")

        threading.Thread(target=loop, name="watchdog", daemon=True).start()


class Liveness:
    """Alive while something (the server's event loop, the worker loop) has ticked recently."""

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self.last = time.monotonic()

    def tick(self) -> None:
        self.last = time.monotonic()

    def __call__(self) -> bool:
        return time.monotonic() - self.last < self.stale_s
