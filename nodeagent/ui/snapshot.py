"""One snapshot of the fleet per interval, shared by every open page and every live stream.

A snapshot is read from the broker in one place (``read_snapshot``): `status`'s view of the fleet
(``fleet/status.py``), the last hour of the history (``fleet/history.py``), the dead letters by error code and the
fleet's latest events. It is read again at most every ``refresh_s``, by whichever request or stream finds it old;
everyone else gets the same object. A broker that does not answer leaves the last snapshot standing, marked with
the error (the page says so instead of breaking).

Live streams: each open page holds one server-sent-event stream; a tick is pushed to all of them when a new
snapshot is read, and the page fetches itself again. At most ``max_streams`` streams are open at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable

from pydantic import PrivateAttr

from nodeagent.broker.base import Broker, NodeRecord
from nodeagent.fleet.history import DepthSampler, History
from nodeagent.fleet.status import FleetStatus, NodeStatus, fleet_status
from nodeagent.urls import shown
from nodeagent.values import Frozen

log = logging.getLogger(__name__)
WINDOW_MIN = 60  # the history every snapshot holds; a page asking for a longer window reads it apart


class Snapshot(Frozen):
    at: float  # the broker's time it was read at
    source: str  # the broker's URL, or "this node" (serve without a queue)
    fleet: FleetStatus
    history: dict[str, Any]  # History.as_json()
    dead: list[dict[str, Any]] = []  # the dead letters by code: {"code", "count", "sample"}
    events: list[dict[str, Any]] = []
    error: str | None = None  # why this snapshot is an older one
    read_ms: float = 0.0
    generation: int = 0
    _derived: dict[str, Any] = PrivateAttr(default_factory=dict)

    def derived(self, name: str, make: Callable[[], Any]) -> Any:
        """What the pages derive from this snapshot's fleet (its rows), made once for every request that
        shares it. A copy (the same fleet, marked stale or renumbered) shares them too."""
        if name not in self._derived:
            self._derived[name] = make()
        return self._derived[name]

    def history_view(self) -> History:
        h = self.history
        return History({int(m): row for m, row in h["rows"].items()}, h["first_minute"], h["last_minute"])


def read_snapshot(broker: Broker, lost_after_s: float, keep_s: float, sampler: DepthSampler | None = None,
                  clock_warn_s: float | None = None) -> Snapshot:
    """The fleet as the broker holds it now (one broker read of each kind)."""
    started = time.perf_counter()
    now = broker.now()
    history = History.read(broker, now, WINDOW_MIN)
    fleet = fleet_status(broker, lost_after_s, clock_warn_s, now=now, history=history)
    if sampler is not None:  # the server's sweep samples the depths it just read (bounded: DEPTH_EVERY_S)
        try:
            sampler.sample(broker, now, keep_s, list(fleet.queues))
        except Exception as exc:  # noqa: BLE001  (a read-only broker user still shows the page)
            log.debug("depth sample not written: %s", exc)
    return Snapshot(at=now, source=shown(broker.url), fleet=fleet, history=history.as_json(),
                    dead=[g.model_dump(mode="json") for g in broker.dead_codes()],
                    events=broker.events(limit=50), read_ms=1000 * (time.perf_counter() - started))


def local_snapshot(record: Callable[[], NodeRecord], lost_after_s: float) -> Snapshot:
    """A node served without a queue: itself, and nothing of a fleet."""
    now = time.time()
    return Snapshot(at=now, source="this node", fleet=FleetStatus(nodes=[NodeStatus.of(record(), now, lost_after_s)]),
                    history=History({}, 0, 0).as_json())


class Snapshots:
    """The shared snapshot, read again when older than ``refresh_s``, and the live streams told of each."""

    def __init__(self, read: Callable[[], Snapshot], refresh_s: float, max_streams: int) -> None:
        self.read, self.refresh_s, self.max_streams = read, refresh_s, max_streams
        self.streams = 0
        self._current: Snapshot | None = None
        self._read_at = float("-inf")
        self._generation = 0
        self._lock = threading.Lock()  # one read at a time; the others wait for it and share it
        self._ticks: set[asyncio.Queue[int]] = set()
        self._ticker: asyncio.Task[None] | None = None

    def get(self) -> Snapshot:
        """The current snapshot; read again first when it is older than ``refresh_s``."""
        if self._current is not None and time.monotonic() - self._read_at < self.refresh_s:
            return self._current
        with self._lock:
            if self._current is not None and time.monotonic() - self._read_at < self.refresh_s:
                return self._current  # another request read it while this one waited
            try:
                snap = self.read()
            except Exception as exc:  # noqa: BLE001  (the last snapshot stands, marked)
                why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                log.warning("the fleet could not be read: %s", why)
                if self._current is None:
                    raise
                snap = self._current.model_copy(update={"error": why})
            self._generation += 1
            self._current = snap.model_copy(update={"generation": self._generation})
            self._read_at = time.monotonic()
            return self._current

    async def current(self) -> Snapshot:
        if self._current is not None and time.monotonic() - self._read_at < self.refresh_s:
            return self._current
        return await asyncio.to_thread(self.get)

    # -- live streams --------------------------------------------------------------------------------------
    def open_stream(self) -> "asyncio.Queue[int] | None":
        """A stream's queue of ticks, or None when ``max_streams`` are open."""
        if len(self._ticks) >= self.max_streams:
            return None
        q: asyncio.Queue[int] = asyncio.Queue(maxsize=1)
        self._ticks.add(q)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        return q

    def close_stream(self, q: "asyncio.Queue[int]") -> None:
        self._ticks.discard(q)

    async def _tick(self) -> None:
        """While a stream is open: a snapshot every ``refresh_s``, and a tick to every stream when it is new."""
        seen = -1
        while self._ticks:
            try:
                snap = await asyncio.to_thread(self.get)
            except Exception:  # noqa: BLE001  (no snapshot yet: try again)
                snap = None
            if snap is not None and snap.generation != seen:
                seen = snap.generation
                for q in list(self._ticks):
                    if q.full():
                        q.get_nowait()  # a slow page gets the newest tick only
                    q.put_nowait(seen)
            await asyncio.sleep(self.refresh_s)

    async def ticks(self, q: "asyncio.Queue[int]", keepalive_s: float = 15.0) -> AsyncIterator[int | None]:
        """The stream's ticks (None: a keep-alive)."""
        while True:
            try:
                yield await asyncio.wait_for(q.get(), keepalive_s)
            except asyncio.TimeoutError:
                yield None
