"""What `nodeagent status` and the operator's page show, read once from the broker into typed values: nodes (lost
or not, and their health: temperature, throttling, the CPU's clock, battery, memory pressure, what the guard
paused them for), gateways, queues with the direction their depth moves, alerts for queues that keep growing and
for under-volted nodes, the scheduler's assignments, the newest batches, and where a model would fit across the
fleet (`--fit`).

The read model: ``FleetStatus`` of ``NodeStatus``, ``GatewayStatus``, ``QueueStatus``, ``AssignmentStatus`` and
``BatchStatus``, each built here and nowhere else. A node's liveness is ``NodeRecord.liveness`` on the broker's
clock.
The CLI reads their attributes and prints ``model_dump()`` for ``--json``; the page (``ui/views.py``) lays them
out. The loose parts of a node's record (its model set, its guard's status, what it follows) are parsed here, once,
leniently: a part that does not parse (an older or a broken node) leaves the node ``unreadable`` with why, and
nothing downstream guards against odd values.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from nodeagent.broker.base import LOST_AFTER_BEATS, Broker, NodeRecord, QueueStats
from nodeagent.config import NodeConfig, default_of
from nodeagent.errors import NodeAgentError, param_of
from nodeagent.values import Frozen

GROWING_SAMPLES = 5  # a queue that grew at each of this many samples in a row, over a minute or more, alerts
GROWING_MIN_S = 60.0
STALE_BEATS = 1.5  # a node that missed this many heartbeats is stale; LOST_AFTER_BEATS, and it is lost


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


# -- the parts of a node's record ---------------------------------------------------------------------------------
class NodeHealth(Frozen):
    """A node's health as its guard reported it at its last heartbeat (``Guard.status``); what it did not report
    (an older node, a guard with no health reading) is None."""

    state: str | None = None  # the guard's: ok | degraded | paused | unhealthy
    pause: str | None = None  # what a pause is for: heat, pressure, operator...
    reason: str | None = None
    thermal: str | None = None
    temperature_c: float | None = None
    throttled: list[str] | None = None  # the firmware's flags (a Pi's), as words
    freq_ratio: float | None = None
    undervolted: bool | None = None
    on_battery: bool | None = None
    battery_pct: float | None = None
    memory_pressure: str | None = None
    hold_models: str | None = None  # why it loads no model now

    def known(self) -> bool:
        """Whether any reading is known beyond the guard's state."""
        return any(v is not None for k, v in self if k != "state")


class PrefixHeld(Frozen):
    """One prefix a node holds on disk (by the first characters of its file's name: its tokens are not shown)."""

    id: str
    tokens: int = 0
    state_bytes: int = 0
    restores: int = 0


class PrefixStatus(Frozen):
    """A model's warm prefixes on a node (``Node.prefix_usage``): held on disk (None while the model is not
    loaded), restored in place of a prefill since the node started, the prefill rate measured there and the prefill
    seconds the restores saved at it (None until a prompt was read)."""

    prefixes: int | None = None
    state_bytes: int | None = None
    restored: int = 0
    restored_tokens: int = 0
    restore_s: float = 0.0
    written: int = 0
    refused: int = 0
    prefill_tokens_per_s: float | None = None
    saved_s: float | None = None
    top: list[PrefixHeld] = []


class ModelStatus(Frozen):
    """One model of a node's set (``ModelSet.state``)."""

    model: str | None = None
    loaded: bool | None = None
    pinned: bool | None = None
    slots: int | None = None
    in_use: int | None = None
    planned_bytes: int | None = None
    ctx_per_slot: int | None = None
    loads: int | None = None
    unloads: int | None = None
    retired: bool = False


class Following(Frozen):
    """The assignment a node follows (``fleet/follow.py``'s ``AssignmentFollower.status``)."""

    generation: int | None = None
    followed_at: float | None = None
    held: list[str] = []
    refused: dict[str, str] = {}


# -- the read model ----------------------------------------------------------------------------------------------
class Heard:
    """What a node's status and a gateway's share (their ``lost``, ``state``, ``agent_version``, ``contract``)."""

    @property
    def live(self) -> bool:
        """Neither lost nor stopped: it counts in the fleet's versions and alerts."""
        return not self.lost and self.state != "stopped"  # type: ignore[attr-defined]

    def version(self) -> str:
        """Its version as status shows it: nodeagent's and its contract's."""
        return f"nodeagent {self.agent_version or '?'} (contract {self.contract or '1.0'})"  # type: ignore


class NodeStatus(Heard, NodeRecord):
    """A node as status and the page show it: its record (less the probe and the plan, which ``--fit`` reads from
    the record), its parts parsed, its heartbeat's age, and its status: ok, stale (a beat and a half missed), lost
    (three: ``NodeRecord.liveness``), stopped, or unreadable (a part of its record did not parse: ``unreadable``
    says which)."""

    hardware: dict[str, Any] = Field(default_factory=dict, exclude=True)  # not read: empty here
    plan: dict[str, Any] = Field(default_factory=dict, exclude=True)
    model_set: list[ModelStatus] = []  # type: ignore[assignment]
    prefixes: dict[str, PrefixStatus] = {}  # type: ignore[assignment]
    following: Following = Following()  # type: ignore[assignment]
    health: NodeHealth = NodeHealth()
    heartbeat_age_s: float = 0.0
    lost: bool = False
    status: str = "ok"  # ok | stale | lost | stopped | unreadable
    unreadable: str | None = None

    @classmethod
    def of(cls, n: NodeRecord, now: float, lost_after_s: float) -> "NodeStatus":
        age = now - n.heartbeat_at
        beat = n.heartbeat_s or lost_after_s / LOST_AFTER_BEATS
        liveness = n.liveness(now, lost_after_s)
        lost = liveness == "lost"
        status = ("stopped" if liveness == "stopped" else "lost" if lost else "stale" if age > STALE_BEATS * beat
                  else "ok")
        record = n.model_dump(exclude={"hardware", "plan"})
        seen = {"heartbeat_age_s": age, "lost": lost, "status": status, "health": n.guard_status or {}}
        try:
            return cls.model_validate({**record, **seen})
        except ValidationError as exc:  # one part does not parse: the node is shown, its parts left empty
            why = f"{param_of(exc) or 'the record'}: {exc.errors()[0]['msg']}"
            return cls.model_validate({**record, **seen, "model_set": [], "following": {}, "health": {},
                                       "prefixes": {},
                                       "status": status if status in ("lost", "stopped") else "unreadable",
                                       "unreadable": why})



class GatewayStatus(Heard, Frozen):
    """A gateway holds no model: where it listens, its version, and whether it beats."""

    id: str
    endpoint: str | None = None
    state: str
    heartbeat_age_s: float
    lost: bool
    status: str
    agent_version: str
    contract: str

    @classmethod
    def of(cls, n: NodeStatus) -> "GatewayStatus":
        return cls.model_validate(n.model_dump(include=set(cls.model_fields)))


class QueueStatus(QueueStats):
    trend: str = "-"  # how its depth moved over the last five minutes: steady, +12 in 240 s


class Leader(Frozen):
    owner: str
    leading_for_s: float
    expires_in_s: float


class AssignmentStatus(Frozen):
    """What the scheduler assigned a node, against what the node says it followed."""

    node: str
    models: list[str] = []
    generation: int | None = None
    written_age_s: float | None = None
    followed_generation: int | None = None
    followed_age_s: float | None = None
    held: list[str] = []
    refused: dict[str, str] = {}


class BatchStatus(Frozen):
    """A batch's progress (``fleet/batches.py``'s record, the fields status shows)."""

    id: str | None = None
    status: str | None = None
    endpoint: str | None = None
    request_counts: dict[str, int] = {}
    created_at: float | None = None
    in_progress_at: float | None = None
    expires_at: float | None = None


class FitRow(Frozen):
    """Where ``--fit MODEL`` fits on one registered node (the pure planner on its recorded hardware)."""

    node: str
    profile: str | None
    fits: bool
    quant: str | None
    ctx_tokens: int
    total_bytes: int
    why: str


class FleetStatus(Frozen):
    """The fleet as the broker holds it now, every age on the broker's clock. ``ledger`` and ``fit`` are the CLI's
    additions (this host's memory ledger, ``--fit``)."""

    nodes: list[NodeStatus] = []
    gateways: list[GatewayStatus] = []
    queues: list[QueueStatus] = []
    alerts: list[str] = []
    versions: dict[str, list[str]] = {}
    batches: list[BatchStatus] = []
    paused_queues: dict[str, dict[str, Any]] = {}
    scheduler: Leader | None = None
    assignments: list[AssignmentStatus] = []
    ledger: list[dict[str, Any]] = []
    fit: list[FitRow] | None = None


def fleet_status(broker: Broker, lost_after_s: float, clock_warn_s: float | None = None,
                 now: float | None = None, history: Any = None) -> FleetStatus:
    """Every age on the broker's clock: a node whose own clock is off is never shown lost for it, and its offset
    (measured at its heartbeats) alerts past ``clock_warn_s``. ``history``: the last hour of the fleet's history
    (``fleet/history.py``) when the caller read it already."""
    from nodeagent.fleet.controls import paused_queues
    from nodeagent.fleet.history import History

    now = broker.now() if now is None else now
    clock_warn_s = default_of("clock_warn_s") if clock_warn_s is None else clock_warn_s
    nodes: list[NodeStatus] = []
    gateways: list[GatewayStatus] = []
    for record in broker.nodes():
        n = NodeStatus.of(record, now, lost_after_s)
        if n.role == "gateway":
            gateways.append(GatewayStatus.of(n))
        else:
            nodes.append(n)
    depths = (history or History.read(broker, now, 60)).depth_points()
    queues, alerts = [], []
    for s in broker.stats():
        trend, alert = _trend(depths, s.queue, now)
        queues.append(QueueStatus(**s.model_dump(), trend=trend))
        if alert:
            alerts.append(alert)
    alerts += _alerts(nodes, gateways, clock_warn_s)
    versions = fleet_versions([*nodes, *gateways])
    if len(versions) > 1:
        alerts.append("the fleet runs " + str(len(versions)) + " versions: " + "; ".join(
            f"{v} on {', '.join(ids)}" for v, ids in versions.items()) + " (a rolling upgrade; see docs/operations.md)")
    alerts += [f"node {n.id} gave back tasks it cannot read {n.deferred} time(s), for a node of a newer "
               f"version (last: {n.deferred_why})" for n in nodes if n.deferred and not n.lost]
    leader, assignments = _scheduling(broker, {n.id: n for n in nodes}, now)
    return FleetStatus(nodes=nodes, gateways=gateways, queues=queues, alerts=alerts, versions=versions,
                       batches=_batches(broker), paused_queues=paused_queues(broker), scheduler=leader,
                       assignments=assignments)


def _alerts(nodes: list[NodeStatus], gateways: list[GatewayStatus], clock_warn_s: float) -> list[str]:
    """Lost nodes and gateways, clocks off the broker's, under-volted supplies, parts of records unread."""
    out = [f"node {n.id} is lost: no heartbeat for {n.heartbeat_age_s:.0f} s" for n in nodes if n.lost]
    out += [f"node {n.id}'s clock is {n.clock_offset_s:+.1f} s off the broker's (NODEAGENT_CLOCK_WARN_S "
            f"{clock_warn_s:g}): fix its time (NTP); the queue does not depend on it"
            for n in nodes if n.clock_offset_s is not None and abs(n.clock_offset_s) > clock_warn_s and n.live]
    out += [f"node {n.id} is under-volted: its power supply cannot hold the voltage (the firmware throttles, "
            "SD cards corrupt); use a supply rated for the board" for n in nodes if n.health.undervolted and n.live]
    out += [f"node {n.id}'s record could not be read in part ({n.unreadable}): upgrade it, or see its log"
            for n in nodes if n.unreadable and n.live]
    out += [f"gateway {g.id} is lost: no heartbeat for {g.heartbeat_age_s:.0f} s" for g in gateways if g.lost]
    return out


def fleet_versions(rows: list[NodeStatus | GatewayStatus]) -> dict[str, list[str]]:
    """The versions the live nodes and gateways run, each with their ids (more than one: a fleet mid-upgrade)."""
    out: dict[str, list[str]] = {}
    for r in rows:
        if r.live:
            out.setdefault(r.version(), []).append(r.id)
    return dict(sorted(out.items()))


def _scheduling(broker: Broker, nodes: dict[str, NodeStatus],
                now: float) -> tuple[Leader | None, list[AssignmentStatus]]:
    """The scheduler's leader and each following node's assignment, with how long ago the node followed it."""
    from nodeagent.fleet.scheduler import lease_holder, read_assignments

    lease = lease_holder(broker)
    leader = (Leader(owner=lease.owner, leading_for_s=now - lease.since, expires_in_s=lease.expires_at - now)
              if lease and lease.expires_at > now else None)
    rows = []
    for node_id, (a, _) in sorted(read_assignments(broker).items()):
        n = nodes.get(node_id)
        f = n.following if n is not None else Following()
        rows.append(AssignmentStatus(node=node_id, models=a.names, generation=a.generation,
                                     written_age_s=now - a.written_at, followed_generation=f.generation,
                                     followed_age_s=None if f.followed_at is None else now - f.followed_at,
                                     held=f.held, refused=f.refused))
    return leader, rows


def _batches(broker: Broker, limit: int = 20) -> list[BatchStatus]:
    """The newest batches with their progress (the active ones advanced first)."""
    from nodeagent.fleet.batches import Batches

    return [BatchStatus.model_validate(b) for b in Batches(broker).list(limit=limit)]


def fit_rows(nodes: list[NodeRecord], model: str, config: NodeConfig) -> list[FitRow]:
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
            rows.append(FitRow(node=n.id, profile=profile.id, fits=p.fits, quant=p.quant,
                               ctx_tokens=p.settings.ctx_per_slot, total_bytes=p.memory.total_bytes,
                               why=p.reasons[-1] if not p.fits else "; ".join(r for r in p.reasons
                                                                              if r.startswith("chosen"))))
        except (NodeAgentError, ValueError) as exc:
            rows.append(FitRow(node=n.id, profile=n.labels.get("profile"), fits=False, quant=None, ctx_tokens=0,
                               total_bytes=0, why=str(exc)))
    return rows
