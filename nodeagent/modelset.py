"""A node's model set: several models under one memory budget, each loaded at its first task (or at start when
pinned), kept for ``keep_alive_s`` after its last use, and unloaded least recently used first when another
needs the room; never under a running task, never a pinned one, never over budget.

The budget is the plan's (what the planner allows this machine, less nothing: the process overhead is charged
once, each model its plan less that overhead). Every load and unload is logged with its reason and counted.

**Work waits by model, and a swap waits for the running work.** Tasks and requests take their model in the order
they came (a queue of tickets): one whose model is loaded runs at once, unless an older one waits for a model that
is not, which then goes first. That one loads as soon as there is room: idle models are unloaded for it (least
recently used first); while the models it would replace are running work, new work still starts on them for a
while (``swap_after_s``: their stream of work has its pause, and one swap serves a group), then no more, so the
running work ends and the swap comes. Once it loads, every ticket waiting for it starts together, wherever it
stood in the queue. So requests that alternate between two models that cannot be
loaded together are served in groups, one swap a group, and none is refused for it; a ticket waits up to
``wait_s`` for its turn, then fails with the retryable ``model_unavailable``. Only a model that cannot fit at all
(beside the pinned ones) is refused at once.

Under memory pressure (the guard's ``hold_models``, set as ``hold``) it loads no further model (a task for one not
loaded fails with the retryable ``model_unavailable``, for a node with room to take) and unloads the idle ones at
the next reap: all but the pinned, the running and the most recently used, which it keeps serving.

It offers the worker what a Node does (``run``), with the task's model (the envelope's) choosing the member.
The clock and the members' Nodes are injected, so the policy is tested on the fake backend with made-up sizes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from nodeagent import classify_routes
from nodeagent.classify_routes import RouteChooser
from nodeagent.config import default_of
from nodeagent.errors import BackendError, NodeAgentError, TaskFailed
from nodeagent.model_names import match
from nodeagent.tasks.contracts import ClassifyTask, Result

log = logging.getLogger(__name__)


@dataclass
class Member:
    name: str
    node: Any  # a Node, planned, loaded on demand
    pinned: bool = False
    names: set[str] = field(default_factory=set)  # every name a task may give it (routing names)
    in_use: int = 0
    last_used: float = 0.0
    keep_alive_s: float | None = None  # a request's own (Ollama's keep_alive), over the set's; < 0: forever
    loads: int = 0
    unloads: int = 0
    retired: bool = False  # no longer assigned (a following node): unloaded and dropped once no task holds it

    @property
    def loaded(self) -> bool:
        return bool(self.node.loaded)

    @property
    def added_bytes(self) -> int:
        """What loading it adds: its plan less the process overhead (charged once for the set: the planner's
        rule, ``planner/modelset.py``)."""
        from nodeagent.planner.modelset import added_bytes

        return added_bytes(self.node.plan)


@dataclass(eq=False)
class _Ticket:
    """A task or request waiting for its model (``member``), in the order they came."""

    member: Member
    since: float  # when it came (the set's clock)
    grouped: bool = False  # it was waiting when its model loaded: it starts with that group, whatever its place


class ModelSet:
    def __init__(self, members: list[Member], budget_bytes: int | None = None,
                 keep_alive_s: float = default_of("keep_alive_s"), wait_s: float = default_of("model_wait_s"),
                 clock: Callable[[], float] = time.monotonic, overhead_bytes: int | None = None) -> None:
        """An empty set (a following node before its first assignment) needs ``budget_bytes`` and
        ``overhead_bytes``; otherwise they come from the members' plans."""
        if not members and (budget_bytes is None or overhead_bytes is None):
            raise ValueError("a model set needs a model, or a budget and an overhead")
        self.members = members
        plans = [m.node.plan for m in members]
        # the process overhead is charged once, as the set's plan charges it
        self.overhead_bytes = overhead_bytes if overhead_bytes is not None else max(p.memory.overhead_bytes
                                                                                    for p in plans)
        self.budget_bytes = min(p.budget.host_limit_bytes for p in plans) if budget_bytes is None else budget_bytes
        self.keep_alive_s, self.wait_s, self.clock = keep_alive_s, wait_s, clock
        self._cond = threading.Condition()
        self._tickets: list[_Ticket] = []  # who waits for its model, oldest first
        self.routes = RouteChooser(clock)  # a classify task naming no model: the route measured best
        for m in members:
            if self.overhead_bytes + m.added_bytes > self.budget_bytes and self.budget_bytes:
                raise ValueError(f"{m.name} alone ({m.node.plan.memory.total_bytes} bytes) is over the set's "
                                 f"budget of {self.budget_bytes} bytes")

    # -- what the doors ask -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the pinned models (the worker calls it before it claims)."""
        for m in self.members:
            if m.pinned and not m.loaded:
                self.load_now(m, "pinned")

    def member(self, model: str | None, task_type: str | None = None) -> Member:
        """The member a task or request names (any of its names, in any case), or for one naming none the first
        loaded member of a kind that runs ``task_type`` (an embedding model for embed.v1, a generator for
        extract.v1; of the kinds that run it, the one it ``prefers`` first: a reranker for rerank.v1), else the first
        such member. A retired member (no longer assigned) serves what it holds."""
        from nodeagent.tasks import registry

        with self._cond:
            members = list(self.members)
        if model is not None:
            for m in members:
                if match(model, (m.name, *m.names)) is not None:
                    return m
            raise TaskFailed("model_unavailable" if self.following else "invalid_task",
                             f"this node does not serve the model {model!r}", self.following)
        if task_type is not None:
            members = [m for m in members if registry.runs(task_type, m.node.kind)] or members
            prefers = registry.preferred(task_type)
            members.sort(key=lambda m: m.node.kind is not prefers)  # (a reranker before a generator for rerank)
        loaded = [m for m in members if m.loaded and not m.retired]
        serving = loaded or [m for m in members if not m.retired]
        if not serving:
            raise TaskFailed("model_unavailable", "this node holds no model yet", True)
        return serving[0]

    # -- what a following node changes (fleet/follow.py) --------------------------------------------------------
    following = False  # a node that follows the scheduler: its members come and go
    hold: Callable[[], str | None] | None = None  # why no further model may load now (the guard's), or None
    # a label set's registered labelled set (the fleet's, fleet/labelled_sets.py: its version and texts), or None
    registered: Callable[[list[Any]], Any] | None = None

    def _held(self, m: Member) -> None:
        """TaskFailed(model_unavailable) when ``m`` would have to load while the guard holds loads back."""
        why = self.hold() if self.hold is not None and not m.loaded else None
        if why:
            raise TaskFailed("model_unavailable", f"{m.name} is not loaded, and no model loads now: {why}", True)

    def add(self, member: Member) -> None:
        with self._cond:
            if any(m.name == member.name for m in self.members):
                raise ValueError(f"{member.name} is in the set already")
            self.members.append(member)

    def load_now(self, m: Member, why: str) -> None:
        """Load ``m`` (an assignment), in its turn among the waiting work as a task's model would be;
        TaskFailed(model_unavailable) when none comes within wait_s."""
        with self._turn(m, why):
            pass

    def retire(self, m: Member) -> None:
        """No longer wanted: never claimed for again, unloaded and dropped once no task holds it."""
        with self._cond:
            m.retired, m.pinned = True, False
        self.reap()

    def run(self, task: Any, *, model: str | None = None, **kwargs: Any) -> Result:
        """Run a task on its model, loading it first when it must (the Node's ``run`` otherwise). A classify task
        naming no model, on a set holding models of several kinds that classify, goes by the route measured best
        on its examples (``classify_routes.py``)."""
        if model is None and isinstance(task, ClassifyTask):
            routes = self.classify_routes()
            if len(routes) > 1:
                return self._routed(task, routes, kwargs)
        try:
            m = self.member(model, task.type)
            self.acquire(m)
        except TaskFailed as exc:
            return Result(task_id=task.id, type=task.type, status="error", attempts=kwargs.get("attempt", 1),
                          error=exc.info)
        try:
            return m.node.run(task, **kwargs)
        finally:
            self.release(m)

    def classify_routes(self) -> list[str]:
        """One member of each kind that classifies (the loaded one first), the embedding model's first: the routes a
        classify task naming no model is measured on."""
        with self._cond:
            members = [m for m in self.members if not m.retired]
        members.sort(key=lambda m: not m.loaded)
        return classify_routes.routes_of((m.node.kind, m.name) for m in members)

    def _routed(self, task: ClassifyTask, routes: list[str], kwargs: dict[str, Any]) -> Result:
        """``task`` by the route its examples measured best, or without examples its label set's registered set (the
        embedding model's without either, said)."""
        stop = kwargs.get("stop")
        try:
            plan = classify_routes.routed(task, routes, self.routes,
                                          lambda sub, route: self.run(sub, model=route, stop=stop), self.registered)
        except TaskFailed as exc:
            return Result(task_id=task.id, type=task.type, status="error", attempts=kwargs.get("attempt", 1),
                          error=exc.info)
        return classify_routes.answered(task, routes, plan, [self.run(t, model=r, **kwargs) for t, r in plan.runs])

    def acquire(self, m: Member) -> None:
        """``m`` loaded and marked in use, in its turn (the class's docstring); TaskFailed(model_unavailable) when
        its turn does not come within wait_s, or at once when it cannot fit at all."""
        with self._turn(m, "a task needs it"):
            m.in_use += 1
            m.last_used = self.clock()

    def release(self, m: Member, keep_alive_s: float | None = None) -> None:
        """The task on ``m`` ended; ``keep_alive_s``: how long to keep it from now (a request's keep_alive)."""
        with self._cond:
            m.in_use -= 1
            m.last_used = self.clock()
            if keep_alive_s is not None:
                m.keep_alive_s = keep_alive_s
            self._cond.notify_all()

    def reap(self) -> list[str]:
        """Unload the models idle past their keep-alive, and the retired ones no task holds (the worker calls it
        between claims)."""
        out = []
        with self._cond:
            now = self.clock()
            for m in [x for x in self.members if x.retired and not x.in_use]:
                if m.loaded:
                    self._unload(m, "no longer assigned")
                    out.append(m.name)
                self.members.remove(m)
            for m in self.members:
                keep = self.keep_alive_s if m.keep_alive_s is None else m.keep_alive_s
                if m.loaded and not m.pinned and not m.in_use and keep >= 0 and now - m.last_used >= keep:
                    self._unload(m, f"idle for {now - m.last_used:.0f} s (keep-alive {keep:g} s)")
                    out.append(m.name)
            why = self.hold() if self.hold is not None else None
            if why:  # memory pressure: the idle ones go, the one served last stays
                loaded = sorted((m for m in self.members if m.loaded), key=lambda m: m.last_used)
                for m in loaded[:-1]:
                    if not m.pinned and not m.in_use:
                        self._unload(m, why)
                        out.append(m.name)
        return out

    def loaded_names(self) -> list[str]:
        """Every name of the loaded members (the worker claims their tasks first)."""
        with self._cond:
            return sorted({n for m in self.members if m.loaded and not m.retired for n in (m.name, *m.names)})

    def routing_names(self) -> list[str]:
        """Every name of the members the node claims tasks for (not the retired ones)."""
        with self._cond:
            return sorted({n for m in self.members if not m.retired for n in (m.name, *m.names)})

    def loaded_bytes(self) -> int:
        return self.overhead_bytes + sum(m.added_bytes for m in self.members if m.loaded)

    def state(self) -> list[dict[str, Any]]:
        with self._cond:
            members = list(self.members)
        return [{"model": m.name, "loaded": m.loaded, "pinned": m.pinned, "in_use": m.in_use, "loads": m.loads,
                 "unloads": m.unloads, "planned_bytes": m.node.plan.memory.total_bytes,
                 "slots": m.node.plan.settings.slots, "ctx_per_slot": m.node.plan.settings.ctx_per_slot,
                 **({"retired": True} if m.retired else {})} for m in members]

    def prefix_usage(self) -> dict[str, dict[str, Any]]:
        """Each member's warm prefixes (``Node.prefix_usage``), by its name; the members that keep none left out."""
        with self._cond:
            members = list(self.members)
        return {m.name: usage for m in members if not m.retired and (usage := m.node.prefix_usage())}

    def close(self) -> None:
        for m in self.members:
            m.node.close()

    # -- the policy (under the condition's lock) ----------------------------------------------------------------
    @contextlib.contextmanager
    def _turn(self, m: Member, why: str) -> Iterator[None]:
        """Under the lock, once ``m`` is loaded and its ticket's turn has come (loading it when the turn is to
        load it); the ticket leaves the queue however it ends."""
        with self._cond:
            ticket = _Ticket(m, self.clock())
            self._tickets.append(ticket)
            try:
                self._wait_turn(ticket, why)
                yield
            finally:
                self._tickets.remove(ticket)
                self._cond.notify_all()

    def _wait_turn(self, ticket: _Ticket, why: str) -> None:
        m = ticket.member
        deadline = self.clock() + self.wait_s
        while True:
            older = self._tickets[: self._tickets.index(ticket)]
            first = next((t for t in older if not t.member.loaded), None)  # the oldest waiting for a load
            if m.loaded and (m.pinned or ticket.grouped or first is None or
                             self.clock() - first.since < self.swap_after_s):
                return  # its model is here, and no older ticket has waited long for one that may need its room
            if not m.loaded and first is None:  # its turn to load
                self._held(m)
                if not self._could_fit(m):
                    raise TaskFailed("model_unavailable", f"{m.name} does not fit beside the pinned models "
                                                          f"({self.loaded_bytes()} of {self.budget_bytes} bytes "
                                                          "held)", True)
                if self._make_room(m, why):
                    self._load(m, why)
                    for t in self._tickets:  # every ticket waiting for it starts now, together
                        t.grouped = t.grouped or t.member is m
                    continue
            left = deadline - self.clock()
            if left <= 0:
                raise TaskFailed("model_unavailable", f"{m.name}'s turn did not come within {self.wait_s:g} s: "
                                                      "the models holding the room are running tasks", True)
            self._cond.wait(min(left, 0.1 if first is not None and m.loaded else 1.0))

    @property
    def swap_after_s(self) -> float:
        """How long a ticket waiting for a swap lets new work start on the models it would replace (their stream of
        work has its pause, a swap a group): a third of its own wait, so that the rest is left for the running work
        to end."""
        return self.wait_s / 3

    def _fits(self, m: Member) -> bool:
        return not self.budget_bytes or self.loaded_bytes() + m.added_bytes <= self.budget_bytes

    def _could_fit(self, m: Member) -> bool:
        """Whether ``m`` fits beside the pinned models alone (all others unloaded)."""
        pinned = sum(x.added_bytes for x in self.members if x.loaded and x.pinned and x is not m)
        return not self.budget_bytes or self.overhead_bytes + pinned + m.added_bytes <= self.budget_bytes

    def _make_room(self, m: Member, why: str) -> bool:
        """Idle models unloaded, least recently used first, until ``m`` fits; False while the room is held by
        models running work (they finish, and no new work starts on them meanwhile: ``_wait_turn``)."""
        while not self._fits(m):
            idle = sorted((x for x in self.members if x.loaded and not x.pinned and not x.in_use and x is not m),
                          key=lambda x: x.last_used)
            if not idle:
                return False
            self._unload(idle[0], f"room for {m.name} ({why}); least recently used")
        return True

    def _load(self, m: Member, why: str) -> None:
        t0 = time.perf_counter()
        try:
            m.node.load()
        except NodeAgentError as exc:  # under a task: the task's failure, said as such (never a 500)
            raise load_failed(m.name, exc) from exc
        m.loads += 1
        m.last_used = self.clock()
        log.info("loaded %s (%s) in %.2f s: %d of %d bytes held", m.name, why, time.perf_counter() - t0,
                 self.loaded_bytes(), self.budget_bytes)

    def _unload(self, m: Member, why: str) -> None:
        m.node.close()
        m.unloads += 1
        _trim()
        log.info("unloaded %s: %s", m.name, why)


def load_failed(name: str, exc: NodeAgentError) -> TaskFailed:
    """A member that could not be loaded for a task, as the task's error: ``backend_error`` where the backend failed
    (llama.cpp could not load its file), ``model_unavailable`` where this machine cannot load its plan; both
    retryable (another node may), both naming the model and why."""
    if isinstance(exc, TaskFailed):
        return exc
    code = "backend_error" if isinstance(exc, BackendError) else "model_unavailable"
    return TaskFailed(code, f"{name} could not be loaded: {exc}", True, hint=exc.hint)


def _trim() -> None:
    """Give freed heap back to the OS (glibc keeps freed arenas; another model's load then adds to them)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass



def keep_alive_seconds(value: float | str | None) -> float | None:
    """Ollama's ``keep_alive``: seconds, or a duration (``30s``, ``5m``, ``1h``); negative keeps the model
    loaded; 0 unloads it once the request ends (at the next look). ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * units[unit]
    return float(text)


__all__ = ["Member", "ModelSet", "keep_alive_seconds"]
