"""The jobs RQ runs in benchmarks/fleet_queue.py: the same no-op and 100 ms tasks the nodeagent workers get."""

import time


def noop() -> None:
    return None


def sleep_ms(ms: int) -> None:
    time.sleep(ms / 1000)
