"""Heat and throttling during a benchmark: the device's health (``hardware/health.py``) read before and after each
phase, and a Pi firmware's throttle flags since boot at the start and at the end, so a result says whether the
device slowed itself while it was measured (a Pi 4 in a closed case, a MacBook Air after a few minutes of load).

``--cooldown S`` waits S seconds before each phase after the first (as ``llama-bench --delay``), so one phase's
heat does not carry into the next.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

from nodeagent.hardware.health import Health

T = TypeVar("T")


def snapshot(h: Health | None) -> dict[str, Any] | None:
    """The part of a reading a benchmark keeps: temperature, the clock, throttling, thermal pressure, power."""
    if h is None:
        return None
    out = {"temperature_c": h.temperature_c, "cpu_freq_mhz": h.cpu_freq_mhz,
           "cpu_freq_ratio": None if h.cpu_freq_ratio is None else round(h.cpu_freq_ratio, 3),
           "throttling": h.throttling, "pi_flags": h.pi_throttle.raw if h.pi_throttle else None,
           "thermal_pressure": h.thermal_pressure, "on_battery": h.on_battery if h.power_source else None,
           "undervolted": h.undervolted if h.pi_throttle or h.undervolt_alarm is not None else None}
    return {k: v for k, v in out.items() if v is not None}


class Thermal:
    """Readings around each phase of a run; ``read``: a health reading (None: nothing is recorded)."""

    def __init__(self, read: Callable[[], Health] | None, cooldown_s: float = 0.0,
                 progress: Callable[[str], None] = lambda s: None, sleep: Callable[[float], None] = time.sleep
                 ) -> None:
        self.read, self.cooldown_s, self.progress, self.sleep = read, cooldown_s, progress, sleep
        self.phases: list[dict[str, Any]] = []
        self.start = self._read()

    def _read(self) -> Health | None:
        try:
            return self.read() if self.read is not None else None
        except Exception:  # noqa: BLE001  (a reading that fails leaves a gap, not a failed benchmark)
            return None

    def around(self, label: str, phase: Callable[[], T]) -> T:
        """Run one phase between two readings (after the cooldown, for every phase but the first)."""
        if self.phases and self.cooldown_s > 0:
            self.progress(f"cooling down {self.cooldown_s:g} s before: {label}")
            self.sleep(self.cooldown_s)
        before = self._read()
        out = phase()
        after = self._read()
        self.phases.append({"phase": label, "before": snapshot(before), "after": snapshot(after)})
        return out

    def summary(self) -> dict[str, Any]:
        """The readings, the flags since boot at the start and the end, and whether the device throttled during
        the run: a throttle reading before or after any phase, or since-boot flags the run added."""
        end = self._read()
        since = [h.pi_throttle.since_boot if h and h.pi_throttle else None for h in (self.start, end)]
        seen = sorted({t for p in self.phases for k in ("before", "after") for t in
                       ((p[k] or {}).get("throttling") or [])})
        added = sorted(set(since[1] or []) - set(since[0] or []))
        temps = [p[k]["temperature_c"] for p in self.phases for k in ("before", "after")
                 if p[k] and "temperature_c" in p[k]]
        return {"cooldown_s": self.cooldown_s, "start": snapshot(self.start), "end": snapshot(end),
                "since_boot": {"start": since[0], "end": since[1]},
                "throttled_during_run": bool(seen or added) if (self.start is not None) else None,
                "throttling_seen": sorted(set(seen) | set(added)),
                "temperature_c": {"min": min(temps), "max": max(temps)} if temps else None,
                "phases": self.phases}


def words(thermal: dict[str, Any] | None) -> str:
    """One line for the summary table."""
    if not thermal or thermal.get("throttled_during_run") is None:
        return "not read on this device"
    t = thermal.get("temperature_c")
    temps = ("no temperature read" if not t else f"{t['min']:g} °C" if t["min"] == t["max"] else
             f"{t['min']:g}-{t['max']:g} °C")
    if thermal["throttled_during_run"]:
        return f"THROTTLED during the run ({', '.join(thermal['throttling_seen'])}); {temps}"
    since = thermal["since_boot"]["end"]
    return f"none seen; {temps}" + (f" (since boot: {', '.join(since)})" if since else "")
