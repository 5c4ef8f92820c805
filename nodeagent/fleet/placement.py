"""Where each model should run: the scheduler's policy, pure. Nodes, the queue's demand per model and a fit
function (the planner on each node's recorded hardware) in; an assignment per node out, with its reasons.

- Every model with waiting work is placed where it fits, if anywhere (a model with no capacity comes first).
- Capacity follows demand: a model's pressure is its work (waiting, leased, and arrivals over ``horizon_s``)
  over its capacity (the tasks per second of the nodes holding it); the model under the most pressure gets the
  next node, until its capacity drains its work within ``target_drain_s`` or no node can take it.
- No host is ever over its budget: the planner's bytes for each model, and each node process's overhead once,
  summed over the nodes of one host (they share its memory), against the host's budget.
- Churn is bounded: a model placed stays ``min_residency_s`` at least (unless its node is lost), and it gives
  its room to another only when that one's pressure is ``min_gain`` times what its own would become, or when
  it keeps enough capacity elsewhere (or has no work at all).
- Where demand needs more than one node, a model goes to hosts that do not hold it yet first.
- Unhealthy or lost nodes hold nothing; their models are placed elsewhere.
- A node takes a model it has on disk, or any when its operator allowed pulls (``--allow-pull``); among
  equal candidates, the one with the file is preferred, then one that holds the model's warm prefixes (a load
  there reads the prompts' prefixes back from its disk: ``backends/prefix_store.py``).
- The device's health, as each node's guard reports it: a node's throughput is derated by its CPU's clock against
  its maximum (``freq_ratio``: a Pi at 60 % of its clock serves about 60 % of the tasks); a node paused for heat,
  battery or memory pressure takes no new model, and what it holds counts no capacity while the pause lasts (it
  keeps it: the pause is usually short); a node under memory pressure (``holding``) takes no new model; between
  nodes that fit, one on mains power, then a cool one, is preferred.

``place`` is called each round by ``fleet/scheduler.py``, by `nodeagent schedule --dry-run`, and by the
simulation in ``benchmarks/scheduler_sim.py``.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable

from pydantic import Field

from nodeagent.config import default_of
from nodeagent.values import Frozen

GIB = 1 << 30


class Policy(Frozen):
    horizon_s: float = Field(60.0, description="Arrivals over this long count as work waiting")
    target_drain_s: float = Field(120.0, description="Enough capacity drains a model's work within this")
    min_residency_s: float = Field(default_factory=lambda: default_of("min_residency_s"),
                                   description="A placed model stays at least this long")
    min_gain: float = Field(2.0, description="A model takes another's room only at this many times its pressure")


class NodeView(Frozen):
    id: str
    host: str = Field(description="Nodes of one host share its memory")
    healthy: bool = True
    held: dict[str, float] = Field(default_factory=dict, description="Model -> since when it is assigned here")
    on_disk: list[str] = Field(default_factory=list, description="Models whose file this node has")
    prefixes: list[str] = Field(default_factory=list, description="Models whose warm prefixes this node holds on "
                                                                  "disk: there a load reads them back rather than "
                                                                  "reading their prompts again")
    allow_pull: bool = Field(default_factory=lambda: default_of("allow_pull"))
    refused: dict[str, str] = Field(default_factory=dict, description="Models the node could not load, and why")
    paused: str = Field("", description="What its guard paused it for (heat, battery, pressure) and why: it takes "
                                        "no new model, and what it holds counts no capacity meanwhile")
    holding: str = Field("", description="Why it loads no further model (memory pressure): it takes no new one")
    freq_ratio: float = Field(1.0, gt=0, le=1, description="Its CPU's clock against its maximum while throttled: "
                                                           "its throughput is derated by it")
    on_battery: bool = False
    warm: bool = Field(False, description="Near its temperature limit, its clock capped, or under thermal pressure")

    @property
    def takes_new(self) -> bool:
        return not self.paused and not self.holding


class Fit(Frozen):
    fits: bool = Field(description="Fits on this node's device alone (the planner's verdict)")
    added_bytes: int = Field(0, description="What holding it adds (its plan less the process overhead)")
    overhead_bytes: int = Field(0, description="The node process before any model (charged once)")
    budget_bytes: int = Field(0, description="The host's budget")
    tasks_per_s: float = Field(0.0, description="This node's throughput on the model (bench, else the planner)")
    settings: dict[str, object] = Field(default_factory=dict, description="The plan's settings to load it with")
    download: bool = Field(True, description="Its weights must be on the node's disk or be pulled (the fake "
                                             "backend has none)")
    why: str = ""


class ModelDemand(Frozen):
    model: str
    waiting: int = Field(0, description="Ready, delayed and leased tasks bound to the model")
    arrivals_per_s: float = 0.0


class Placement(Frozen):
    assignments: dict[str, dict[str, float]] = Field(description="Node -> model -> since")
    reasons: list[str]
    unplaced: dict[str, str] = Field(default_factory=dict, description="Models with work that no node took")
    loads: int = 0
    unloads: int = 0


FitFn = Callable[[NodeView, str], Fit]


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def rate(node: NodeView, model: str, fit: FitFn) -> float:
    """The tasks per second the node gives the model now: its fit's throughput derated by its CPU's clock, and
    none while its guard has it paused."""
    return 0.0 if node.paused else fit(node, model).tasks_per_s * node.freq_ratio


class _State:
    """The placement under construction: what each node holds, each host's bytes, each model's capacity."""

    def __init__(self, nodes: list[NodeView], fit: FitFn) -> None:
        self.nodes = {n.id: n for n in nodes}
        self.fit = fit
        self.held: dict[str, dict[str, float]] = {n.id: {} for n in nodes}
        self.host_nodes: dict[str, list[str]] = {}
        for n in nodes:
            self.host_nodes.setdefault(n.host, []).append(n.id)
        self.capacity: dict[str, float] = {}
        self.hosts_of: dict[str, dict[str, int]] = {}  # model -> host -> nodes holding it there

    def node_bytes(self, nid: str, models: list[str]) -> int:
        """A node process holding ``models``: its overhead once, and what each model adds (nothing when empty)."""
        if not models:
            return 0
        node = self.nodes[nid]
        return self.fit(node, models[0]).overhead_bytes + sum(self.fit(node, m).added_bytes for m in models)

    def host_used(self, host: str) -> int:
        return sum(self.node_bytes(nid, list(self.held[nid])) for nid in self.host_nodes[host])

    def add(self, nid: str, model: str, since: float) -> None:
        self.held[nid][model] = since
        node = self.nodes[nid]
        self.capacity[model] = self.capacity.get(model, 0.0) + rate(node, model, self.fit)
        hosts = self.hosts_of.setdefault(model, {})
        hosts[node.host] = hosts.get(node.host, 0) + 1

    def remove(self, nid: str, model: str) -> None:
        del self.held[nid][model]
        node = self.nodes[nid]
        self.capacity[model] = max(0.0, self.capacity.get(model, 0.0) - rate(node, model, self.fit))
        hosts = self.hosts_of[model]
        hosts[node.host] -= 1
        if not hosts[node.host]:
            del hosts[node.host]

    def room_after(self, nid: str, model: str, evict: list[str]) -> int:
        """Bytes left on the node's host if ``model`` joins the node and ``evict`` leave it (negative: over)."""
        node = self.nodes[nid]
        used = 0
        for other in self.host_nodes[node.host]:
            models = [m for m in self.held[other] if not (other == nid and m in evict)]
            used += self.node_bytes(other, models + [model] if other == nid else models)
        return self.fit(node, model).budget_bytes - used


def place(nodes: list[NodeView], demand: list[ModelDemand], fit: FitFn, now: float,
          policy: Policy | None = None, fixed: dict[str, float] | None = None) -> Placement:
    """``fixed``: tasks/s per model of nodes the scheduler does not place on (started with --model alone)."""
    return _Placer(nodes, demand, fit, now, policy or Policy(), fixed or {}).run()


class _Placer:
    """One placement: what stays, then the model under the most pressure placed on its best node, again and again,
    a model that may give its place up making room (``may_leave``), until every model with work is covered or
    nothing more can be placed."""

    def __init__(self, nodes: list[NodeView], demand: list[ModelDemand], fit: FitFn, now: float, policy: Policy,
                 fixed: dict[str, float]) -> None:
        self.nodes, self.fit, self.now, self.policy = nodes, fit, now, policy
        self.reasons: list[str] = []
        self.healthy = [n for n in nodes if n.healthy]
        self.st = _State(self.healthy, fit)
        self.st.capacity.update(fixed)
        self.loads = self.unloads = 0
        self.work = {d.model: d.waiting + d.arrivals_per_s * policy.horizon_s for d in demand}
        self.waiting = {d.model: d.waiting for d in demand}
        self.candidates: dict[str, list[NodeView]] = {}

    def run(self) -> Placement:
        self.say_why_nodes_take_nothing()
        self.keep_what_fits()
        unplaced = self.place_by_pressure()
        st, work = self.st, self.work
        for m in sorted(work):
            if work[m] > 0 and st.capacity.get(m, 0.0) <= 0 and m not in unplaced:
                unplaced[m] = _why_not(m, self.healthy, self.fit, st, self.waiting.get(m, 0))
        for m, why in sorted(unplaced.items()):
            self.reasons.append(f"{m} not placed: {why}")
        return Placement(assignments={nid: dict(held) for nid, held in st.held.items()}, reasons=self.reasons,
                         unplaced=unplaced, loads=self.loads, unloads=self.unloads)

    def say_why_nodes_take_nothing(self) -> None:
        for n in self.nodes:
            if not n.healthy and n.held:
                self.reasons.append(f"{n.id} is unhealthy or lost: {', '.join(sorted(n.held))} to be placed elsewhere")
            elif n.paused:
                self.reasons.append(f"{n.id} is paused ({n.paused}): it takes no new model"
                                    + (f" and keeps {', '.join(sorted(n.held))}, counted at no capacity meanwhile"
                                       if n.held else ""))
            elif n.holding:
                self.reasons.append(f"{n.id} loads no further model ({n.holding})")

    def keep_what_fits(self) -> None:
        """What each healthy node holds now stays, where it still fits (a model its node refused is dropped)."""
        for n in self.healthy:
            for model, since in sorted(n.held.items(), key=lambda kv: kv[1]):
                if model in n.refused:
                    self.reasons.append(f"{model} leaves {n.id}: the node could not load it ({n.refused[model]})")
                    self.unloads += 1
                    continue
                if self.st.room_after(n.id, model, []) >= 0 and self.fit(n, model).fits:
                    self.st.add(n.id, model, since)
                else:
                    self.reasons.append(f"{model} leaves {n.id}: it no longer fits there")
                    self.unloads += 1

    def want(self, m: str) -> float:
        return self.work.get(m, 0.0) / self.policy.target_drain_s

    def pressure(self, m: str, capacity: float | None = None) -> float:
        cap = self.st.capacity.get(m, 0.0) if capacity is None else capacity
        w = self.work.get(m, 0.0)
        if w <= 0:
            return 0.0
        return math.inf if cap <= 0 else w / cap

    def may_leave(self, e: str, nid: str, since: float, claimant: float) -> bool:
        """Whether model ``e`` may give up its place on ``nid`` to a model of pressure ``claimant``."""
        if self.now - since < self.policy.min_residency_s and math.isfinite(claimant):
            return False
        if self.work.get(e, 0.0) <= 0:
            return True
        left = self.st.capacity.get(e, 0.0) - rate(self.st.nodes[nid], e, self.fit)
        if left <= 0:
            return False  # its last node: a model with work is never uncovered to cover another
        return left >= self.want(e) or claimant >= self.policy.min_gain * self.pressure(e, left)

    def candidates_for(self, m: str) -> list[NodeView]:
        if m not in self.candidates:
            fit = self.fit
            usable = [n for n in self.healthy if n.takes_new and m not in n.refused and _may_get(n, m, fit)
                      and fit(n, m).fits]
            usable.sort(key=lambda n: (m not in n.on_disk, m not in n.prefixes, n.on_battery, n.warm,
                                       -rate(n, m, fit), n.id))
            self.candidates[m] = usable
        return self.candidates[m]

    def best_node(self, m: str) -> tuple[NodeView, list[str]] | None:
        st, p = self.st, self.pressure(m)
        best: tuple[tuple, NodeView, list[str]] | None = None
        spread = st.hosts_of.get(m, {})
        for n in self.candidates_for(m):
            if m in st.held[n.id]:
                continue
            evict: list[str] = []
            if st.room_after(n.id, m, []) < 0:
                for e, since in sorted(st.held[n.id].items(), key=lambda kv: self.pressure(kv[0])):
                    if not self.may_leave(e, n.id, since, p):
                        continue
                    evict.append(e)
                    if st.room_after(n.id, m, evict) >= 0:
                        break
                if st.room_after(n.id, m, evict) < 0:
                    continue
            key = (len(evict), n.host in spread, m not in n.on_disk, m not in n.prefixes, n.on_battery, n.warm,
                   -rate(n, m, self.fit))
            if best is None or key < best[0]:
                best = (key, n, evict)
                if key[:6] == (0, False, False, False, False, False):
                    break  # room, a new host, the file and warm prefixes there, mains, cool: the candidates are
                    # sorted so already
        return None if best is None else (best[1], best[2])

    def place_by_pressure(self) -> dict[str, str]:
        """The models with work placed, the one under the most pressure first; those that found no node, and why."""
        st, work = self.st, self.work
        heap = [(-self.pressure(m), m) for m in sorted(work) if work[m] > 0]
        heapq.heapify(heap)
        satisfied: set[str] = set()
        unplaced: dict[str, str] = {}
        steps = 0
        limit = 4 * len(self.healthy) + 4 * len(work) + 16
        while heap and steps < limit:
            steps += 1
            neg, m = heapq.heappop(heap)
            if -neg != self.pressure(m) or m in satisfied:
                if m not in satisfied and self.pressure(m) > 0:
                    heapq.heappush(heap, (-self.pressure(m), m))
                continue
            if st.capacity.get(m, 0.0) > 0 and st.capacity[m] >= self.want(m):
                satisfied.add(m)
                continue
            choice = self.best_node(m)
            if choice is None:
                if st.capacity.get(m, 0.0) <= 0:
                    unplaced[m] = _why_not(m, self.healthy, self.fit, st, self.waiting.get(m, 0))
                satisfied.add(m)
                continue
            n, evict = choice
            for e in evict:
                self.evict(n, e, m)
                if work.get(e, 0) > 0:
                    satisfied.discard(e)
                    heapq.heappush(heap, (-self.pressure(e), e))
            self.load(n, m)
            heapq.heappush(heap, (-self.pressure(m), m))
        return unplaced

    def evict(self, n: NodeView, e: str, m: str) -> None:
        self.st.remove(n.id, e)
        self.unloads += 1
        self.reasons.append(f"{e} leaves {n.id} for {m}: " + (
            "no work waiting for it" if self.work.get(e, 0) <= 0 else
            f"its pressure there {self.pressure(e):,.0f} s of work per node-second against "
            f"{self.pressure(m):,.0f} s"))

    def load(self, n: NodeView, m: str) -> None:
        st, fit = self.st, self.fit
        f = fit(n, m)
        first = st.capacity.get(m, 0.0) <= 0
        st.add(n.id, m, self.now)
        self.loads += 1
        used = st.host_used(n.host)
        self.reasons.append(
            f"{m} placed on {n.id}: {self.waiting.get(m, 0):,} tasks waiting"
            + (f", {st.capacity[m]:.1f} tasks/s now" if not first else "")
            + f"; fits in {_gib(used)} of {_gib(f.budget_bytes)}"
            + ("" if m in n.on_disk or not f.download else " (to be pulled)")
            + (f"; its CPU at {n.freq_ratio:.0%} of its clock (throttled): counted at "
               f"{rate(n, m, fit):.2f} of its {f.tasks_per_s:.2f} tasks/s" if n.freq_ratio < 1 else "")
            + _not_on(m, n, self.healthy, fit, st))


def _may_get(n: NodeView, m: str, fit: FitFn) -> bool:
    """The node has the model's file, may pull it, or needs none."""
    return m in n.on_disk or n.allow_pull or not fit(n, m).download


def _not_on(m: str, chosen: NodeView, healthy: list[NodeView], fit: FitFn, st: _State) -> str:
    """One node it was not put on, and why (the reasons say what was weighed)."""
    for n in healthy:
        if n.id == chosen.id or m in st.held[n.id]:
            continue
        if not n.takes_new:
            return f"; not on {n.id}: {n.paused or n.holding}"
        f = fit(n, m)
        if not f.fits:
            return f"; not on {n.id}: {f.why or 'does not fit'}"
        if not _may_get(n, m, fit):
            return f"; not on {n.id}: not on its disk and it may not pull"
        room = st.room_after(n.id, m, [])
        if room < 0:
            return f"; not on {n.id}: needs {_gib(f.added_bytes)}, {_gib(f.added_bytes + room)} left"
    return ""


def _why_not(m: str, healthy: list[NodeView], fit: FitFn, st: _State, waiting: int) -> str:
    if not healthy:
        return f"{waiting:,} tasks waiting and no healthy node"
    fits = [n for n in healthy if fit(n, m).fits]
    if not fits:
        f = fit(healthy[0], m)
        return f"{waiting:,} tasks waiting; it fits on no node ({healthy[0].id}: {f.why or 'too large'})"
    open_ = [n for n in fits if n.takes_new]
    if not open_:
        return (f"{waiting:,} tasks waiting; it fits on {len(fits)} node(s), all paused (heat, battery, memory "
                f"pressure): {fits[0].id}: {fits[0].paused or fits[0].holding}")
    allowed = [n for n in open_ if _may_get(n, m, fit) and m not in n.refused]
    if not allowed:
        return (f"{waiting:,} tasks waiting; it fits on {len(fits)} node(s), none of which has the file or may "
                "pull it (--allow-pull)")
    return (f"{waiting:,} tasks waiting; it fits on {len(allowed)} node(s), all holding models that may not give "
            "up their room yet (residency, or their own work)")
