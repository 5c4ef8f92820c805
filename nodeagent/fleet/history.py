"""The fleet's history: per-minute rollups kept in the broker, so what the operator's page and `status` show
survives a restart of anything and stays bounded (``NODEAGENT_HISTORY_DAYS``).

A minute is a flat map of numbers (the broker's ``history_add``, which adds, and ``history_set``, which sets; on
the broker's clock), with fields named ``kind|queue-or-node|what``:

- ``t|<queue>|ok``, ``t|<queue>|retry``, ``t|<queue>|dead``: attempts that ended so, by queue (counters);
  ``t|<queue>|deferred``: tasks given back unread for a newer node (not attempts);
- ``c|<queue>|<code>``: failed attempts by error code (counters);
- ``w|<queue>|<i>``, ``r|<queue>|<i>``: the queue wait and the run time of the finished attempts, counted in the
  buckets ``BUCKETS_S`` (counters: they add up across nodes, and a quantile is read from the sum, as Prometheus
  reads a histogram);
- ``n|<node>|ok``, ``n|<node>|failed``: attempts by the node that ran them (counters);
- ``d|<queue>|ready``, ``leased``, ``delayed``, ``dead``, ``oldest_s``: the queue's depth and the age of its oldest
  ready task, sampled (gauges: the last sample of the minute wins).

A worker counts what it ran in a ``Rollup`` and adds it at its heartbeats (a failed write is kept for the next);
depths are sampled by the workers' heartbeats and by the page's snapshot, at most every ``DEPTH_EVERY_S``.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from typing import Any, Iterable

from nodeagent.broker.base import Broker, QueueStats
from nodeagent.tasks.contracts import Result

BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)
DEPTH_EVERY_S = 10.0
DEPTH_FIELDS = ("ready", "leased", "delayed", "dead")
UNFINISHED = DEPTH_FIELDS[:3]  # what a queue's depth counts: the tasks not yet done or dead
FLEET_KINDS = ("t", "c", "w", "r", "d")  # every kind but the per-node counters ("n")
NODE_KINDS = ("n",)


def minute_of(t: float) -> int:
    return int(t // 60)


def bucket_of(seconds: float) -> int:
    """The index of the first bucket bound at or above ``seconds`` (len(BUCKETS_S): above the last)."""
    return bisect.bisect_left(BUCKETS_S, max(0.0, seconds))


class Rollup:
    """What this process ran since it last handed its counts over: attempts by outcome, error code and node, and
    their queue wait and run time in buckets. Thread-safe (a worker's slots finish tasks at once)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._counts: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def attempt(self, queue: str, result: Result, outcome: str) -> None:
        """One attempt ended: ``outcome`` ok, retry (it goes back to the queue) or dead (a dead letter)."""
        with self._lock:
            c = self._counts
            c[f"t|{queue}|{outcome}"] += 1
            c[f"n|{self.node_id}|{'ok' if outcome == 'ok' else 'failed'}"] += 1
            if result.error is not None:
                c[f"c|{queue}|{result.error.code}"] += 1
            c[f"w|{queue}|{bucket_of(result.timings.queue_wait_s)}"] += 1
            c[f"r|{queue}|{bucket_of(result.timings.total_s)}"] += 1

    def deferred(self, queue: str) -> None:
        """A task given back unread for a newer node (no attempt: it ran nowhere)."""
        with self._lock:
            self._counts[f"t|{queue}|deferred"] += 1

    def take(self) -> dict[str, float]:
        with self._lock:
            counts, self._counts = dict(self._counts), defaultdict(float)
        return counts

    def give_back(self, counts: dict[str, float]) -> None:
        """Counts a failed write did not store: added again to the next."""
        with self._lock:
            for k, v in counts.items():
                self._counts[k] += v

    def flush(self, broker: Broker, now: float, keep_s: float) -> None:
        """Add what was counted to the minute ``now`` (the broker's time) falls in; on failure keep it."""
        counts = self.take()
        if not counts:
            return
        try:
            broker.history_add(minute_of(now), counts, keep_s)
        except Exception:
            self.give_back(counts)
            raise


def depth_values(stats: Iterable[QueueStats], now: float) -> dict[str, float]:
    """The gauges of a depth sample: each queue's tasks by state and the age of its oldest ready task."""
    out: dict[str, float] = {}
    for s in stats:
        for f in DEPTH_FIELDS:
            out[f"d|{s.queue}|{f}"] = float(getattr(s, f))
        out[f"d|{s.queue}|oldest_s"] = max(0.0, now - s.oldest_ready_at) if s.oldest_ready_at else 0.0
    return out


class DepthSampler:
    """Depth samples into the history at most every ``DEPTH_EVERY_S`` by this process (many writers may sample;
    the last sample of a minute wins)."""

    def __init__(self, every_s: float = DEPTH_EVERY_S) -> None:
        self.every_s = every_s
        self._at = float("-inf")

    def due(self, now: float) -> bool:
        return now - self._at >= self.every_s

    def sample(self, broker: Broker, now: float, keep_s: float, stats: list[QueueStats] | None = None) -> None:
        if not self.due(now):
            return
        self._at = now
        broker.history_set(minute_of(now), depth_values(broker.stats() if stats is None else stats, now), keep_s)


# -- reading ---------------------------------------------------------------------------------------------------
class History:
    """The minutes ``[first, last]`` of the history, read once, and what the pages and `status` show of them."""

    def __init__(self, rows: dict[int, dict[str, float]], first: int, last: int) -> None:
        self.rows, self.first, self.last = rows, first, last

    @classmethod
    def read(cls, broker: Broker, now: float, minutes: int, kinds: tuple[str, ...] | None = FLEET_KINDS
             ) -> "History":
        """The last ``minutes`` up to ``now``; by default the fleet's fields, not the per-node counters (a
        thousand nodes' are most of a minute's fields: the page reads them apart, for its table by node)."""
        last = minute_of(now)
        first = last - minutes + 1
        return cls(broker.history(first, kinds), first, last)

    @property
    def minutes(self) -> list[int]:
        return list(range(self.first, self.last + 1))

    def keys(self, kind: str) -> list[str]:
        """The queues (or nodes) a kind of field names, in order."""
        return sorted({f.split("|", 2)[1] for row in self.rows.values() for f in row if f.startswith(kind + "|")})

    def counter(self, field: str) -> list[float]:
        """A counter per minute (0 where nothing was counted)."""
        return [self.rows.get(m, {}).get(field, 0.0) for m in self.minutes]

    def gauge(self, field: str) -> list[float | None]:
        """A gauge per minute (None where it was not sampled)."""
        return [self.rows.get(m, {}).get(field) for m in self.minutes]

    def depth(self, queue: str) -> list[float | None]:
        """Unfinished tasks (ready + leased + delayed) per minute (None where it was not sampled)."""
        parts = [self.gauge(f"d|{queue}|{f}") for f in UNFINISHED]
        return [None if all(p is None for p in ps) else sum(p or 0.0 for p in ps) for ps in zip(*parts)]

    def totals(self, kind: str) -> dict[str, dict[str, float]]:
        """Counters summed over the window, by queue (or node) and what: {"classify.v1": {"ok": 12, ...}}."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for row in self.rows.values():
            for f, v in row.items():
                if f.startswith(kind + "|"):
                    _, key, what = f.split("|", 2)
                    out[key][what] += v
        return {k: dict(v) for k, v in out.items()}

    def quantile(self, kind: str, queue: str, q: float) -> float | None:
        """The ``q`` quantile of the queue wait (kind "w") or run time ("r") over the window, from the summed
        buckets, interpolated inside its bucket (None with no sample; the last bound for one above it)."""
        counts = [0.0] * (len(BUCKETS_S) + 1)
        for row in self.rows.values():
            for i in range(len(counts)):
                counts[i] += row.get(f"{kind}|{queue}|{i}", 0.0)
        n = sum(counts)
        if n == 0:
            return None
        rank, seen = q * n, 0.0
        for i, c in enumerate(counts):
            if seen + c >= rank and c > 0:
                if i == len(BUCKETS_S):
                    return BUCKETS_S[-1]
                low = BUCKETS_S[i - 1] if i else 0.0
                return low + (BUCKETS_S[i] - low) * (rank - seen) / c
            seen += c
        return BUCKETS_S[-1]

    # -- named series: what the page and `status` read, the field scheme kept in here --------------------------
    def queues(self) -> list[str]:
        """Every queue the window counted an attempt of or sampled the depth of."""
        return sorted(set(self.keys("t")) | set(self.keys("d")))

    def finished(self, queue: str) -> list[float]:
        """Attempts of ``queue`` that ended ok, per minute."""
        return self.counter(f"t|{queue}|ok")

    def failed(self, queue: str) -> list[float]:
        """Attempts of ``queue`` that failed (to be retried or dead), per minute."""
        return [a + b for a, b in zip(self.counter(f"t|{queue}|retry"), self.counter(f"t|{queue}|dead"))]

    def outcomes(self) -> dict[str, tuple[int, int]]:
        """(attempts ok, attempts failed) over the window, by queue."""
        return {q: (int(t.get("ok", 0)), int(t.get("retry", 0) + t.get("dead", 0)))
                for q, t in self.totals("t").items()}

    def wait_s(self, queue: str, q: float) -> float | None:
        """The ``q`` quantile of the time ``queue``'s finished attempts waited to be claimed."""
        return self.quantile("w", queue, q)

    def run_s(self, queue: str, q: float) -> float | None:
        """The ``q`` quantile of the run time of ``queue``'s finished attempts."""
        return self.quantile("r", queue, q)

    def by_node(self) -> dict[str, tuple[int, int]]:
        """(attempts ok, attempts failed) over the window, by the node that ran them (the per-node kind)."""
        return {n: (int(t.get("ok", 0)), int(t.get("failed", 0))) for n, t in self.totals("n").items()}

    def failures_by_code(self) -> list[tuple[str, str, int]]:
        """(queue, error code, failed attempts) over the window, the most first."""
        return sorted(((q, c, int(n)) for q, cs in self.totals("c").items() for c, n in cs.items()),
                      key=lambda x: -x[2])

    def depth_points(self) -> list[tuple[float, dict[str, int]]]:
        """(time, {queue: unfinished}) per sampled minute, for the trend `status` shows."""
        series = {q: self.depth(q) for q in self.keys("d")}
        out = []
        for i, m in enumerate(self.minutes):
            depths = {q: int(d[i]) for q, d in series.items() if d[i] is not None}
            if depths:
                out.append((m * 60.0, depths))
        return out

    def as_json(self) -> dict[str, Any]:
        return {"first_minute": self.first, "last_minute": self.last,
                "rows": {str(m): row for m, row in sorted(self.rows.items())}}
