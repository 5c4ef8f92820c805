"""The page's read model as typed values: what it reads of the snapshot (a node, a queue, an assignment, a batch,
each parsed once, leniently: a field a record lacks is None), and the rows it lays out.

A record that does not parse (a field of the wrong type: an older or a broken node) is caught here, at the one
parse (``NodeSeen.read``), and shown as unreadable; nothing downstream guards against odd values. Rows read by
name both ways, ``row.id`` as the templates do and ``row["id"]``, as the dicts they replaced did.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from nodeagent.broker.base import QueueStats
from nodeagent.values import Frozen


class Seen(Frozen):
    """A value the page reads from the snapshot: other fields ignored (as every ``Frozen`` does), any it names may
    be missing."""


class Row(Frozen):
    """A value the page lays out."""

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)


# -- what the page reads -----------------------------------------------------------------------------------------
class MemberSeen(Seen):
    model: str | None = None
    loaded: bool | None = None
    pinned: bool | None = None
    slots: int | None = None
    in_use: int | None = None
    planned_bytes: int | None = None


class HealthSeen(Seen):
    temperature_c: float | None = None
    thermal: str | None = None
    throttled: bool | None = None
    freq_ratio: float | None = None
    undervolted: bool | None = None
    on_battery: bool | None = None
    battery_pct: float | None = None
    memory_pressure: str | None = None


class GuardSeen(Seen):
    state: str | None = None
    reason: str | None = None
    pause: str | None = None


class NodeSeen(Seen):
    """A node as the snapshot holds it (``fleet/status.py``'s ``node_row``)."""

    id: str = "?"
    hostname: str | None = None
    chip: str | None = None
    arch: str | None = None
    os: str | None = None
    status: str | None = None
    state: str | None = None
    lost: bool | None = None
    heartbeat_age_s: float | None = None
    model: str | None = None
    models: list[str] | None = None
    model_set: list[MemberSeen] | None = None
    planned_bytes: int | None = None
    slots: int | None = None
    in_flight: int | None = None
    guard_status: GuardSeen | None = None
    guard: str | None = None
    health: HealthSeen | None = None
    clock_offset_s: float | None = None
    completed: int | None = None
    failed: int | None = None
    backend: str | None = None
    agent_version: str | None = None
    contract: str | None = None
    deferred: int | None = None
    ram_total_bytes: int | None = None
    ram_available_bytes: int | None = None
    follow: bool | None = None

    @classmethod
    def read(cls, record: Any) -> "NodeSeen | str":
        """The record parsed, or why it cannot be (the first field that does not parse)."""
        try:
            return cls.model_validate(record)
        except ValidationError as exc:
            first = exc.errors()[0]
            return f"{'.'.join(str(p) for p in first['loc']) or 'the record'}: {first['msg']}"

    @property
    def members(self) -> list[MemberSeen]:
        return self.model_set or []

    @property
    def pause(self) -> str | None:
        return self.guard_status.pause if self.guard_status else None


class AssignmentSeen(Seen):
    node: str
    models: list[str] = []
    generation: int | None = None
    followed_generation: int | None = None
    refused: dict[str, str] = {}


class BatchSeen(Seen):
    id: str | None = None
    status: str | None = None
    endpoint: str | None = None
    request_counts: dict[str, int] = {}
    created_at: float | None = None
    in_progress_at: float | None = None


class QueueSeen(QueueStats):
    trend: str = "-"


# -- what the page lays out --------------------------------------------------------------------------------------
class MemoryBar(Row):
    total: int
    used: int | None
    planned: int
    used_pct: float
    planned_pct: float
    text: str


class ModelRow(Row):
    name: str
    state: str  # loaded | unloaded
    pinned: bool
    slots: int | None
    in_use: int


class NodeRow(Row):
    id: str
    host: str
    machine: str
    status: str  # ok | stale | lost | stopped | unreadable
    state: str
    age: str
    models: list[ModelRow]
    memory: MemoryBar
    guard: str
    guard_reason: str
    health: list[str]
    clock: str
    clock_off: bool
    done: int
    failed: int
    in_flight: int
    backend: str
    version: str
    deferred: int
    operator: bool


class QueueRow(QueueSeen, Row):
    oldest: str
    ok: int
    failures: int
    wait_p50: str
    wait_p95: str
    run_p50: str
    run_p95: str


class NodeCount(Row):
    node: str
    ok: int
    failed: int


class PlacementCell(Row):
    model: str
    assigned: bool
    held: bool
    loaded: bool
    refused: str | None
    kind: str  # ok | missing | extra | none


class PlacementRow(Row):
    node: str
    follow: bool
    cells: list[PlacementCell]
    generation: int | None
    followed: int | None


class BatchRow(Row):
    id: str | None
    status: str | None
    endpoint: str | None
    total: int
    completed: int
    failed: int
    pct: float
    ok_pct: float
    created: str
    eta: str
    active: bool


class DeadRow(Row):
    id: str
    queue: str
    attempts: int
    code: str
    message: str
    node: str
    nodes: str


class AttemptRow(Row):
    attempt: int
    node: str
    started: str
    took: str
    outcome: str
    message: str
