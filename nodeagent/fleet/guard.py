"""The guard (the "panic filter"): a node protects itself and the fleet.

- It stops claiming while host memory use is above ``memory_pct`` (85 %) or the CPU time of *other*
  processes is above ``cpu_pct`` (90 %): this node's own inference is not counted, or every task would pause
  the node after it. A pause for CPU lasts at most ``cpu_pause_max_s`` (60 s): then the node serves on until
  that CPU use has dropped once (on a machine that is always busy a node must not starve); memory pressure
  has no such limit.
- The operator may hold the node (``hold``; the page's control, ``fleet/controls.py``): it claims nothing until
  let go, whatever the readings say; what it runs finishes.
- It marks the node unhealthy when the error rate over a sliding window (the last ``window_s``, at least
  ``min_samples`` outcomes) exceeds ``error_rate`` (15 %); an unhealthy node claims nothing for ``cooldown_s``,
  then one task as a probe: a success makes it healthy again.
- After ``alert_after`` (3) consecutive failures it raises an alert: a structured log event on the
  ``nodeagent.alert`` logger and, when configured, a JSON POST to a webhook.

It acts on the device's health (``hardware/health.py``, read every ``health_every_s``), by the policy settings:

- **Heat**: it stops claiming at a Pi's soft temperature limit or throttle flag (a throttle that comes with
  under-voltage is the supply's, not heat: an alert), at a temperature at or above ``temp_c`` (85 degrees C), or at
  macOS thermal pressure ``thermal_pressure`` (heavy) or above; it claims again only once the flags are clear, the
  temperature is ``cool_c`` (10) degrees under the limit and the pressure below the level, and not before
  ``heat_pause_s`` (60 s) from the start of the pause.
- **Battery**: ``on_battery`` serve (as on mains), pause (below ``battery_min_pct``, 30 %; claims again on mains or
  5 points above it) or drain (claims nothing on battery at all; the tasks in hand finish).
- **Memory pressure**: at warn (macOS's level; on Linux PSI memory ``some avg10`` at ``psi_some_pct``) the model set
  loads no further model and unloads its idle ones (``hold_models``, which ``modelset.py`` asks); at critical
  (macOS; on Linux PSI ``full avg10`` at ``psi_full_pct``) it stops claiming.
- **Under-voltage** (a Pi's flag or the rpi_volt alarm; once at start for one since boot): an alert, not a pause.

``status()`` carries the decision, what it rests on (temperature, throttling, the clock's ratio, battery,
pressure) and the health reading itself under ``health``: the worker puts it in the node record at every
heartbeat (``guard_status``), where `nodeagent status` and the scheduler read it.

Readings, health and the clock are injected, so the thresholds are tested with made-up readings and recorded
machines. Every change of state is logged with its reason and kept in ``events`` for ``nodeagent status``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections import deque
from typing import Any, Callable, Literal

from pydantic import Field

from nodeagent.config import NodeConfig, default_of
from nodeagent.hardware.health import THERMAL_LEVELS, Health, memory_level
from nodeagent.values import Frozen

log = logging.getLogger(__name__)
alert_log = logging.getLogger("nodeagent.alert")
GuardState = Literal["ok", "paused", "unhealthy"]
BATTERY_RESUME_PCT = 5.0  # a pause for a low battery ends this many points above the threshold (or on mains)
FREQ_WINDOW_S = 60.0  # the clock's ratio is the highest of this long's readings (an idle governor lowers it too)


class Readings(Frozen):
    memory_pct: float
    cpu_pct: float = Field(description="CPU use by processes other than this one, % of the machine")


class GuardConfig(Frozen):
    """The thresholds that are settings take their one default when left out (a test's config);
    ``from_config`` takes them from the resolved settings. The rest are the guard's own constants."""

    memory_pct: float = Field(default_factory=lambda: default_of("guard_memory_pct"))
    cpu_pct: float = Field(default_factory=lambda: default_of("guard_cpu_pct"))
    error_rate: float = Field(default_factory=lambda: default_of("guard_error_rate"))
    window_s: float = 300.0
    min_samples: int = 10
    alert_after: int = 3
    cooldown_s: float = 60.0
    cpu_pause_max_s: float = Field(60.0, description="A pause for other processes' CPU lasts at most this long; then "
                                                     "the node serves on until that CPU use has dropped once")
    webhook: str | None = Field(default_factory=lambda: default_of("alert_webhook"))
    sample_every_s: float = Field(0.5, description="Readings are taken at most this often (a claim is the hot "
                                                   "path: a reading costs ~80 us)")
    temp_c: float = Field(default_factory=lambda: default_of("guard_temp_c"))
    cool_c: float = Field(default_factory=lambda: default_of("guard_cool_c"))
    heat_pause_s: float = Field(default_factory=lambda: default_of("guard_heat_pause_s"))
    thermal_pressure: str = Field(default_factory=lambda: default_of("guard_thermal_pressure"))
    on_battery: str = Field(default_factory=lambda: default_of("on_battery"))
    battery_min_pct: float = Field(default_factory=lambda: default_of("battery_min_pct"))
    psi_some_pct: float = Field(default_factory=lambda: default_of("guard_psi_some_pct"))
    psi_full_pct: float = Field(default_factory=lambda: default_of("guard_psi_full_pct"))
    health_every_s: float = Field(5.0, description="The device's health is read at most this often (a few "
                                                   "sysfs files or sysctls: about a millisecond)")

    @classmethod
    def from_config(cls, config: NodeConfig) -> "GuardConfig":
        return cls(memory_pct=config.guard_memory_pct, cpu_pct=config.guard_cpu_pct,
                   error_rate=config.guard_error_rate, webhook=config.alert_webhook, temp_c=config.guard_temp_c,
                   cool_c=config.guard_cool_c, heat_pause_s=config.guard_heat_pause_s,
                   thermal_pressure=config.guard_thermal_pressure, on_battery=config.on_battery,
                   battery_min_pct=config.battery_min_pct, psi_some_pct=config.guard_psi_some_pct,
                   psi_full_pct=config.guard_psi_full_pct)


def system_readings() -> Readings:
    """Memory in use, and the CPU other processes took since the last reading."""
    from nodeagent import hostload

    return Readings(memory_pct=hostload.memory_pct(), cpu_pct=hostload.other_cpu_pct())


def guard_for(config: NodeConfig, node_id: str) -> "Guard":
    """A worker's guard from the resolved settings, reading this machine's health, or the recorded machine's
    when ``NODEAGENT_HARDWARE_FIXTURE`` names one (the probe and the guard see the same machine)."""
    from nodeagent.hardware.health import reader_for

    return Guard(GuardConfig.from_config(config), node_id=node_id, health=reader_for(config.hardware_fixture).read)


class Guard:
    def __init__(self, config: GuardConfig | None = None, read: Callable[[], Readings] = system_readings,
                 clock: Callable[[], float] = time.monotonic, post: Callable[[str, dict], None] | None = None,
                 node_id: str = "", health: Callable[[], Health] | None = None) -> None:
        """``health``: a reading of the device's health (``hardware/health.py``); None: no health policies (the
        memory, CPU and error-rate ones alone)."""
        self.config = config or GuardConfig()
        self.read, self.clock = read, clock
        self.health_read = health
        self.health: Health | None = None
        self.pause: str | None = None  # what the node is paused for: operator, memory, pressure, heat, battery, cpu
        self.operator: str | None = None  # why the operator holds the node (fleet/controls.py), or None
        self.hold_reason: str | None = None  # why the model set loads no further model (memory pressure warn)
        self._health_at = 0.0
        self._hot_since: float | None = None  # a pause for heat began
        self._battery_low = False
        self._undervolted = False
        self._freqs: deque[tuple[float, float]] = deque()  # (when, the clock's ratio)
        self.post = post or _post_json
        self.node_id = node_id
        self.state: GuardState = "ok"
        self.reason = ""
        self.outcomes: deque[tuple[float, bool]] = deque()
        self.consecutive_failures = 0
        self.unhealthy_since: float | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=50)
        self._lock = threading.Lock()
        self._reading: Readings | None = None
        self._read_at = 0.0
        self._cpu_since: float | None = None  # when other processes' CPU went over the threshold
        self._cpu_waived = False  # paused for it as long as allowed: serving on until it drops

    # -- claiming ------------------------------------------------------------------------------------------
    def may_claim(self) -> bool:
        """Whether to claim a task now; takes fresh readings."""
        with self._lock:
            now = self.clock()
            if self.state == "unhealthy":
                assert self.unhealthy_since is not None
                return now - self.unhealthy_since >= self.config.cooldown_s  # then one probe task
            c = self.config
            if self._reading is None or now - self._read_at >= c.sample_every_s:
                self._reading, self._read_at = self.read(), now
            r = self._reading
            if self.operator is not None:  # the operator's hold outranks every reading
                self._set("paused", self.operator, "operator")
                return False
            held = self._health_pause(now)
            busy = r.cpu_pct > c.cpu_pct
            if not busy:
                self._cpu_since, self._cpu_waived = None, False
            elif self._cpu_since is None:
                self._cpu_since = now
            if r.memory_pct > c.memory_pct:
                self._set("paused", f"memory {r.memory_pct:.0f}% > {c.memory_pct:.0f}%", "memory")
            elif held is not None:
                self._set("paused", held[1], held[0])
            elif busy and not self._cpu_waived and now - self._cpu_since < c.cpu_pause_max_s:
                self._set("paused", f"CPU (other processes) {r.cpu_pct:.0f}% > {c.cpu_pct:.0f}%", "cpu")
            elif busy:  # never starved: after the longest pause, serve on until the other work lets up once
                self._cpu_waived = True
                self._set("ok", f"CPU (other processes) {r.cpu_pct:.0f}% > {c.cpu_pct:.0f}% for over "
                                f"{c.cpu_pause_max_s:g} s: serving anyway")
            else:
                self._set("ok", "")
            return self.state == "ok"

    def hold(self, reason: str | None) -> None:
        """The operator holds the node (``reason``: who and why) or lets it go (None): it claims nothing while
        held; what it runs finishes."""
        with self._lock:
            self.operator = reason
            if reason is None and self.pause == "operator":
                self._set("ok", "resumed by the operator")

    # -- the device's health -------------------------------------------------------------------------------
    def hold_models(self) -> str | None:
        """Why the model set should load no further model and unload its idle ones (memory pressure at warn, or
        worse), or None; the model set asks it before each load and at each reap (``modelset.py``)."""
        return self.hold_reason

    def _refresh_health(self, now: float) -> Health | None:
        """A fresh reading when the last is over ``health_every_s`` old; under-voltage alerts on its way in."""
        if self.health_read is None:
            return None
        if self.health is not None and now - self._health_at < self.config.health_every_s:
            return self.health
        first = self.health is None
        try:
            h = self.health_read()
        except Exception as exc:  # noqa: BLE001  (a reading that fails is no reason to stop serving)
            log.warning("guard: reading the device's health failed: %s: %s", type(exc).__name__, exc)
            return self.health
        self.health, self._health_at = h, now
        if h.undervolted and not self._undervolted:
            self._alert("under-voltage", "the power supply cannot hold the voltage: the firmware may throttle and "
                                         "SD cards corrupt under it; use a supply rated for the board")
        elif first and h.pi_throttle and "under-voltage" in h.pi_throttle.since_boot and not h.undervolted:
            self._alert("under-voltage since boot", f"the firmware's flags {h.pi_throttle.raw}: the supply "
                                                    "dropped below its voltage at some time since boot")
        self._undervolted = h.undervolted
        ratio = h.cpu_freq_ratio
        if ratio is not None:
            self._freqs.append((now, ratio))
        while self._freqs and self._freqs[0][0] < now - FREQ_WINDOW_S:
            self._freqs.popleft()
        hold = self._pressure_hold(h)
        if hold != self.hold_reason:
            self._event("hold models" if hold else "load models", hold or "memory pressure eased")
            log.log(logging.WARNING if hold else logging.INFO, "guard: %s", hold or "memory pressure eased: "
                                                                                   "models may load again")
            self.hold_reason = hold
        return h

    def memory_pressure(self, h: Health | None = None) -> str | None:
        """normal, warn or critical: macOS's level, or on Linux from pressure stall information (PSI full avg10
        at ``psi_full_pct`` is critical, some avg10 at ``psi_some_pct`` warn); None where neither is read."""
        h = h if h is not None else self.health
        return None if h is None else memory_level(h, self.config.psi_some_pct, self.config.psi_full_pct)

    def _pressure_words(self, h: Health) -> str:
        if h.memory_pressure is not None:
            return f"memory pressure {h.memory_pressure} (macOS)"
        return (f"memory pressure {self.memory_pressure(h)} (PSI memory some {h.psi_memory_some_avg10:g} %, full "
                f"{h.psi_memory_full_avg10:g} % of the last 10 s)")

    def _pressure_hold(self, h: Health) -> str | None:
        level = self.memory_pressure(h)
        if level in ("warn", "critical"):
            return f"{self._pressure_words(h)}: no further model is loaded, idle ones are unloaded"
        return None

    def _hot(self, h: Health) -> list[str]:
        """What says the device is too hot now."""
        c = self.config
        why = []
        flags = h.pi_throttle.now if h.pi_throttle else []
        if "soft temperature limit" in flags:
            why.append("the Pi's soft temperature limit")
        if "throttled" in flags and "under-voltage" not in flags:
            why.append("the Pi's firmware throttles")
        if h.temperature_c is not None and h.temperature_c >= c.temp_c:
            why.append(f"{h.temperature_c:.1f} °C >= {c.temp_c:g} °C")
        if h.thermal_pressure is not None and \
                THERMAL_LEVELS.index(h.thermal_pressure) >= THERMAL_LEVELS.index(c.thermal_pressure):  # type: ignore[arg-type]
            why.append(f"thermal pressure {h.thermal_pressure}")
        return why

    def _heat(self, h: Health, now: float) -> str | None:
        """The reason of a pause for heat, with its hysteresis: on while hot; then on until the flags are clear,
        the temperature is ``cool_c`` under the limit and ``heat_pause_s`` has passed since the pause began."""
        c = self.config
        hot = self._hot(h)
        if hot:
            if self._hot_since is None:
                self._hot_since = now
            return "heat: " + ", ".join(hot)
        if self._hot_since is None:
            return None
        resume_c = c.temp_c - c.cool_c
        cool = h.temperature_c is None or h.temperature_c <= resume_c
        left = c.heat_pause_s - (now - self._hot_since)
        if cool and left <= 0:
            self._hot_since = None
            return None
        waits = ([f"{h.temperature_c:.1f} °C, claims again at {resume_c:g} °C"] if not cool else []) + \
            ([f"at least {left:.0f} s more"] if left > 0 else [])
        return "heat: cooling down (" + ", ".join(waits) + ")"

    def _battery(self, h: Health) -> str | None:
        c = self.config
        if not h.on_battery or c.on_battery == "serve":
            self._battery_low = False
            return None
        if c.on_battery == "drain":
            return "battery: on battery power (NODEAGENT_ON_BATTERY=drain)"
        pct = h.battery_pct
        if pct is None:
            return None
        low = pct < c.battery_min_pct or (self._battery_low and pct < c.battery_min_pct + BATTERY_RESUME_PCT)
        self._battery_low = low
        if not low:
            return None
        return (f"battery: on battery at {pct:.0f} % < {c.battery_min_pct:g} %" if pct < c.battery_min_pct else
                f"battery: on battery at {pct:.0f} %, claims again at {c.battery_min_pct + BATTERY_RESUME_PCT:g} % "
                "or on mains")

    def _health_pause(self, now: float) -> tuple[str, str] | None:
        """(what, why) the device's health pauses the node for: memory pressure critical, heat, battery."""
        h = self._refresh_health(now)
        if h is None:
            return None
        if self.memory_pressure(h) == "critical":
            self._heat(h, now)  # its hysteresis keeps running underneath
            return "pressure", f"pressure: {self._pressure_words(h)}"
        heat = self._heat(h, now)
        if heat:
            return "heat", heat
        battery = self._battery(h)
        if battery:
            return "battery", battery
        return None

    def freq_ratio(self) -> float | None:
        """The CPU's clock against its maximum as the scheduler should derate the node by: the highest reading of
        the last minute (a busy node runs at the clock it is allowed; an idle governor's low clock is not a
        throttle), while the device is throttled, capped or near its limit; 1.0 otherwise; None with no reading."""
        h = self.health
        if h is None or not self._freqs:
            return None
        flags = h.pi_throttle.now if h.pi_throttle else []
        near = (h.temperature_c is not None and h.temperature_c >= self.config.temp_c - self.config.cool_c)
        if self.pause == "heat" or near or any(f in flags for f in ("frequency capped", "throttled",
                                                                    "soft temperature limit")):
            return round(max(r for _, r in self._freqs), 3)
        return 1.0

    def thermal(self) -> str | None:
        """hot (paused for heat), warm (within ``cool_c`` of the limit, the clock capped, or macOS moderate
        pressure), cool, or None where nothing about heat is read."""
        h = self.health
        if h is None:
            return None
        if self.pause == "heat" or self._hot_since is not None:
            return "hot"
        flags = h.pi_throttle.now if h.pi_throttle else []
        if (h.temperature_c is not None and h.temperature_c >= self.config.temp_c - self.config.cool_c) \
                or "frequency capped" in flags or h.thermal_pressure not in (None, "nominal"):
            return "warm"
        if h.temperature_c is None and h.thermal_pressure is None and h.pi_throttle is None:
            return None
        return "cool"

    # -- outcomes ------------------------------------------------------------------------------------------
    def record(self, ok: bool, detail: str = "") -> None:
        with self._lock:
            now = self.clock()
            c = self.config
            self.outcomes.append((now, ok))
            while self.outcomes and self.outcomes[0][0] < now - c.window_s:
                self.outcomes.popleft()
            self.consecutive_failures = 0 if ok else self.consecutive_failures + 1
            if self.consecutive_failures == c.alert_after:
                self._alert(f"{c.alert_after} consecutive task failures", detail)
            if self.state == "unhealthy":
                if ok:  # the probe succeeded
                    self.outcomes.clear()
                    self.unhealthy_since = None
                    self._set("ok", "a probe task succeeded")
                else:
                    self.unhealthy_since = now
                return
            failures = sum(1 for _, good in self.outcomes if not good)
            rate = failures / len(self.outcomes)
            if len(self.outcomes) >= c.min_samples and rate > c.error_rate:
                self.unhealthy_since = now
                self._set("unhealthy", f"error rate {rate:.0%} over the last {len(self.outcomes)} tasks "
                                       f"> {c.error_rate:.0%}")

    def error_rate(self) -> float:
        with self._lock:
            return (sum(1 for _, ok in self.outcomes if not ok) / len(self.outcomes)) if self.outcomes else 0.0

    def status(self) -> dict[str, Any]:
        """The guard's state for the node record (``guard_status``): the decision and its reason, what it rests
        on, and under ``health`` the last health reading (its fields that were read; no storage)."""
        with self._lock:
            self._refresh_health(self.clock())
            h = self.health
            return {"state": self.state, "reason": self.reason, "error_rate": round(self._rate(), 3),
                    "consecutive_failures": self.consecutive_failures, "events": list(self.events)[-5:],
                    "pause": self.pause if self.state == "paused" else None, "hold_models": self.hold_reason,
                    "thermal": self.thermal(), "temperature_c": h.temperature_c if h else None,
                    "throttled": h.throttling if h else None,
                    "freq_ratio": self.freq_ratio(), "undervolted": h.undervolted if h else None,
                    "on_battery": h.on_battery if h and h.power_source else None,
                    "battery_pct": h.battery_pct if h else None, "memory_pressure": self.memory_pressure(),
                    "health": h.model_dump(mode="json", exclude_none=True, exclude={"storage"}) if h else None}

    # -- helpers -------------------------------------------------------------------------------------------
    def _rate(self) -> float:
        return (sum(1 for _, ok in self.outcomes if not ok) / len(self.outcomes)) if self.outcomes else 0.0

    def _event(self, to: str, reason: str) -> None:
        self.events.append({"at": time.time(), "from": self.state, "to": to, "reason": reason})

    def _set(self, state: GuardState, reason: str, pause: str | None = None) -> None:
        """Change state (logged, and kept in ``events``), or only update the reason of the same state for the
        same cause; ``pause``: what a pause is for."""
        same_cause = reason.split(" ")[0] == self.reason.split(" ")[0] and pause == self.pause
        self.pause = pause if state == "paused" else None
        if state == self.state and same_cause:
            self.reason = reason
            return
        self._event(state, reason)
        level = logging.WARNING if "unhealthy" in (state, self.state) or pause in ("heat", "pressure") \
            else logging.INFO
        log.log(level, "guard: %s -> %s%s", self.state, state, f" ({reason})" if reason else "")
        self.state, self.reason = state, reason

    def _alert(self, what: str, detail: str) -> None:
        event = {"event": "nodeagent.alert", "node": self.node_id, "alert": what, "detail": detail,
                 "at": time.time()}
        self.events.append(event)
        alert_log.error(json.dumps(event))
        if self.config.webhook:
            threading.Thread(target=self._deliver, args=(self.config.webhook, event), daemon=True).start()

    def _deliver(self, url: str, event: dict) -> None:
        try:
            self.post(url, event)
        except Exception as exc:  # noqa: BLE001  (an alert that cannot be delivered must not stop the node)
            log.warning("guard: the alert webhook %s failed: %s", url, exc)


def _post_json(url: str, payload: dict) -> None:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10):
        pass
