"""Checks 4-5: the broker (reachable, its own settings, and this machine's clock against the broker's) and the
model hub.

The broker is opened once for all of its checks (``Edges.once``); what its settings mean is judged in
``broker/advice.py``, which a starting worker logs from too. Its clock: Redis brokers read the server's
``TIME`` through ``BrokerClock.sample()``, which sets ``offset_s``; the SQLite broker's time is this host's
clock anchored to the wall clock once per boot, so there the offset says how far the wall clock has moved since.
The hub is asked with one HEAD, in a thread the check waits on for a bounded time: a hung DNS lookup or a
silent firewall cannot hang `nodeagent doctor`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from nodeagent.config import SETTINGS_BY_NAME
from nodeagent.doctor.edges import Edges
from nodeagent.doctor.types import Check, fail, ok, warn
from nodeagent.errors import NodeAgentError
from nodeagent.store.hub import OFFLINE_WORKS, UNREACHABLE_HINT, offline_switches
from nodeagent.urls import masked, shown

BROKER, CLOCK, HUB = "broker", "clock", "model hub"
HUB_URL = "https://huggingface.co"


@dataclass(frozen=True)
class BrokerReading:
    url: str
    offset_s: float | None = None
    error: str | None = None
    settings: dict[str, Any] | None = None
    settings_error: str | None = None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, NodeAgentError) else f"{type(exc).__name__}: {text}"


def read_broker(e: Edges) -> BrokerReading:
    """Open the broker, read its time and this machine's offset from it, close it."""
    from nodeagent.broker.open import broker_errors

    url = e.config.broker or f"sqlite://{e.config.state_dir / 'queue.db'}"
    if e.open_broker is None:
        return BrokerReading(shown(url), error="no broker was given")
    try:
        broker = e.open_broker()
    except (NodeAgentError, OSError, *broker_errors()) as exc:
        return BrokerReading(shown(url), error=masked(_one_line(exc), url))
    url = getattr(broker, "url", url)
    try:
        clock = getattr(broker, "clock", None)
        if clock is not None:  # Redis: one TIME now, and the offset from it
            clock.sample()
            offset = float(clock.offset_s)
        else:
            offset = e.wall() - broker.now()
    except (NodeAgentError, OSError, *broker_errors()) as exc:
        broker.close()
        return BrokerReading(shown(url), error=masked(_one_line(exc), url))
    if not hasattr(broker, "settings"):
        broker.close()
        return BrokerReading(shown(url), offset_s=offset, settings_error="this broker does not report its settings")
    try:
        settings = broker.settings()
        if settings.get("engine") != "sqlite":  # Redis keeps it in memory: sized at the fleet's rate
            settings.update(rate_per_s=_finished_per_s(broker), retention_s=e.config.result_retention_s,
                            responses_max_bytes=e.config.responses_max_bytes)
        return BrokerReading(shown(url), offset_s=offset, settings=settings)
    except (NodeAgentError, OSError, *broker_errors()) as exc:
        return BrokerReading(shown(url), offset_s=offset, settings_error=masked(_one_line(exc), url))
    finally:
        broker.close()


def _finished_per_s(broker: Any) -> float:
    """The fleet's finished tasks a second over the last hour (its history)."""
    from nodeagent.fleet.history import History

    history = History.read(broker, broker.now(), 60, kinds=("t",))
    done = sum(v for row in history.rows.values() for k, v in row.items() if k.endswith(("|ok", "|dead")))
    return done / 3600.0


def broker_check(e: Edges) -> Check:
    reading: BrokerReading = e.once("broker", lambda: read_broker(e))
    if reading.error is None:
        return ok(BROKER, f"{reading.url} answers")
    redis = reading.url.startswith(("redis", "unix"))
    env = SETTINGS_BY_NAME["broker"].env
    fix = f"start redis-server (sudo systemctl start redis-server), or check {env}" if redis else \
        f"check that {SETTINGS_BY_NAME['state_dir'].env} is writable, or set {env}"
    detail = reading.error if reading.url in reading.error else f"{reading.url} cannot be reached: {reading.error}"
    return fail(BROKER, detail, fix)


def broker_settings_check(e: Edges) -> list[Check]:
    """The broker's own settings (``broker/advice.py``): eviction, persistence, replicas and Sentinels for Redis;
    the journal and the free disk for SQLite."""
    from nodeagent.broker.advice import advise

    reading: BrokerReading = e.once("broker", lambda: read_broker(e))
    if reading.error is not None:
        return [warn("broker settings", "not read: the broker cannot be reached (see the broker check)")]
    if reading.settings is None:
        return [warn("broker settings", f"not read: {reading.settings_error}")]
    return [Check(name=f.name, status=f.status, detail=f.detail, fix=f.fix) for f in advise(reading.settings)]


def clock_check(e: Edges) -> Check:
    reading: BrokerReading = e.once("broker", lambda: read_broker(e))
    if reading.offset_s is None:
        return warn(CLOCK, "not measured: the broker cannot be reached (see the broker check)")
    limit = e.config.clock_warn_s
    offset = reading.offset_s
    whose = "this host's clock, anchored once per boot" if reading.url.startswith("sqlite") else "the server's TIME"
    shown = f"{offset:+.3f}".replace("-0.000", "+0.000")
    detail = f"this machine's wall clock is {shown} s off the broker's ({whose})"
    if abs(offset) <= limit:
        return ok(CLOCK, f"{detail}; warns past {limit:g} s")
    fix = "System Settings > General > Date & Time: set time and date automatically" \
        if e.system.system() == "darwin" else "enable NTP: sudo timedatectl set-ntp true"
    return warn(CLOCK, f"{detail}: over {SETTINGS_BY_NAME['clock_warn_s'].env} ({limit:g} s). The queue does not "
                       "depend on it, but times this node shows and stamps are off", fix)


def bounded(call: Callable[[], Any], timeout_s: float) -> str | None:
    """Run ``call`` in a thread and wait at most ``timeout_s`` (plus a moment): None when it returned, else why
    not. A call still hanging is left to its daemon thread."""
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # reported, not raised: the thread has no one to raise to
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="doctor-hub", daemon=True)
    thread.start()
    thread.join(timeout_s + 0.5)
    if thread.is_alive():
        return f"no answer within {timeout_s:g} s"
    if "error" not in outcome:
        return None
    exc = outcome["error"]
    reason = getattr(exc, "reason", None)  # urllib's URLError wraps the socket's error
    if isinstance(reason, BaseException):
        exc = reason
    elif reason:
        return f"{type(exc).__name__}: {reason}"
    return _one_line(exc)


def hub_check(e: Edges) -> Check:
    """Reachable, or the offline mode that is in force, and what still works without it."""
    switches = offline_switches(e.env)
    if switches or e.config.offline:
        where = ", ".join(f"{name} is set" for name in switches) or \
            f"offline = true from {e.config.source('offline')}"
        return warn(HUB, f"offline mode: {OFFLINE_WORKS} ({where})",
                    f"unset {' '.join(switches)}" if switches else "set offline = false in the config file")
    url = e.env.get("HF_ENDPOINT") or HUB_URL
    why = bounded(lambda: e.head(url, e.hub_timeout_s), e.hub_timeout_s)
    if why is None:
        return ok(HUB, f"{url} answers")
    return warn(HUB, f"the hub cannot be reached ({why}): {OFFLINE_WORKS}", UNREACHABLE_HINT.split(";")[0])
