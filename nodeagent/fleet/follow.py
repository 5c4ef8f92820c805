"""A node that follows the scheduler (`worker --follow`): it holds what its assignment says, through the model
set's load and evict machinery.

Each look (every ``schedule_s``, between claims) reads the node's assignment (``scheduler.py``). A model newly
assigned is planned here, by this node's own planner (the arbiter: the scheduler planned it on the recorded
probe, this node plans it on the machine as it is now, ledger included), and loaded; one no longer assigned is
retired: never claimed for again, and unloaded once no task holds it (never under a running task). A model the
node cannot hold (it does not fit, it is not on disk and pulls are not allowed, the download or the load failed)
is reported back as refused, with the reason, in the node's record; the scheduler then places it elsewhere.

When there is no assignment, or the broker cannot be read, the node keeps what it holds (fail-static).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from nodeagent.broker.base import Broker
from nodeagent.errors import NodeAgentError, TaskFailed
from nodeagent.fleet.scheduler import Assignment, read_assignment

log = logging.getLogger(__name__)


class AssignmentFollower:
    def __init__(self, broker: Broker, node_id: str, models: Any, make_node: Callable[[str, dict[str, Any]], Any],
                 names_of: Callable[[Any], set[str]], allow_pull: bool, pull: Callable[[str, Any], None] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        """``models``: the node's ModelSet; ``make_node(model, settings)``: a planned Node for an assigned model;
        ``names_of(node)``: the names tasks may bind to it by; ``pull(model, quant)``: download it."""
        self.broker, self.node_id, self.models = broker, node_id, models
        self.make_node, self.names_of, self.allow_pull, self.pull = make_node, names_of, allow_pull, pull
        self.clock = clock or broker.now  # the broker's time: what the followed_at it shows is compared with
        models.following = True
        self.generation = 0
        self.followed_at: float | None = None
        self.refused: dict[str, str] = {}

    def status(self) -> dict[str, Any]:
        """What the node's record says of it (the scheduler reads ``refused`` for this generation)."""
        return {"generation": self.generation, "followed_at": self.followed_at,
                "held": [m.name for m in self.models.members if m.loaded and not m.retired],
                "refused": dict(self.refused)}

    def check(self) -> bool:
        """Follow the assignment if it changed; True when it did. A broker that fails is waited out (fail-static):
        the error goes to the caller's outage handling."""
        assignment = read_assignment(self.broker, self.node_id)
        if assignment is None or assignment.generation == self.generation:
            self.models.reap()  # retired models whose tasks ended since the last look
            return False
        self.follow(assignment)
        return True

    def follow(self, a: Assignment) -> None:
        wanted = {x.model: x for x in a.models}
        self.refused = {}
        for m in list(self.models.members):
            if m.name not in wanted and not m.retired:
                log.info("%s is no longer assigned to this node: retired (unloaded once no task holds it)", m.name)
                self.models.retire(m)
        for name, x in wanted.items():
            member = next((m for m in self.models.members if m.name == name and not m.retired), None)
            try:
                if member is None:
                    member = self._member(name, x.settings)
                self.models.load_now(member, f"assigned by scheduler {a.scheduler or '?'}")
            except (NodeAgentError, TaskFailed, OSError, ValueError) as exc:
                why = getattr(getattr(exc, "info", None), "message", None) or str(exc).splitlines()[0]
                log.warning("cannot hold %s as assigned: %s", name, why)
                self.refused[name] = why[:300]
                if member is not None and not member.loaded:
                    self.models.retire(member)
        self.generation, self.followed_at = a.generation, self.clock()
        log.info("following assignment generation %d: holding %s%s", a.generation,
                 ", ".join(self.status()["held"]) or "nothing",
                 f"; refused {', '.join(sorted(self.refused))}" if self.refused else "")

    def _member(self, name: str, settings: dict[str, Any]) -> Any:
        from nodeagent.modelset import Member

        node = self.make_node(name, settings)
        p = node.plan
        if not p.fits:
            raise ValueError(f"does not fit this node: {p.reasons[-1]}")
        if "://" in p.model or (p.backend != "fake" and not Path(p.model).exists()):
            if not self.allow_pull or self.pull is None:
                raise ValueError("not on this node's disk, and pulls are not allowed (--allow-pull)")
            log.info("pulling %s (%s) as assigned", name, p.quant)
            self.pull(name, p.quant)
            node = self.make_node(name, settings)  # planned again from the file now on disk
        member = Member(name=name, node=node, pinned=True, names=set(self.names_of(node)) | {name})
        self.models.add(member)
        return member
