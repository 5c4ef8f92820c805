"""The rows the page lays out, computed by ``ui/views.py`` from the fleet's read model (``fleet/status.py``'s
``FleetStatus``, typed where it is read): each is layout only, words and shares ready for a template.
"""

from __future__ import annotations

from nodeagent.fleet.status import QueueStatus
from nodeagent.values import Frozen


class Row(Frozen):
    """A value the page lays out."""


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
    prefixes: str | None = None  # its warm prefixes, in words


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


class QueueRow(QueueStatus, Row):
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
