"""What each page shows, from the snapshot (and, for the lists that are read page by page, the broker): typed rows
for the templates (``ui/rows.py``), computed here so the templates only lay them out. Pure: the tests feed it
generated snapshots and stores."""

from __future__ import annotations

import json
import math
from typing import Any

from nodeagent.broker.base import Broker, TaskView
from nodeagent.fleet.history import History
from nodeagent.fleet.status import BatchStatus, NodeHealth, NodeStatus, PrefixStatus
from nodeagent.ui.rows import (
    AttemptRow,
    BatchRow,
    DeadRow,
    MemoryBar,
    ModelRow,
    NodeCount,
    NodeRow,
    PlacementCell,
    PlacementRow,
    QueueRow,
)
from nodeagent.ui.snapshot import Snapshot
from nodeagent.units import GIB, format_bytes

PAGE_SIZE = 50
PAST_THE_END = 10**9  # a page number past this is read as this: past any list's end (shown as its last page)
WINDOWS_MIN = {"1h": 60, "6h": 360, "24h": 1440, "7d": 10080}


# -- helpers -----------------------------------------------------------------------------------------------------
class Paged:
    """One page of a list: its rows, and where the others are."""

    def __init__(self, rows: list[Any], page: int, total: int | None, size: int = PAGE_SIZE,
                 has_next: bool | None = None) -> None:
        self.rows, self.page, self.total, self.size = rows, page, total, size
        self.pages = None if total is None else max(1, math.ceil(total / size))
        self.has_prev = page > 1
        self.has_next = has_next if has_next is not None else (self.pages is not None and page < self.pages)


def page_number(text: str | None) -> int:
    """A ``?page=`` as a person writes it, parsed once: ASCII digits, however many (a number past ``PAST_THE_END``
    is that: a page past the end, which ``within`` makes the last); the first page for anything else (none, empty,
    0, negative, not a whole number)."""
    text = (text or "").strip()
    if not (text.isascii() and text.isdigit()):
        return 1
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(PAST_THE_END)):  # not even read: past any list's end
        return PAST_THE_END
    return min(PAST_THE_END, max(1, int(digits)))


def within(page: int, total: int, size: int = PAGE_SIZE) -> int:
    """``page`` bounded by the list's pages: at least the first, at most the last (an empty list has one page)."""
    return min(max(1, page), max(1, math.ceil(total / size)))


def page_of(items: list[Any], page: int, size: int = PAGE_SIZE) -> Paged:
    page = within(page, len(items), size)
    return Paged(items[(page - 1) * size: page * size], page, len(items), size)


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    if s < 1:
        return "now"
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{1000 * value:.0f} ms" if value < 1 else f"{value:.1f} s"


def gib(n: float | None) -> str:
    return "-" if not n else f"{n / GIB:.1f} GiB"


# -- fleet -------------------------------------------------------------------------------------------------------
def memory_bar(n: NodeStatus) -> MemoryBar:
    """Memory as one bar: planned by the node's models (their budget), used on the host, the host's total; as
    shares of the total for the SVG, and the words for people (a missing figure is '-', never a crash)."""
    total, available = n.ram_total_bytes, n.ram_available_bytes
    used = max(0, total - available) if total else None
    planned = sum(m.planned_bytes or 0 for m in n.model_set) or n.planned_bytes

    def share(x: float | None) -> float:
        return 0.0 if not total or x is None else min(1.0, x / total)

    return MemoryBar(total=total, used=used, planned=planned, used_pct=round(100 * share(used), 1),
                     planned_pct=round(100 * share(planned), 1),
                     text=f"planned {gib(planned)} · used {gib(used)} of {gib(total)}")


def prefix_words(p: PrefixStatus | None) -> str | None:
    """A model's warm prefixes for people: held on disk, restored, the prefill seconds saved (what is known)."""
    if p is None:
        return None
    held = [] if p.prefixes is None else [f"{p.prefixes} warm prefix{'es' if p.prefixes != 1 else ''} "
                                          f"({format_bytes(p.state_bytes or 0)})"]
    saved = [] if p.saved_s is None else [f"{p.saved_s:.1f} s of prefill saved"]
    return " · ".join([*held, f"{p.restored} restored", *saved])


def node_models(n: NodeStatus) -> list[ModelRow]:
    if n.model_set:
        return [ModelRow(name=m.model or "?", state="loaded" if m.loaded else "unloaded", pinned=bool(m.pinned),
                         slots=m.slots, in_use=m.in_use or 0, prefixes=prefix_words(n.prefixes.get(m.model or "")))
                for m in n.model_set]
    name = n.model or (n.models or [None])[0]
    return [ModelRow(name=name, state="loaded", pinned=True, slots=n.slots, in_use=n.in_flight or 0,
                     prefixes=prefix_words(n.prefixes.get(name)))] if name else []


def health_words(h: NodeHealth) -> list[str]:
    """The device's health as short words (what is known only)."""
    out = []
    if h.temperature_c is not None:
        out.append(f"{h.temperature_c:.0f} °C")
    if h.thermal:
        out.append(f"thermal {h.thermal}")
    if h.throttled:
        out.append("throttled")
    if h.freq_ratio is not None and h.freq_ratio < 0.95:
        out.append(f"clock {100 * h.freq_ratio:.0f} %")
    if h.undervolted:
        out.append("under-volted")
    if h.on_battery:
        out.append("on battery" + (f" {h.battery_pct:.0f} %" if h.battery_pct is not None else ""))
    if h.memory_pressure and h.memory_pressure != "normal":
        out.append(f"memory pressure {h.memory_pressure}")
    return out


def node_row(n: NodeStatus) -> NodeRow:
    """A node as the fleet page lays it out. A field its record lacks shows '-'; a part of it that did not parse
    leaves the row unreadable, with why."""
    h = n.health
    offset = n.clock_offset_s
    return NodeRow(id=n.id, host=n.hostname or "-",
                   machine=" ".join(x for x in (n.chip or n.arch, n.os) if x) or "-",
                   status=n.status, state=n.state or "-", age=ago(n.heartbeat_age_s),
                   models=node_models(n), memory=memory_bar(n), guard=h.state or n.guard or "-",
                   guard_reason=(f"its record could not be read: {n.unreadable}" if n.unreadable else h.reason or ""),
                   health=health_words(h), clock="-" if offset is None else f"{round(offset, 1) + 0.0:+.1f} s",
                   clock_off=offset is not None and abs(offset) > 5, done=n.completed, failed=n.failed,
                   in_flight=n.in_flight, backend=n.backend or "-",
                   version=f"v{n.agent_version or '?'} · contract {n.contract or '1.0'}", deferred=n.deferred,
                   operator=h.pause == "operator")


def fleet_rows(snap: Snapshot) -> tuple[list[NodeRow], list[NodeRow]]:
    """(live nodes, lost ones): each a row the fleet page lays out, made once per snapshot."""
    def make() -> tuple[list[NodeRow], list[NodeRow]]:
        live, lost = [], []
        for n in snap.fleet.nodes:
            row = node_row(n)
            (lost if row.status == "lost" else live).append(row)
        return live, lost

    return snap.derived("fleet_rows", make)


def fleet_page(snap: Snapshot, page: int, lost_page: int) -> dict[str, Any]:
    live, lost = fleet_rows(snap)
    counts = {s: sum(1 for r in live if r.status == s) for s in ("ok", "stale")}
    queues = snap.fleet.queues
    return {"nodes": page_of(live, page), "lost": page_of(lost, lost_page), "counts": {**counts, "lost": len(lost)},
            "gateways": snap.fleet.gateways, "alerts": snap.fleet.alerts, "skew": len(snap.fleet.versions) > 1,
            "ready": sum(q.ready for q in queues), "leased": sum(q.leased for q in queues),
            "dead": sum(q.dead for q in queues)}


# -- queues ------------------------------------------------------------------------------------------------------
def queues_page(snap: Snapshot, history: History, nodes: History, node_page: int) -> dict[str, Any]:
    """``history``: the window's fleet-wide fields; ``nodes``: its per-node counters."""
    now = snap.at
    queues = []
    outcomes = history.outcomes()
    for q in snap.fleet.queues:
        ok, failures = outcomes.get(q.queue, (0, 0))
        queues.append(QueueRow(**q.model_dump(), oldest=ago(now - q.oldest_ready_at) if q.oldest_ready_at else "-",
                               ok=ok, failures=failures, wait_p50=seconds(history.wait_s(q.queue, 0.5)),
                               wait_p95=seconds(history.wait_s(q.queue, 0.95)),
                               run_p50=seconds(history.run_s(q.queue, 0.5)),
                               run_p95=seconds(history.run_s(q.queue, 0.95))))
    names = sorted({q.queue for q in queues} | set(history.queues()))
    xs = [60 * m for m in history.minutes]
    live = {q.queue: q for q in queues}

    def depth(name: str) -> list[float | None]:
        series = history.depth(name)
        if name in live and series:  # the last point is now, from the snapshot itself
            series[-1] = float(live[name].ready + live[name].leased + live[name].delayed)
        return series

    charts = {
        "depth": {"title": "Unfinished tasks (ready + leased + delayed)", "x": xs,
                  "series": [{"label": n, "values": depth(n)} for n in names]},
        "throughput": {"title": "Finished per minute", "x": xs,
                       "series": [{"label": n, "values": history.finished(n)} for n in names]},
        "failures": {"title": "Failed attempts per minute", "x": xs,
                     "series": [{"label": n, "values": history.failed(n)} for n in names]},
    }
    by_node = sorted((NodeCount(node=k, ok=ok, failed=failed) for k, (ok, failed) in nodes.by_node().items()),
                     key=lambda r: (-r.ok - r.failed, r.node))
    return {"queues": queues, "charts": charts,
            "by_node": page_of(by_node, node_page), "codes": history.failures_by_code()}


# -- placement ---------------------------------------------------------------------------------------------------
def placement_rows(snap: Snapshot) -> tuple[list[str], list[PlacementRow]]:
    """The models, and a row per live node: each model assigned, held, loaded (once per snapshot)."""
    def make() -> tuple[list[str], list[PlacementRow]]:
        assigned = {a.node: a for a in snap.fleet.assignments}
        nodes = [n for n in snap.fleet.nodes if not n.lost]
        models = sorted({m for a in assigned.values() for m in a.models}
                        | {m.model for n in nodes for m in n.model_set if m.model}
                        | {n.model for n in nodes if n.model})
        rows = []
        for n in nodes:
            a = assigned.get(n.id)
            mine = {m.model: m for m in n.model_set}
            cells = []
            for m in models:
                want = a is not None and m in a.models
                has = m in n.models or m in mine or m == n.model
                loaded = bool(m in mine and mine[m].loaded) or (m == n.model and not mine)
                refused = a.refused.get(m) if a else None
                cells.append(PlacementCell(model=m, assigned=want, held=has, loaded=loaded, refused=refused,
                                           kind=("ok" if want and has else "missing" if want else "extra" if has
                                                 else "none")))
            rows.append(PlacementRow(node=n.id, follow=n.follow, cells=cells,
                                     generation=a.generation if a else None,
                                     followed=a.followed_generation if a else None))
        return models, rows

    return snap.derived("placement", make)


def placement_page(snap: Snapshot, page: int) -> dict[str, Any]:
    """Nodes x models: what the scheduler assigned each node against what it holds."""
    models, rows = placement_rows(snap)
    return {"models": models, "rows": page_of(rows, page), "leader": snap.fleet.scheduler,
            "events": [e for e in snap.events if e.get("kind") in ("assigned", "unplaced", "control")]}


# -- batches -----------------------------------------------------------------------------------------------------
def batch_row(record: dict[str, Any], now: float) -> BatchRow:
    b = BatchStatus.model_validate(record)
    c = b.request_counts
    total, done, failed = c.get("total", 0), c.get("completed", 0), c.get("failed", 0)
    finished = done + failed
    started = b.in_progress_at or b.created_at
    eta = None
    if b.status == "in_progress" and 0 < finished < total and started:
        eta = (now - started) / finished * (total - finished)
    return BatchRow(id=b.id, status=b.status, endpoint=b.endpoint, total=total, completed=done, failed=failed,
                    pct=round(100 * finished / total, 1) if total else 0.0,
                    ok_pct=round(100 * done / total, 1) if total else 0.0,
                    created=ago(now - b.created_at) if b.created_at else "-", eta=ago(eta) if eta is not None else "-",
                    active=b.status in ("validating", "in_progress", "finalizing"))


# -- failures and tasks ------------------------------------------------------------------------------------------
def redact(value: Any, keys: set[str], limit: int) -> str:
    """A task's input or output for the page: the values of keys that match a pattern of ``keys`` (shell-style,
    lowercase: ``*token*`` hides access_token and x-auth-token) hidden, and the secrets a value quotes masked (a
    DSN's password, a bearer token: ``urls.masked_text``), cut at ``limit`` characters."""
    from fnmatch import fnmatchcase

    from nodeagent.urls import masked_text

    def hidden(key: str) -> bool:
        return any(fnmatchcase(key.lower(), pattern) for pattern in keys)

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: "[redacted]" if hidden(str(k)) else clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, str):  # a secret quoted in a value: a DSN's password, a bearer token
            return masked_text(v)
        return v

    text = json.dumps(clean(value), indent=2, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + f"\n… ({len(text) - limit} more characters)"


def attempts(view: TaskView, now: float) -> list[AttemptRow]:
    out = []
    for a in view.history:
        end = a.ended_at
        outcome = ("running" if end is None and view.state == "leased" and a.attempt == view.attempts else
                   "lost (lease expired)" if end is None else a.error.code if a.error else "ok")
        out.append(AttemptRow(attempt=a.attempt, node=a.node or "-", started=ago(now - a.started_at) + " ago",
                              took=seconds(None if end is None else end - a.started_at), outcome=outcome,
                              message=a.error.message if a.error else ""))
    return out


def task_page(broker: Broker, task_id: str, now: float, keys: set[str], limit: int) -> dict[str, Any] | None:
    view = broker.get(task_id)
    if view is None:
        return None
    result = view.result
    output = result.model_dump(mode="json").get("output") if result is not None else None
    return {"task": view, "attempts": attempts(view, now),
            "created": ago(now - view.created_at) + " ago" if view.created_at else "-",
            "input": redact(view.input, keys, limit) if limit and view.input is not None else None,
            "output": redact(output, keys, limit) if limit and output is not None else None,
            "error": view.last_error or (result.error if result else None),
            "cancellable": view.state in ("ready", "leased", "delayed"), "replayable": view.state == "dead"}


def failures_page(snap: Snapshot, broker: Broker, code: str | None, page: int) -> dict[str, Any]:
    """The dead letters (of ``code``), a page read from the broker: ``page`` bounded by the snapshot's count first, so
    the offset asked of the broker is within the list (a page past the end is the last)."""
    groups = snap.dead
    total = sum(g["count"] for g in groups if code is None or g["code"] == code)
    page = within(page, total)
    rows = broker.dead(code=code, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE)
    return {"groups": groups, "code": code, "total": total, "dead": Paged(
        [DeadRow(id=v.id, queue=v.queue, attempts=v.attempts, code=v.last_error.code if v.last_error else "-",
                 message=(v.last_error.message if v.last_error else "")[:200], node=v.node or "-",
                 nodes=" → ".join(a.node or "?" for a in v.history)) for v in rows], page, total)}
