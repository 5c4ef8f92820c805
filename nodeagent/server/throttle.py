"""Failed sign-ins and bad tokens, counted per client address: past ``limit`` failures within ``window_s`` a wrong
token from that address is answered 429 (with Retry-After) until the oldest failure leaves the window. A guessing
client gets a few tries a minute instead of the server's full speed. The right token always passes: a guesser on
the same host, or behind the same proxy, locks nobody out (``judge``). Counted in this process (each gateway behind
a load balancer counts its own); the address is the connection's, or a trusted proxy's forwarded one
(NODEAGENT_TRUSTED_PROXIES)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable


class Throttle:
    def __init__(self, limit: int = 10, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 most_clients: int = 10_000) -> None:
        self.limit, self.window_s, self.clock, self.most = limit, window_s, clock, most_clients
        self._failures: dict[str, collections.deque] = {}
        self._lock = threading.Lock()

    def wait_s(self, client: str) -> float:
        """0 when ``client`` may try; else the seconds until it may again."""
        with self._lock:
            seen = self._recent(client)
            if len(seen) < self.limit:
                return 0.0
            return max(1.0, seen[0] + self.window_s - self.clock())

    def judge(self, client: str, right: bool) -> float:
        """A token just compared: 0 when it was right (whatever the address's failures), else the failure counted
        and the seconds the address must wait (0 while under the limit: a 401; more: a 429)."""
        if right:
            return 0.0
        wait = self.wait_s(client)
        self.failed(client)
        return wait

    def failed(self, client: str) -> None:
        with self._lock:
            seen = self._recent(client)
            seen.append(self.clock())
            if len(self._failures) > self.most:  # bounded: the clients with no failure left in the window go first
                for key in [k for k, v in self._failures.items() if not v]:
                    del self._failures[key]
                while len(self._failures) > self.most:  # then the oldest entries
                    del self._failures[next(iter(self._failures))]

    def _recent(self, client: str) -> collections.deque:
        seen = self._failures.setdefault(client, collections.deque())
        now = self.clock()
        while seen and now - seen[0] > self.window_s:
            seen.popleft()
        return seen
