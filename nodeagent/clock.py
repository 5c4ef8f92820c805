"""The clocks nodeagent measures time on, each for one purpose:

- **the broker's time**: every instant the fleet compares (a lease, a deadline, a retry's due time, a heartbeat,
  the scheduler's leader lease, a batch's expiry) is stamped and compared on the broker's clock, never on the
  clock of whichever node writes or reads it. Redis: the server's ``TIME``. SQLite: the host clock below,
  anchored to the wall clock once per boot (``broker/sqlite/connection.py``). Python code reads it through ``BrokerClock``:
  one round trip now and then, a monotonic offset in between;
- **the host clock** (``host_clock``): seconds on a clock every process of the host shares and that no wall-clock
  step moves: ``CLOCK_BOOTTIME`` on Linux, ``CLOCK_MONOTONIC`` on macOS (``mach_continuous_time``: it counts
  sleep), with the boot it belongs to. The SQLite engine measures leases, retry delays and heartbeat ages on it;
- **a duration inside one process**: ``time.monotonic()``;
- **a node's wall clock** is only ever shown, with its offset from the broker's (measured at every heartbeat).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)
REFRESH_S = 30.0  # how often BrokerClock reads the broker's time again


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    """This boot's identity: Linux's boot_id, macOS's boot time; "wall" where neither can be read (the host clock
    is then the wall clock, and said so)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            import ctypes
            import ctypes.util

            class Timeval(ctypes.Structure):
                _fields_ = [("sec", ctypes.c_long), ("usec", ctypes.c_int32)]

            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            tv, size = Timeval(), ctypes.c_size_t(ctypes.sizeof(Timeval))
            if libc.sysctlbyname(b"kern.boottime", ctypes.byref(tv), ctypes.byref(size), None, 0) == 0:
                return f"darwin-{tv.sec}"
        except (OSError, AttributeError):
            pass
    log.warning("this host's boot cannot be told apart (no boot_id): the queue's leases are measured on the wall "
                "clock, which a clock step moves")
    return "wall"


def _host_seconds() -> Callable[[], float]:
    if boot_id() == "wall":
        return time.time
    clock = getattr(time, "CLOCK_BOOTTIME", None) if sys.platform.startswith("linux") else \
        getattr(time, "CLOCK_MONOTONIC", None)
    if clock is None:
        return time.time
    return functools.partial(time.clock_gettime, clock)


_host = _host_seconds()


def host_clock() -> tuple[str, float]:
    """(this boot, seconds on the host clock): shared by every process of the host, never stepped."""
    return boot_id(), _host()


class BrokerClock:
    """The broker's time, read through a cache: ``read`` (one round trip to the broker) now and then, and the
    local monotonic clock in between, so asking costs nothing. ``offset_s`` is this process's wall clock less the
    broker's, from the last reading."""

    def __init__(self, read: Callable[[], float], refresh_s: float = REFRESH_S) -> None:
        self._read, self.refresh_s = read, refresh_s
        self._lock = threading.Lock()
        self._at: tuple[float, float] | None = None  # (the broker's time, local monotonic then)
        self.offset_s = 0.0

    def now(self) -> float:
        at = self._at
        mono = time.monotonic()
        if at is None or mono - at[1] > self.refresh_s:
            return self.sample()
        return at[0] + (mono - at[1])

    def sample(self) -> float:
        """Read the broker's time now (and this process's offset from it)."""
        with self._lock:
            wall0, mono0 = time.time(), time.monotonic()
            broker = self._read()
            wall1, mono1 = time.time(), time.monotonic()
            half = (mono1 - mono0) / 2  # the reading stands for the middle of the round trip
            self._at = (broker + half, mono1)
            self.offset_s = (wall0 + wall1) / 2 - broker
            return broker + half


def pause(seconds: float) -> None:
    """Sleep, on a condition variable (``time.sleep``'s absolute-deadline ``clock_nanosleep`` is what libfaketime,
    which the clock tests run nodes under, fails with EINVAL)."""
    if seconds > 0:
        threading.Event().wait(seconds)


def wall_synced() -> bool | None:
    """Whether the kernel says the wall clock is synchronised (NTP): adjtimex on Linux, ntp_adjtime on macOS;
    None where it cannot be asked."""
    import ctypes

    call = _adjtime()
    if call is None:
        return None
    buf = ctypes.create_string_buffer(1024)  # struct timex, modes 0: a reading
    try:
        state = call(buf)
    except OSError:
        return None
    return None if state < 0 else state != 5  # TIME_ERROR: not synchronised


@functools.lru_cache(maxsize=1)
def _adjtime() -> Callable[..., int] | None:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return getattr(libc, "adjtimex", None) or getattr(libc, "ntp_adjtime", None)
