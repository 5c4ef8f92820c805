"""The central scheduler: one process anywhere on the fleet (`nodeagent scheduler`, or a following worker on the
embedded SQLite queue) that decides which model runs where.

Each round (every ``schedule_s``), while it holds the leader lease:

1. it reads the registered nodes (their recorded hardware and profile, what they hold, their health) and the
   queue's demand per model (ready, delayed and leased tasks, and their arrival rate from the enqueued counts);
2. it plans each model on each following node with the pure planner (cached per hardware, profile and model),
   taking a node's `nodeagent bench` throughput where it has one;
3. it runs the policy (``placement.py``) and writes each following node's **assignment** (a document in the
   broker, ``schemas/scheduler-contract.md``) where it changed, with the reasons.

The leader lease is a document written over the version read: whoever renews it first after it expires leads, so
a second scheduler is a standby that takes over ``scheduler_lease_s`` after the leader stops renewing. The nodes
follow their assignments (``follow.py``); when no scheduler runs, they keep what they hold (fail-static).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from pydantic import Field

from nodeagent.broker.base import Broker, Demand, NodeRecord, lost_after
from nodeagent.config import NodeConfig
from nodeagent.errors import NodeAgentError
from nodeagent.fleet.placement import Fit, FitFn, ModelDemand, NodeView, Placement, Policy, place
from nodeagent.values import Frozen

log = logging.getLogger(__name__)

ASSIGNMENT = "assignment"  # document kinds
LEASE = "lease"
LEADER = "scheduler"
RATE_HALF_LIFE_S = 60.0  # the arrival rate's moving average forgets half its past in this long


class Assigned(Frozen):
    model: str
    since: float = Field(description="When the scheduler placed it on this node (unix seconds)")
    settings: dict[str, Any] = Field(default_factory=dict, description="The scheduler's plan for it on this node: "
                                                                         "quant, ctx_tokens, planned_bytes")


class Assignment(Frozen):
    """What a following node should hold: the document ``assignment/<node id>``."""

    node: str
    models: list[Assigned] = Field(default_factory=list)
    generation: int = Field(1, description="Raised by each change")
    written_at: float = 0.0
    scheduler: str = Field("", description="The scheduler that wrote it")
    reasons: list[str] = Field(default_factory=list, description="This node's part of the round's reasons")

    @property
    def names(self) -> list[str]:
        return [a.model for a in self.models]


class LeaseRecord(Frozen):
    """The leader lease: the document ``lease/scheduler``."""

    owner: str
    expires_at: float
    since: float
    ttl_s: float


def contract_schemas() -> dict[str, dict[str, Any]]:
    """The scheduler's records as JSON Schema (``schemas/``, ``nodeagent schema assignment|lease|demand``)."""
    out = {}
    for name, model in (("assignment", Assignment), ("lease", LeaseRecord), ("demand", Demand)):
        schema = model.model_json_schema()
        schema["$comment"] = f"nodeagent scheduler {name}, contract version 1: see schemas/scheduler-contract.md"
        out[name] = schema
    return out


def lease_holder(broker: Broker, name: str = LEADER) -> LeaseRecord | None:
    """The leader lease as last written (expired or not), or None."""
    got = broker.doc_get(LEASE, name)
    return None if got is None else LeaseRecord.model_validate(got[0])


class LeaderLease:
    def __init__(self, broker: Broker, owner: str, ttl_s: float, name: str = LEADER,
                 clock: Callable[[], float] | None = None) -> None:
        """``clock``: the broker's time (default ``broker.now``): a standby whose own clock runs ahead must not
        see a live leader's lease as expired."""
        self.broker, self.owner, self.ttl_s, self.name = broker, owner, ttl_s, name
        self.clock = clock or broker.now
        self.held = False

    def holder(self) -> LeaseRecord | None:
        return lease_holder(self.broker, self.name)

    def hold(self) -> bool:
        """Take or renew the lease; False while another holds it. One write either way."""
        now = self.clock()
        got = self.broker.doc_get(LEASE, self.name)
        mine = LeaseRecord(owner=self.owner, expires_at=now + self.ttl_s, since=now, ttl_s=self.ttl_s)
        if got is None:
            ok = self.broker.doc_put(LEASE, self.name, mine.model_dump())
        else:
            current, version = LeaseRecord.model_validate(got[0]), got[1]
            if current.owner != self.owner and current.expires_at > now:
                ok = False
            else:
                since = current.since if current.owner == self.owner else now
                ok = self.broker.doc_put(LEASE, self.name, mine.model_copy(update={"since": since}).model_dump(),
                                         version=version)
        if ok != self.held:
            log.info("scheduler %s %s the leader lease", self.owner, "holds" if ok else "lost")
        self.held = ok
        return ok

    def release(self) -> None:
        """Give the lease up (a clean stop): a standby takes over at its next look."""
        got = self.broker.doc_get(LEASE, self.name)
        if got is not None and got[0].get("owner") == self.owner:
            self.broker.doc_put(LEASE, self.name, {**got[0], "expires_at": 0.0}, version=got[1])
        self.held = False


class DemandTracker:
    """Demand per model from successive readings of the queue: the tasks waiting, and the arrival rate as a
    moving average of the enqueued counts' growth. Tasks bound to no model are anyone's: not placed by."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, int]] = {}
        self._rate: dict[str, float] = {}

    def update(self, rows: list[Demand], now: float) -> list[ModelDemand]:
        waiting: dict[str, int] = {}
        enqueued: dict[str, int] = {}
        for d in rows:
            if d.model is None:
                continue
            waiting[d.model] = waiting.get(d.model, 0) + d.waiting
            enqueued[d.model] = enqueued.get(d.model, 0) + d.enqueued
        out = []
        for m in sorted(set(waiting) | set(self._rate)):
            n = enqueued.get(m, 0)
            if m in self._last:
                t0, n0 = self._last[m]
                dt = max(1e-6, now - t0)
                inst = max(0, n - n0) / dt
                keep = 0.5 ** (dt / RATE_HALF_LIFE_S)
                self._rate[m] = keep * self._rate.get(m, inst) + (1 - keep) * inst
            else:
                self._rate[m] = 0.0
            self._last[m] = (now, n)
            out.append(ModelDemand(model=m, waiting=waiting.get(m, 0), arrivals_per_s=round(self._rate[m], 4)))
        return out


def planner_fit(devices: dict[str, tuple[Any, str, int | None]], config: NodeConfig,
                throughput: dict[str, dict[str, float]] | None = None) -> FitFn:
    """A fit function for the policy: the pure planner (``node.plan_for``) on each node's recorded hardware and
    profile, cached per (hardware, profile, model), so a round over a thousand nodes of a few kinds plans a few
    dozen times. ``devices``: node id -> (HardwareInfo, profile id, process overhead or None); ``throughput``:
    node id -> model -> tasks/s its bench measured (preferred over the planner's figure)."""
    from nodeagent.node import Device, plan_for
    from nodeagent.planner.speed import tasks_per_s
    from nodeagent.profiles import ProfileMatch, get_profile

    throughput = throughput or {}
    keys: dict[str, str] = {}
    plans: dict[tuple[str, str], Fit] = {}
    memo: dict[tuple[str, str], Fit] = {}

    def key_of(node_id: str) -> str:
        if node_id not in keys:
            hw, profile, overhead = devices[node_id]
            keys[node_id] = f"{profile}|{overhead}|{hw.model_dump_json()}"
        return keys[node_id]

    def fit(node: NodeView, model: str) -> Fit:
        k = (node.id, model)
        if k in memo:
            return memo[k]
        hk = (key_of(node.id), model)
        if hk not in plans:
            hw, profile_id, overhead = devices[node.id]
            profile = get_profile(profile_id)
            device = Device(hardware=hw, profile=profile, here=False,
                            overhead_bytes=overhead if overhead is not None else profile.nominal_overhead_bytes(),
                            match=ProfileMatch(profile_id=profile.id, reasons=["recorded by the node"], score=0))
            try:
                p = plan_for(model, device, config)
            except (NodeAgentError, ValueError) as exc:
                plans[hk] = Fit(fits=False, why=str(exc).splitlines()[0][:200])
            else:
                b = p.budget
                unified = b.kind == "metal-working-set"
                budget = b.host_limit_bytes + (0 if unified else (b.gpu_limit_bytes or 0)) - b.margin_bytes
                added = max(0, p.memory.total_bytes - p.memory.overhead_bytes)
                plans[hk] = Fit(fits=p.fits, added_bytes=added, overhead_bytes=p.memory.overhead_bytes,
                                budget_bytes=budget, tasks_per_s=tasks_per_s(p, profile),
                                settings={"quant": p.quant, "ctx_tokens": p.settings.ctx_per_slot,
                                          "planned_bytes": p.memory.total_bytes},
                                why="" if p.fits else p.reasons[-1], download=p.backend != "fake")
        f = plans[hk]
        measured = throughput.get(node.id, {}).get(model)
        if measured:
            f = f.model_copy(update={"tasks_per_s": measured})
        memo[k] = f
        return f

    return fit


def host_of(record: NodeRecord) -> str:
    return record.labels.get("host") or record.hostname


def healthy(record: NodeRecord, now: float, lost_after_s: float) -> bool:
    """Serving (``NodeRecord.liveness``: heard from within three of its own heartbeats, ``lost_after_s`` for a
    record that does not say its interval, in a state that takes work), and its guard not unhealthy."""
    return record.liveness(now, lost_after_s) == "serving" and record.guard != "unhealthy"


HEALTH_PAUSES = ("heat", "battery", "pressure")  # what a guard pauses for that places nothing new on the node


def health_of(record: NodeRecord) -> dict[str, Any]:
    """The NodeView fields a node's guard reported at its last heartbeat (``guard_status``, ``Guard.status``):
    paused for heat, battery or memory pressure, holding loads back, its CPU's clock ratio, on battery, warm."""
    g = record.guard_status or {}
    ratio = g.get("freq_ratio")
    paused = g.get("pause") if record.guard == "paused" else None
    return {"paused": (g.get("reason") or str(paused)) if paused in HEALTH_PAUSES else "",
            "holding": g.get("hold_models") or "",
            "freq_ratio": min(1.0, max(0.05, float(ratio))) if isinstance(ratio, (int, float)) and ratio else 1.0,
            "on_battery": bool(g.get("on_battery")), "warm": g.get("thermal") in ("warm", "hot")}


def read_assignments(broker: Broker) -> dict[str, tuple[Assignment, int]]:
    out = {}
    for data in broker.doc_list(ASSIGNMENT, limit=100_000):
        got = broker.doc_get(ASSIGNMENT, data["node"])
        if got is not None:
            out[data["node"]] = (Assignment.model_validate(got[0]), got[1])
    return out


def read_assignment(broker: Broker, node_id: str) -> Assignment | None:
    got = broker.doc_get(ASSIGNMENT, node_id)
    return None if got is None else Assignment.model_validate(got[0])


def fleet_views(records: list[NodeRecord], assigned: dict[str, Assignment], now: float, lost_after_s: float
                ) -> tuple[list[NodeView], dict[str, tuple[Any, str, int | None]], list[NodeRecord]]:
    """The following nodes as the policy sees them, their devices for the planner, and the other (fixed) nodes."""
    from nodeagent.hardware.types import HardwareInfo

    views, devices, fixed = [], {}, []
    for r in records:
        if r.role == "gateway" or (r.state == "stopped" and r.id not in assigned):
            continue  # a gateway holds no model
        if not r.follow:
            if healthy(r, now, lost_after_s):
                fixed.append(r)
            continue
        a = assigned.get(r.id)
        gen = (r.following or {}).get("generation")
        refused = dict((r.following or {}).get("refused") or {}) if a is not None and gen == a.generation else {}
        views.append(NodeView(id=r.id, host=host_of(r), healthy=healthy(r, now, lost_after_s),
                              held=({m.model: m.since for m in a.models} if a else  # its first: what it holds
                                    {m: now for m in (r.following or {}).get("held", [])}), on_disk=r.on_disk,
                              prefixes=warm_prefixes(r), allow_pull=r.allow_pull, refused=refused, **health_of(r)))
        try:
            hw = HardwareInfo.model_validate(r.hardware)
        except ValueError:
            continue
        overhead = (r.plan.get("memory") or {}).get("overhead_bytes") if r.plan else None
        devices[r.id] = (hw, r.labels.get("profile") or "linux-cpu", overhead)
    views = [v for v in views if v.id in devices or not v.healthy]
    return views, devices, fixed


def warm_prefixes(record: NodeRecord) -> list[str]:
    """The models whose warm prefixes a node's record says it holds on disk, or has read back since it started
    (``NodeRecord.prefixes``); a part that does not parse is no prefix."""
    out = []
    for model, usage in (record.prefixes or {}).items():
        if isinstance(usage, dict) and any(isinstance(usage.get(k), int) and usage[k] > 0
                                           for k in ("prefixes", "restored")):
            out.append(model)
    return sorted(out)


class Scheduler:
    def __init__(self, broker: Broker, config: NodeConfig, owner: str, policy: Policy | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.broker, self.config, self.owner = broker, config, owner
        self.clock = clock or broker.now  # heartbeats and the lease are compared on the broker's time
        self.policy = policy or Policy(min_residency_s=config.min_residency_s)
        self.lease = LeaderLease(broker, owner, config.scheduler_lease_s, clock=clock)
        self.tracker = DemandTracker()
        self.last: Placement | None = None
        self.rounds = 0
        self._unplaced: dict[str, str] = {}

    def step(self) -> Placement | None:
        """One round, if this scheduler leads: None when another holds the lease."""
        if not self.lease.hold():
            return None
        now = self.clock()
        current = read_assignments(self.broker)
        records = self.broker.nodes()
        views, devices, fixed_nodes = fleet_views(records, {k: v[0] for k, v in current.items()}, now,
                                                  lost_after(self.config.heartbeat_s))
        demand = self.tracker.update(self.broker.demand(), now)
        fit = planner_fit(devices, self.config, {r.id: r.throughput for r in records if r.throughput})
        fixed: dict[str, float] = {}
        wanted = {d.model for d in demand}
        for r in fixed_nodes:  # derated and paused as the policy derates and pauses the nodes it places on
            h = health_of(r)
            for m in wanted & set(r.models):
                fixed[m] = fixed.get(m, 0.0) + (0.0 if h["paused"] else (r.throughput.get(m) or 1.0) * h["freq_ratio"])
        placement = place(views, demand, fit, now, self.policy, fixed)
        self._write(placement, views, fit, current, now)
        self.last, self.rounds = placement, self.rounds + 1
        return placement

    def _write(self, placement: Placement, views: list[NodeView], fit: FitFn,
               current: dict[str, tuple[Assignment, int]], now: float) -> None:
        by_id = {v.id: v for v in views}
        for v in views:
            held = placement.assignments.get(v.id, {})  # a lost node's: nothing
            old = current.get(v.id)
            if old is not None and {m.model: m.since for m in old[0].models} == held:
                continue
            mine = [x for x in placement.reasons if f" {v.id}" in x or x.startswith(f"{v.id} ")]
            doc = Assignment(node=v.id, models=[Assigned(model=m, since=since, settings=dict(fit(by_id[v.id], m)
                                                                                            .settings))
                                                for m, since in sorted(held.items())],
                             generation=(old[0].generation + 1) if old else 1, written_at=now, scheduler=self.owner,
                             reasons=mine[-20:])
            ok = (self.broker.doc_put(ASSIGNMENT, v.id, doc.model_dump(mode="json"), version=old[1]) if old
                  else self.broker.doc_put(ASSIGNMENT, v.id, doc.model_dump(mode="json")))
            if ok:
                log.info("assignment of %s (generation %d): %s", v.id, doc.generation,
                         ", ".join(doc.names) or "nothing")
                for reason in mine:
                    log.info("  %s", reason)
                before = set(old[0].names) if old else set()
                self._event({"kind": "assigned", "node": v.id, "generation": doc.generation,
                             "added": sorted(set(doc.names) - before), "evicted": sorted(before - set(doc.names)),
                             "reasons": mine[-5:], "scheduler": self.owner})
            else:
                log.warning("assignment of %s changed meanwhile: written again next round", v.id)
        if placement.unplaced != self._unplaced:  # said once per change, not every round
            for m, why in sorted(placement.unplaced.items()):
                log.warning("%s not placed: %s", m, why)
                if self._unplaced.get(m) != why:
                    self._event({"kind": "unplaced", "model": m, "why": why, "scheduler": self.owner})
            self._unplaced = dict(placement.unplaced)

    def _event(self, event: dict[str, Any]) -> None:
        """A placement, an eviction or a refusal, in the fleet's event log (the page's Placement events); a
        broker blip loses the event, never the round."""
        try:
            self.broker.record_event(event)
        except Exception as exc:  # noqa: BLE001
            log.debug("scheduler event not recorded: %s", exc)

    def run(self, stop: threading.Event) -> None:
        """Rounds every ``schedule_s`` until ``stop``; a broker that fails is waited out (the nodes keep what they
        hold meanwhile). The lease is given up on a clean stop."""
        while not stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001  (an outage: try again next round)
                log.warning("scheduler round failed: %s: %s", type(exc).__name__, exc)
            stop.wait(self.config.schedule_s)
        try:
            self.lease.release()
        except Exception:  # noqa: BLE001
            pass


def dry_run(records: list[NodeRecord], demand: list[ModelDemand], config: NodeConfig, now: float,
            assigned: dict[str, Assignment] | None = None) -> Placement:
    """The placement the policy would make now, for these nodes (recorded, or from a file) and this demand; every
    node counts as following (a file of recorded nodes says nothing of how they were started)."""
    records = [r.model_copy(update={"follow": True}) for r in records]
    views, devices, _ = fleet_views(records, assigned or {}, now, float("inf"))
    fit = planner_fit(devices, config, {r.id: r.throughput for r in records if r.throughput})
    return place(views, demand, fit, now, Policy(min_residency_s=config.min_residency_s))
