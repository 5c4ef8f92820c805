"""What the machine's other work takes: CPU used by processes other than this one, and memory in use.

psutil's CPU percentage is measured between two calls, so one sampler serves every reader (the guard, the
thread governor): a reading younger than ``max_age_s`` is shared, an older one starts a new interval.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

_lock = threading.Lock()
_last: tuple[float, float] | None = None  # (when, other processes' CPU %)


@functools.lru_cache(maxsize=1)
def _me() -> Any:
    import psutil

    return psutil.Process()


def other_cpu_pct(max_age_s: float = 0.5) -> float:
    """CPU used by other processes since the previous reading, in % of the whole machine."""
    global _last
    import psutil

    with _lock:
        now = time.monotonic()
        if _last is not None and now - _last[0] < max_age_s:
            return _last[1]
        total = psutil.cpu_percent(interval=None)
        own = _me().cpu_percent(interval=None) / (psutil.cpu_count() or 1)
        # the first reading of each counts from different moments (psutil's import, this call): not a reading
        _last = (now, max(0.0, total - own) if _last is not None else 0.0)
        return _last[1]


def memory_pct() -> float:
    import psutil

    return float(psutil.virtual_memory().percent)


def cpu_count() -> int:
    import psutil

    return psutil.cpu_count() or 1
