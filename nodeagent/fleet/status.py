"""What `nodeagent status` shows: nodes (lost or not, and their health: temperature, throttling, the CPU's clock,
battery, memory pressure, what the guard paused them for), queues with the direction their depth moves, alerts
for queues that keep growing and for under-volted nodes, and where a model would fit across the fleet (`--fit`)."""

from __future__ import annotations

from typing import Any

from nodeagent.broker.base import LOST_AFTER_BEATS, Broker, NodeRecord
from nodeagent.config import NodeConfig, default_of
from nodeagent.errors import NodeAgentError

GROWING_SAMPLES = 5  # a queue that grew at each of this many samples in a row, over a minute or more, alerts
GROWING_MIN_S = 60.0


def _trend(history: list[tuple[float, dict[str, int]]], queue: str, now: float) -> tuple[str, str | None]:
    points = [(t, d.get(queue, 0)) for t, d in history]
    if len(points) < 2:
        return "-", None
    recent = [p for p in points if p[0] >= now - 300] or points[-2:]
    first, last = recent[0], recent[-1]
    change = last[1] - first[1]
    span = max(1.0, last[0] - first[0])
    trend = "steady" if change == 0 else f"{'+' if change > 0 else ''}{change} in {span:.0f} s"
    tail = points[-GROWING_SAMPLES:]
    growing = (len(tail) == GROWING_SAMPLES and all(b[1] > a[1] for a, b in zip(tail, tail[1:]))
               and tail[-1][0] - tail[0][0] >= GROWING_MIN_S)
    alert = (f"queue {queue} keeps growing: {tail[0][1]} -> {tail[-1][1]} over {tail[-1][0] - tail[0][0]:.0f} s"
             if growing else None)
    return trend, alert


HEALTH_KEYS = ("pause", "reason", "thermal", "temperature_c", "throttled", "freq_ratio", "undervolted", "on_battery",
               "battery_pct", "memory_pressure", "hold_models")


def node_health(guard_status: dict[str, Any] | None) -> dict[str, Any]:
    """A node's health as its guard reported it at its last heartbeat (``Guard.status``); the keys it did not
    report (an older node, a guard with no health reading) are None."""
    g = guard_status or {}
    return {k: g.get(k) for k in HEALTH_KEYS}


STALE_BEATS = 1.5  # a node that missed this many heartbeats is stale; LOST_AFTER_BEATS, and it is lost


def node_row(n: NodeRecord, now: float, lost_after_s: float) -> dict[str, Any]:
    """A node as status and the page show it: its record (less the probe and the plan), its heartbeat's age, and
    its status: ok, stale (a beat and a half missed), lost (three), or stopped."""
    age = now - n.heartbeat_at
    beat = n.heartbeat_s or lost_after_s / LOST_AFTER_BEATS
    lost = n.state != "stopped" and not n.heard(now, lost_after_s)
    status = ("stopped" if n.state == "stopped" else "lost" if lost else "stale" if age > STALE_BEATS * beat
              else "ok")
    return {**n.model_dump(exclude={"hardware", "plan"}), "heartbeat_age_s": age, "lost": lost, "status": status,
            "health": node_health(n.guard_status)}


def fleet_status(broker: Broker, lost_after_s: float, clock_warn_s: float | None = None,
                 now: float | None = None, history: Any = None) -> dict[str, Any]:
    """Every age on the broker's clock: a node whose own clock is off is never shown lost for it, and its offset
    (measured at its heartbeats) alerts past ``clock_warn_s``. ``history``: the last hour of the fleet's history
    (``fleet/history.py``) when the caller read it already."""
    from nodeagent.fleet.controls import paused_queues
    from nodeagent.fleet.history import History

    now = broker.now() if now is None else now
    clock_warn_s = default_of("clock_warn_s") if clock_warn_s is None else clock_warn_s
    nodes, gateways = [], []
    for n in broker.nodes():
        row = node_row(n, now, lost_after_s)
        if n.role == "gateway":  # it holds no model: where it listens, and whether it beats
            gateways.append({k: row[k] for k in ("id", "endpoint", "state", "heartbeat_age_s", "lost", "status",
                                                 "agent_version", "contract")})
            continue
        nodes.append(row)
    history = (history or History.read(broker, now, 60)).depth_points()
    queues, alerts = [], []
    for s in broker.stats():
        trend, alert = _trend(history, s.queue, now)
        queues.append({**s.model_dump(), "trend": trend})
        if alert:
            alerts.append(alert)
    alerts += [f"node {n['id']} is lost: no heartbeat for {n['heartbeat_age_s']:.0f} s" for n in nodes if n["lost"]]
    alerts += [f"node {n['id']}'s clock is {n['clock_offset_s']:+.1f} s off the broker's (NODEAGENT_CLOCK_WARN_S "
               f"{clock_warn_s:g}): fix its time (NTP); the queue does not depend on it"
               for n in nodes if n.get("clock_offset_s") is not None and abs(n["clock_offset_s"]) > clock_warn_s
               and not n["lost"] and n.get("state") != "stopped"]
    alerts += [f"node {n['id']} is under-volted: its power supply cannot hold the voltage (the firmware throttles, "
               "SD cards corrupt); use a supply rated for the board"
               for n in nodes if n["health"]["undervolted"] and not n["lost"] and n.get("state") != "stopped"]
    alerts += [f"gateway {g['id']} is lost: no heartbeat for {g['heartbeat_age_s']:.0f} s" for g in gateways
               if g["lost"]]
    versions = fleet_versions([*nodes, *gateways])
    if len(versions) > 1:
        alerts.append("the fleet runs " + str(len(versions)) + " versions: " + "; ".join(
            f"{v} on {', '.join(ids)}" for v, ids in versions.items()) + " (a rolling upgrade; see docs/operations.md)")
    alerts += [f"node {n['id']} gave back tasks it cannot read {n['deferred']} time(s), for a node of a newer "
               f"version (last: {n['deferred_why']})" for n in nodes if n.get("deferred") and not n["lost"]]
    return {"nodes": nodes, "gateways": gateways, "queues": queues, "alerts": alerts, "versions": versions,
            "batches": _batches(broker),
            "paused_queues": paused_queues(broker), **_scheduling(broker, {n["id"]: n for n in nodes}, now)}


def version_of(row: dict[str, Any]) -> str:
    """A node's or a gateway's version as status shows it: nodeagent's and its contract's."""
    return f"nodeagent {row.get('agent_version') or '?'} (contract {row.get('contract') or '1.0'})"


def fleet_versions(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The versions the live nodes and gateways run, each with their ids (more than one: a fleet mid-upgrade)."""
    out: dict[str, list[str]] = {}
    for r in rows:
        if not r["lost"] and r.get("state") != "stopped":
            out.setdefault(version_of(r), []).append(r["id"])
    return dict(sorted(out.items()))


def _scheduling(broker: Broker, nodes: dict[str, dict[str, Any]], now: float) -> dict[str, Any]:
    """The scheduler's leader and each following node's assignment, with how long ago the node followed it."""
    from nodeagent.fleet.scheduler import lease_holder, read_assignments

    lease = lease_holder(broker)
    leader = ({"owner": lease.owner, "leading_for_s": now - lease.since, "expires_in_s": lease.expires_at - now}
              if lease and lease.expires_at > now else None)
    rows = []
    for node_id, (a, _) in sorted(read_assignments(broker).items()):
        f = (nodes.get(node_id) or {}).get("following") or {}
        followed = f.get("followed_at")
        rows.append({"node": node_id, "models": a.names, "generation": a.generation,
                     "written_age_s": now - a.written_at, "followed_generation": f.get("generation"),
                     "followed_age_s": None if followed is None else now - followed, "held": f.get("held", []),
                     "refused": f.get("refused", {})})
    return {"scheduler": leader, "assignments": rows}


def _batches(broker: Broker, limit: int = 20) -> list[dict[str, Any]]:
    """The newest batches with their progress (the active ones advanced first)."""
    from nodeagent.fleet.batches import Batches

    return [{k: b[k] for k in ("id", "status", "endpoint", "request_counts", "created_at", "expires_at")}
            for b in Batches(broker).list(limit=limit)]


def fit_rows(nodes: list[NodeRecord], model: str, config: NodeConfig) -> list[dict[str, Any]]:
    """The pure planner on each registered node's recorded hardware and profile: where MODEL fits, at which
    quant and context, and why not where it does not. Nothing is downloaded (headers, or the catalog's facts)."""
    from nodeagent.hardware.types import HardwareInfo
    from nodeagent.node import Device, plan_for
    from nodeagent.profiles import ProfileMatch, get_profile

    rows = []
    for n in nodes:
        try:
            hw = HardwareInfo.model_validate(n.hardware)
            profile = get_profile(n.labels.get("profile") or "linux-cpu")
            overhead = (n.plan.get("memory") or {}).get("overhead_bytes")
            device = Device(hardware=hw, profile=profile, here=False, overhead_bytes=overhead or
                            profile.nominal_overhead_bytes(),
                            match=ProfileMatch(profile_id=profile.id, reasons=["recorded by the node"], score=0))
            p = plan_for(model, device, config)
            rows.append({"node": n.id, "profile": profile.id, "fits": p.fits, "quant": p.quant,
                         "ctx_tokens": p.settings.ctx_per_slot, "total_bytes": p.memory.total_bytes,
                         "why": p.reasons[-1] if not p.fits else "; ".join(r for r in p.reasons if
                                                                         r.startswith("chosen"))})
        except (NodeAgentError, ValueError) as exc:
            rows.append({"node": n.id, "profile": n.labels.get("profile"), "fits": False, "quant": None,
                         "ctx_tokens": 0, "total_bytes": 0, "why": str(exc)})
    return rows
