"""The device's health for Prometheus and for /readyz: a collector of gauges read at scrape time from a node's
guard (its last health reading and its decisions) or, where there is no guard (``serve`` without a broker), from
a health reader; and ``readiness``: why the node is not ready, in words.

The gauges (a value this platform does not offer has no sample, never a made-up 0):

- ``nodeagent_temperature_celsius``: the hottest CPU thermal zone (Linux);
- ``nodeagent_throttled``: 1 while a Pi's firmware caps, throttles or holds the soft temperature limit, or macOS
  thermal pressure is above nominal; 0 otherwise;
- ``nodeagent_cpu_freq_ratio``: the CPU's clock now over its maximum (an idle governor lowers it too);
- ``nodeagent_on_battery``, ``nodeagent_battery_pct``;
- ``nodeagent_memory_pressure``: 0 normal, 1 warn, 2 critical (macOS's level; Linux's from PSI by the guard's
  thresholds);
- ``nodeagent_psi_memory_full_avg10``: the share (%) of the last 10 s every task waited for memory (Linux);
- ``nodeagent_undervolted``: 1 while a Pi is under-volted;
- ``nodeagent_health_pause{cause}``: 1 for what the guard has the node paused for now (heat, battery, pressure).

The server registers ``HealthCollector(guard)`` on its registry (``registry.register(...)``) and adds
``readiness(guard)`` to /readyz's facts, failing it while the answer is not None.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from nodeagent.config import default_of
from nodeagent.hardware.health import Health, memory_level

PRESSURE_VALUE = {"normal": 0.0, "warn": 1.0, "critical": 2.0}
HEALTH_PAUSES = ("heat", "battery", "pressure")


class HealthCollector:
    """Health gauges from ``guard`` (a ``fleet.guard.Guard``: its last reading, refreshed when stale) or, without
    one, from ``read`` (a fresh reading each scrape: ``HealthReader.read``)."""

    def __init__(self, guard: Any = None, read: Callable[[], Health] | None = None) -> None:
        if guard is None and read is None:
            raise ValueError("a health collector needs a guard or a health reader")
        self.guard, self.read = guard, read

    def _reading(self) -> tuple[Health | None, str | None, str | None]:
        """(the health reading, the memory pressure level, what the node is paused for)."""
        if self.guard is not None:
            status = self.guard.status()  # refreshes a stale reading
            h = self.guard.health
            return h, status.get("memory_pressure"), status.get("pause")
        assert self.read is not None
        h = self.read()
        return h, memory_level(h, default_of("guard_psi_some_pct"), default_of("guard_psi_full_pct")), None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            h, pressure, pause = self._reading()
        except Exception:  # noqa: BLE001  (a reading that fails must not break the scrape)
            h, pressure, pause = None, None, None

        def gauge(name: str, doc: str, value: float | bool | None) -> Iterator[Any]:
            g = GaugeMetricFamily(name, doc)
            if value is not None:
                g.add_metric([], float(value))
            yield g

        throttling = h.throttling if h else None
        yield from gauge("nodeagent_temperature_celsius", "The hottest CPU thermal zone (degrees Celsius)",
                         h.temperature_c if h else None)
        yield from gauge("nodeagent_throttled", "1 while the CPU is capped, throttled or at its soft temperature "
                                                "limit (Pi), or under thermal pressure (macOS)",
                         None if throttling is None else bool(throttling))
        yield from gauge("nodeagent_cpu_freq_ratio", "The CPU's clock now over its maximum",
                         h.cpu_freq_ratio if h else None)
        yield from gauge("nodeagent_on_battery", "1 on battery power, 0 on mains",
                         h.on_battery if h and h.power_source else None)
        yield from gauge("nodeagent_battery_pct", "The battery's charge (%)", h.battery_pct if h else None)
        yield from gauge("nodeagent_memory_pressure", "Memory pressure: 0 normal, 1 warn, 2 critical",
                         PRESSURE_VALUE.get(pressure or ""))
        yield from gauge("nodeagent_psi_memory_full_avg10", "Share (%) of the last 10 s every task waited for memory",
                         h.psi_memory_full_avg10 if h else None)
        yield from gauge("nodeagent_undervolted", "1 while a Raspberry Pi is under-volted",
                         h.undervolted if h and (h.pi_throttle or h.undervolt_alarm is not None) else None)
        g = GaugeMetricFamily("nodeagent_health_pause", "1 for what the guard has the node paused for now",
                              labels=["cause"])
        if self.guard is not None:
            for cause in HEALTH_PAUSES:
                g.add_metric([cause], 1.0 if pause == cause else 0.0)
        yield g


def readiness(guard: Any) -> str | None:
    """Why the node is not ready, in words (``paused: heat: 84.5 °C >= 85 °C``, ``paused: battery: ...``,
    ``paused: pressure: ...``, ``unhealthy: error rate ...``), or None when its guard lets it claim (or there
    is no guard)."""
    if guard is None or guard.state == "ok":
        return None
    return f"{guard.state}: {guard.reason}" if guard.reason else guard.state
