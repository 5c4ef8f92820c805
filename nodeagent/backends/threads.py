"""How many threads the next llama_decode uses: the plan's while the cores are free, fewer while other
processes hold some of them.

llama.cpp's CPU backend here runs its threads as an OpenMP team, and every step waits for its slowest thread:
a thread whose core another process took holds up the whole step. In benchmarks/results/contention.md one busy
process on one of 2 cores made a 2-thread worker several times slower, while one thread was hardly slower under
contention but cost over a quarter on a quiet machine. So while other processes use about a core or more, the
governor gives that many threads up, and takes them back when the cores are free again.
"""

from __future__ import annotations

import time
from typing import Callable


class ThreadGovernor:
    def __init__(self, threads: int, cores: int, other_cpu_pct: Callable[[], float], every_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threads, self.cores, self.read, self.every_s, self.clock = threads, cores, other_cpu_pct, every_s, clock
        self.current = threads
        self.busy_cores = 0.0
        self.read()  # the first reading starts the interval the next one measures
        self._at: float | None = None

    def __call__(self) -> int:
        """The threads for the next step (sampled at most every ``every_s``)."""
        now = self.clock()
        if self._at is None or now - self._at >= self.every_s:
            self._at = now
            busy_cores = self.read() / 100 * self.cores  # what the other processes hold
            free = self.cores - busy_cores
            self.current = max(1, min(self.threads, int(free + 0.5)))  # half a core taken or more: one fewer
            self.busy_cores = busy_cores
        return self.current
