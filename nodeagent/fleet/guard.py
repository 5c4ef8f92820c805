"""The guard (the "panic filter"): a node protects itself and the fleet.

- It stops claiming while host memory use is above ``memory_pct`` (85 %) or the CPU time of *other*
  processes is above ``cpu_pct`` (90 %): this node's own inference is not counted, or every task would pause
  the node after it. A pause for CPU lasts at most ``cpu_pause_max_s`` (60 s): then the node serves on until
  that CPU use has dropped once (on a machine that is always busy a node must not starve); memory pressure
  has no such limit.
- It marks the node unhealthy when the error rate over a sliding window (the last ``window_s``, at least
  ``min_samples`` outcomes) exceeds ``error_rate`` (15 %); an unhealthy node claims nothing for ``cooldown_s``,
  then one task as a probe: a success makes it healthy again.
- After ``alert_after`` (3) consecutive failures it raises an alert: a structured log event on the
  ``nodeagent.alert`` logger and, when configured, a JSON POST to a webhook.

Readings and the clock are injected, so the thresholds are tested with made-up readings. Every change of
state is logged and kept in ``events`` for ``nodeagent status``.
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
from nodeagent.values import Frozen

log = logging.getLogger(__name__)
alert_log = logging.getLogger("nodeagent.alert")
GuardState = Literal["ok", "paused", "unhealthy"]


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

    @classmethod
    def from_config(cls, config: NodeConfig) -> "GuardConfig":
        return cls(memory_pct=config.guard_memory_pct, cpu_pct=config.guard_cpu_pct,
                   error_rate=config.guard_error_rate, webhook=config.alert_webhook)


def system_readings() -> Readings:
    """Memory in use, and the CPU other processes took since the last reading."""
    from nodeagent import hostload

    return Readings(memory_pct=hostload.memory_pct(), cpu_pct=hostload.other_cpu_pct())


class Guard:
    def __init__(self, config: GuardConfig | None = None, read: Callable[[], Readings] = system_readings,
                 clock: Callable[[], float] = time.monotonic, post: Callable[[str, dict], None] | None = None,
                 node_id: str = "") -> None:
        self.config = config or GuardConfig()
        self.read, self.clock = read, clock
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
            busy = r.cpu_pct > c.cpu_pct
            if not busy:
                self._cpu_since, self._cpu_waived = None, False
            elif self._cpu_since is None:
                self._cpu_since = now
            if r.memory_pct > c.memory_pct:
                self._set("paused", f"memory {r.memory_pct:.0f}% > {c.memory_pct:.0f}%")
            elif busy and not self._cpu_waived and now - self._cpu_since < c.cpu_pause_max_s:
                self._set("paused", f"CPU (other processes) {r.cpu_pct:.0f}% > {c.cpu_pct:.0f}%")
            elif busy:  # never starved: after the longest pause, serve on until the other work lets up once
                self._cpu_waived = True
                self._set("ok", f"CPU (other processes) {r.cpu_pct:.0f}% > {c.cpu_pct:.0f}% for over "
                                f"{c.cpu_pause_max_s:g} s: serving anyway")
            else:
                self._set("ok", "")
            return self.state == "ok"

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
        return {"state": self.state, "reason": self.reason, "error_rate": round(self.error_rate(), 3),
                "consecutive_failures": self.consecutive_failures, "events": list(self.events)[-5:]}

    # -- helpers -------------------------------------------------------------------------------------------
    def _set(self, state: GuardState, reason: str) -> None:
        if state == self.state and reason.split(" ")[0] == self.reason.split(" ")[0]:
            self.reason = reason
            return
        event = {"at": time.time(), "from": self.state, "to": state, "reason": reason}
        self.events.append(event)
        level = logging.WARNING if "unhealthy" in (state, self.state) else logging.INFO
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
