"""How a long-running command stops: SIGTERM and SIGINT start its drain on a thread of its own."""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable


def on_signals(stop: Callable[[], Any], also: Callable[[], Any] | None = None) -> Callable[..., None]:
    """SIGTERM and SIGINT call ``stop`` (a drain), from a thread of its own: a drain writes to the broker, and
    the interrupted main thread may be inside a transaction on its own connection. ``also``: called first,
    on the signal's own thread (it must not block). Returns the handler (a server's exit calls it too)."""

    def handler(*_: Any) -> None:
        if also is not None:
            also()
        threading.Thread(target=stop, name="drain", daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return handler
