"""The broker protocol: a durable queue of typed tasks with leases, retries, dead letters and results.

Two engines implement it: SQLite in WAL mode (one machine, the default: ``broker/sqlite/``) and Redis Streams (a
fleet: ``broker/redis/``), each a package with one file per store (``TaskQueue``, ``TaskLogs``, ...). Both pass one
shared test suite. The semantics are the fleet's (``docs/fleet.md``):

- one queue per task type and contract version (``classify.v1``); a task may name the model it must run on;
- ``claim`` leases a task to a node until ``now + lease`` and counts the attempt; a lease that expires makes
  the task claimable again (a dead worker's tasks come back on their own);
- ``complete`` writes the result once (a second write is a no-op), then acknowledges;
- ``retry`` puts a task back with a delay the broker holds; ``bury`` moves it to the dead-letter queue with
  its attempt history, and stores its last error as the task's (error) Result;
- an idempotency key enqueued twice returns the first task's id and creates nothing;
- every instant the broker stores or compares (a lease, a retry's due time, a heartbeat, a deadline) is on the
  broker's own clock (``now()``; ``nodeagent/clock.py``), never on the clock of the node that writes or reads it.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import Field

from nodeagent import payload
from nodeagent.config import default_of
from nodeagent.errors import validation_message
from nodeagent.payload import PayloadError
from nodeagent.tasks.contracts import BATCH_SUFFIX, ROUTE_MARK, ErrorInfo, Result, field_minors, needs, queue_type, wire
from nodeagent.values import Frozen

if TYPE_CHECKING:
    from nodeagent.model_kinds import ModelKind

TaskState = Literal["ready", "leased", "delayed", "done", "dead", "cancelled"]
NodeState = Literal["starting", "ready", "degraded", "draining", "unhealthy", "stopped"]
EVENTS_KEPT = 1000  # the fleet's event log keeps about this many
PURGE_EVERY_S = 60.0  # each worker and gateway drops what expiry leaves past the retention this often (``Purge``)
# an envelope larger than this is dead-lettered unread (a task's fields are bounded by NODEAGENT_MAX_INPUT_BYTES)
MAX_ENVELOPE_BYTES = 64 << 20


def backoff_s(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2^attempt)] (attempt 1 is the first retry's delay)."""
    return (rng or random).uniform(0.0, min(cap_s, base_s * 2 ** attempt))


BLIP_BASE_S, BLIP_CAP_S = 0.1, 5.0


def blip_delay_s(failures: int) -> float:
    """The wait before the next try after ``failures`` consecutive failures to reach the broker: full jitter from
    0.1 s doubling to 5 s. The worker waits out an outage with it, and the Redis link retries an operation with it."""
    return backoff_s(min(failures, 16), BLIP_BASE_S / 2, BLIP_CAP_S)


class Purge:
    """The one purge: what expiry leaves past the retention dropped (``Broker.purge``, through indexes by time), at
    most once a PURGE_EVERY_S however often it is called (its first call purges). The gateway runs it on
    ``runtime.every``; a worker, which has no app, calls it from its heartbeat loop. ``result_retention_s``: the
    setting of that name. A failure is raised to the caller, and the next try is a PURGE_EVERY_S later all the
    same."""

    def __init__(self, broker: Broker, result_retention_s: float, clock: Any = time.monotonic) -> None:
        self.broker, self.result_retention_s, self.clock = broker, result_retention_s, clock
        self._next: float | None = None

    def __call__(self) -> int | None:
        """The tasks dropped; None when the last purge was less than PURGE_EVERY_S ago."""
        now = self.clock()
        if self._next is not None and now < self._next:
            return None
        self._next = now + PURGE_EVERY_S
        return self.broker.purge(self.result_retention_s)


# The fleet's contract: the version of what nodes, gateways and clients write to the broker and read from it
# (envelopes, node records, events; schemas/redis-contract.md), MAJOR.MINOR. A reader reads every MINOR of its own
# MAJOR and ignores the optional fields it does not know; a task of a newer MAJOR, or of a newer MINOR that it cannot
# read, it gives back for another node without spending an attempt. The key layout has its own version, in the
# keys' prefix (nodeagent:v1:). Records of nodes that predate contract versions (nodeagent 0.1) carry none: 1.0.
CONTRACT = "1.8"  # 1.8: rerank.v1 (a queue of its own: no older node claims it)
UNVERSIONED = "1.0"
ROUTED_SINCE = "1.5"  # nodes of this minor and later read the routes of the fields they know (``routes``)
CONTRACT_PATTERN = r"^[0-9]{1,4}\.[0-9]{1,4}$"
DEFER_S = (1.0, 3.0)  # a task given back for a newer node is ready again after a delay drawn from this range


def contract_parts(version: str | None) -> tuple[int, int]:
    """(MAJOR, MINOR) of a contract version (none given: this code's own)."""
    major, _, minor = (version or CONTRACT).partition(".")
    return int(major), int(minor or 0)


def newer_contract(version: str | None) -> bool:
    """Whether a writer of ``version`` is newer than this code (a later MAJOR, or a later MINOR of the same)."""
    return contract_parts(version) > contract_parts(CONTRACT)


def readable_contract(version: str | None) -> bool:
    """Whether this code reads what a writer of ``version`` wrote: its own MAJOR."""
    return contract_parts(version)[0] == contract_parts(CONTRACT)[0]


def base_queue(route: str) -> str:
    """The queue a route belongs to: ``extract.v1`` for ``extract.v1~1.2`` (and for itself)."""
    return route.split(ROUTE_MARK, 1)[0]


def routes(queues: list[str]) -> list[str]:
    """Every route a node of this contract reads for ``queues``: each queue, and its routes for the fields a later
    minor (up to this node's own) added to its type."""
    out: list[str] = []
    for q in queues:
        out.append(q)
        out += [f"{q}{ROUTE_MARK}{m}" for m in field_minors(q) if contract_parts(m) <= contract_parts(CONTRACT)]
    return out


class Attempt(Frozen):
    attempt: int
    node: str | None = None
    started_at: float
    ended_at: float | None = None
    error: ErrorInfo | None = None


class Envelope(Frozen):
    """A task as the queue holds it: the task's JSON (checked by the worker, not trusted) and routing."""

    id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=200)
    queue: str = Field(description="Task type and contract version, e.g. classify.v1")
    task: dict[str, Any] = Field(description="The task contract (schemas/task.schema.json)")
    model: str | None = Field(None, description="Run only on nodes serving this model (catalog name or sha256)")
    idempotency_key: str | None = None
    deadline: float | None = Field(None, description="Unix time after which the task is not started (compared on the "
                                                     "broker's clock)")
    batch: str | None = Field(None, description="Fan-out group")
    index: int | None = Field(None, description="Position in the fan-out, for ordered fan-in")
    max_attempts: int = Field(default_of("max_attempts"), ge=1, le=100)  # the setting's one default
    progress: bool = Field(False, description="Its worker reports progress (started, prepared, the answer's pieces) "
                                              "in the task's event log, which a gateway opened and reads")
    notify: str | None = Field(None, max_length=200, description="The event log told how the task ends, instead of "
                                                                  "its own: a gateway's, shared by its requests")
    created_at: float = Field(default_factory=time.time, description="When it was made (the client sets the "
                                                                      "broker's time)")
    contract: str = Field(CONTRACT, pattern=CONTRACT_PATTERN,
                          description="The contract version of its writer (MAJOR.MINOR; absent: 1.0, a writer from "
                                      "before versions), for whom its result and events are written")
    needs: str | None = Field(None, pattern=CONTRACT_PATTERN,
                              description="The contract a node must read to run it, when later than its type's own "
                                          "(it sets a field a later minor added): it is queued on the route "
                                          "<queue>~<needs>, which only such nodes read")

    @classmethod
    def of(cls, task: Any, queue: str | None = None, task_json: dict[str, Any] | None = None,
           **fields: Any) -> "Envelope":
        """A task's envelope, as every producer makes it (the client, the gateway, a batch): its wire form, and the
        contract it needs routed by. ``task_json``: the wire form given (a batch line's)."""
        queue = queue or task.type
        data = task_json if task_json is not None else wire(task)
        return cls(queue=queue, task=data, needs=needs(queue, data), **fields)

    @property
    def route(self) -> str:
        """Where it is queued: its queue, or the route of the contract it needs."""
        return f"{self.queue}{ROUTE_MARK}{self.needs}" if self.needs else self.queue


class Claim(Frozen):
    envelope: Envelope
    token: str = Field(description="This lease: renewals and acknowledgements must present it")
    attempt: int
    leased_until: float
    node: str


class TaskView(Frozen):
    id: str
    queue: str
    state: TaskState
    attempts: int
    max_attempts: int
    model: str | None = None
    batch: str | None = None
    index: int | None = None
    ready_at: float | None = None
    leased_until: float | None = None
    node: str | None = None
    history: list[Attempt] = Field(default_factory=list)
    last_error: ErrorInfo | None = None
    result: Result | None = None
    created_at: float = 0.0
    input: dict[str, Any] | None = Field(None, description="The task as it was enqueued (the envelope's task)")


class QueueStats(Frozen):
    queue: str
    ready: int = 0
    leased: int = 0
    delayed: int = 0
    dead: int = 0
    done: int = 0
    oldest_ready_at: float | None = Field(None, description="When the oldest ready task became ready (the broker's "
                                                            "time; None when none is ready)")


class DeadGroup(Frozen):
    """The dead letters that ended with one error code: how many, and the newest as a sample."""

    code: str
    count: int
    sample: dict[str, Any] = Field(default_factory=dict, description="id, queue, message of the newest")


class Demand(Frozen):
    """The work waiting for one model on one queue: what the scheduler places models by."""

    queue: str
    model: str | None = Field(None, description="The model the tasks are bound to; None: any node may take them")
    ready: int = 0
    leased: int = 0
    delayed: int = 0
    enqueued: int = Field(0, description="Tasks enqueued so far (SQLite: kept rows; Redis: the stream's "
                                         "entries-added, retries included): readings apart give the arrival rate")

    @property
    def waiting(self) -> int:
        return self.ready + self.delayed + self.leased


# A node not heard from within this many of its heartbeats is lost: the one liveness rule (``NodeRecord.heard``)
LOST_AFTER_BEATS = 3
SERVING_STATES = ("starting", "ready", "degraded")  # a node heard from in these states is given work
Liveness = Literal["serving", "heard", "lost", "stopped"]  # ``NodeRecord.liveness``


def lost_after(heartbeat_s: float) -> float:
    """How long a node beating every ``heartbeat_s`` may be silent before it is lost."""
    return heartbeat_s * LOST_AFTER_BEATS


class NodeRecord(Frozen):
    """What a node says about itself when it registers; heartbeats refresh the volatile fields."""

    id: str
    hostname: str
    agent_version: str
    os: str
    arch: str
    chip: str | None = None
    unified_memory: bool = False
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    gpu_budget_bytes: int | None = None
    backend: str
    backend_version: str | None = None
    model: str | None = None
    model_file: str | None = None
    quant: str | None = None
    model_sha256: str | None = None
    models: list[str] = Field(default_factory=list, description="Names this node answers to for routing")
    ctx_tokens: int = 0
    type_k: str | None = None
    type_v: str | None = None
    gpu_layers: int = 0
    mmap: bool = True
    planned_bytes: int = 0
    task_types: list[str] = Field(default_factory=list)
    slots: int = 1
    labels: dict[str, str] = Field(default_factory=dict)
    endpoint: str | None = None
    state: NodeState = "starting"
    guard: str = "ok"
    guard_status: dict[str, Any] = Field(default_factory=dict, description="The guard's state, reason, error rate")
    started_at: float = Field(default_factory=time.time)
    heartbeat_at: float = Field(default_factory=time.time)
    heartbeat_s: float | None = Field(None, description="Its heartbeat interval: lost after three missed")
    in_flight: int = 0
    completed: int = 0
    failed: int = 0
    hardware: dict[str, Any] = Field(default_factory=dict, description="The probe (HardwareInfo)")
    plan: dict[str, Any] = Field(default_factory=dict, description="The plan the node serves")
    model_set: list[dict[str, Any]] = Field(default_factory=list, description="Each model of its set: loaded or "
                                                                               "not, pinned, in use, planned bytes")
    follow: bool = Field(False, description="It loads what the scheduler assigns it (worker --follow)")
    allow_pull: bool = Field(default_factory=lambda: default_of("allow_pull"),
                             description="It may download an assigned model")
    on_disk: list[str] = Field(default_factory=list, description="Catalog models and GGUF files on its disk")
    throughput: dict[str, float] = Field(default_factory=dict, description="Tasks/s per model its bench measured")
    following: dict[str, Any] = Field(default_factory=dict, description="The assignment it follows: generation, "
                                                                         "followed_at, held, refused")
    clock_offset_s: float | None = Field(None, description="Its wall clock less the broker's, measured at its last "
                                                           "heartbeat")
    role: Literal["node", "gateway"] = Field("node", description="A node runs tasks; a gateway holds no model and "
                                                                 "puts HTTP requests on the queue")
    contract: str = Field(UNVERSIONED, pattern=CONTRACT_PATTERN,
                          description="The contract version it speaks (absent: a node from before versions, 1.0)")
    knows: list[str] = Field(default_factory=list, description="Every task type its version can run, whether or not "
                                                               "it serves it (absent: contract 1.0's)")
    deferred: int = Field(0, description="Tasks it gave back unread for a newer node (a newer contract's)")
    embedders: list[str] = Field(default_factory=list, description="The names of the embedding models it holds "
                                                                   "(contract 1.6; still written for 1.6 readers: "
                                                                   "``model_kinds`` says it for every kind)")
    model_kinds: dict[str, str] = Field(default_factory=dict,
                                        description="Each name it answers to, and the kind of the model under it "
                                                    "(generate, embed, rerank: model_kinds.py; contract 1.7)")
    deferred_why: str | None = Field(None, description="Why it gave back the last of them")
    warm: list[Any] = Field(default_factory=list, description="The prefix keys of the tasks it ran last, the latest "
                                                              "first (fleet/affinity.py): another node leaves such "
                                                              "a task to it for NODEAGENT_PREFER_WARM_S at most")
    left_warm: int = Field(0, description="Tasks it gave back for a node that held their prefix warm")
    prefixes: dict[str, Any] = Field(
        default_factory=dict, description="Each model's warm prefixes by its name (Node.prefix_usage: held on disk, "
                                          "restored, prefill seconds saved)")

    def heard(self, now: float, lost_after_s: float) -> bool:
        """Heard from within three of its own heartbeats at ``now`` (on the broker's clock); ``lost_after_s`` for
        a record that does not say its interval."""
        return now - self.heartbeat_at <= (lost_after(self.heartbeat_s) if self.heartbeat_s else lost_after_s)

    def liveness(self, now: float, lost_after_s: float) -> Liveness:
        """Whether the node is live at ``now`` (on the broker's clock), the one answer the fleet's read model, the
        gateway's directory and the scheduler ask: ``stopped`` (it said so), ``lost`` (not ``heard`` from within
        three of its heartbeats), ``serving`` (heard, in a state that takes work: SERVING_STATES), else ``heard``
        (heard, but draining or unhealthy: it counts in the fleet's versions and alerts, and is given no work)."""
        if self.state == "stopped":
            return "stopped"
        if not self.heard(now, lost_after_s):
            return "lost"
        return "serving" if self.state in SERVING_STATES else "heard"

    def kind_of(self, name: str) -> "ModelKind | None":
        """The kind of the model it holds under ``name`` (any of its names, in any case; None: it holds none so
        named). From ``model_kinds``; a record of contract 1.6 says it by ``embedders`` (an embedding model there, a
        generator otherwise). A kind this code does not know (a newer contract's) reads as None: no route by it."""
        from nodeagent.model_kinds import ModelKind
        from nodeagent.model_names import match

        if self.model_kinds:
            found = match(name, list(self.model_kinds))
            try:
                return None if found is None else ModelKind(self.model_kinds[found])
            except ValueError:
                return None
        if match(name, self.embedders) is not None:
            return ModelKind.EMBED
        return ModelKind.GENERATE if match(name, [*self.models, self.model or ""]) is not None else None

    def reads(self, needed: str | None) -> bool:
        """Whether it takes a task that needs contract ``needed`` (None: any node of the type does): it reads the
        routes (ROUTED_SINCE), and that minor."""
        if needed is None:
            return True
        return contract_parts(self.contract) >= max(contract_parts(needed), contract_parts(ROUTED_SINCE))

    def runs(self, queue: str) -> bool:
        """Whether its version can run tasks of ``queue`` at all (a type a newer contract added, it cannot). A record
        from before versions lists none: it runs the types its contract (1.0) had."""
        if self.knows:
            return queue in self.knows
        from nodeagent.tasks import registry

        spec = registry.BY_NAME.get(queue.removesuffix(BATCH_SUFFIX))
        return spec is not None and contract_parts(spec.since) <= contract_parts(self.contract)


# The broker's stores: one protocol per concern, each with its own retention (a ``purge_<concern>`` hook that drops
# what the store keeps past its time). Both engines implement each in a file of its own (``broker/sqlite/``,
# ``broker/redis/``: tasks.py, logs.py, nodes.py, history.py, events.py, documents.py, kv.py), over the engine's one
# connection; ``Broker`` is their composition.


class TaskQueue(Protocol):
    """The tasks: enqueued, leased, finished (a result, a retry, a dead letter), given back, cancelled, replayed,
    read, counted, and kept for the retention once finished."""

    def enqueue(self, envelope: Envelope) -> str: ...
    def claim(self, queues: list[str], node: str, lease_s: float, models: list[str] | None = None,
              wait_s: float = 0.0) -> Claim | None:
        """A task, or None. ``wait_s``: an engine that can be woken by a new task (Redis) waits up to this
        long for one; one that cannot (SQLite) returns at once and says so with ``blocks = False``."""
    def renew(self, claim: Claim, lease_s: float) -> bool: ...
    def complete(self, claim: Claim, result: Result) -> bool: ...
    def retry(self, claim: Claim, error: ErrorInfo, delay_s: float) -> None:
        """Back to the queue once ``delay_s`` has passed on the broker's clock."""
    def bury(self, claim: Claim, error: ErrorInfo) -> None: ...
    def release(self, claim: Claim, delay_s: float = 0.0) -> None:
        """Give a leased task back unrun, its attempt uncounted: ready again at once (a draining worker's) or once
        ``delay_s`` has passed on the broker's clock (a task given back for a newer node)."""
    def get(self, task_id: str) -> TaskView | None: ...
    def result(self, task_id: str) -> Result | None: ...
    def cancel(self, task_id: str, free_key: bool = False) -> bool:
        """Cancel a waiting or running task (its worker stops at its next token and writes nothing). Its
        idempotency key keeps naming it (a retry with the key hears it was cancelled), unless ``free_key``: a
        gateway's own verdict, after which a retry with the key runs the work again."""
    def dead(self, queue: str | None = None, limit: int = 100, offset: int = 0, code: str | None = None
             ) -> list[TaskView]:
        """Dead letters, oldest first, of a queue and with an error code when given, page by page."""
    def dead_codes(self) -> list[DeadGroup]:
        """The dead letters by their last error's code, the largest group first."""
    def replay(self, task_id: str) -> bool: ...
    def forget(self, task_id: str, after_s: float = 0.0) -> bool:
        """A finished task let go: its hash or row, its result and its log kept only ``after_s`` more (0: dropped
        now; the gateway's NODEAGENT_ANSWERED_KEEP_S), unless an idempotency key names it: the request that waited
        for it has its answer, and nothing else points at it. Whether it was let go."""
    def keep(self, task_ids: list[str], since: float) -> None:
        """The finished tasks' retention (their hashes, results and idempotency keys) counted from ``since`` (the
        broker's time) when that is later than from their end: what points at them (an ended batch's files) is
        kept as long."""
    def stats(self) -> list[QueueStats]: ...
    def outstanding(self, queues: list[str], models: list[str] | None = None) -> int:
        """Tasks of these queues that this node could still get: ready, leased or delayed, unbound or bound to
        one of ``models`` (Redis counts every delayed task of the queues)."""
    def demand(self) -> list[Demand]:
        """Unfinished tasks by queue and bound model (the scheduler's view of the queue)."""
    # bulk reads: a batch's progress and its output
    def states(self, task_ids: list[str]) -> dict[str, str]:
        """Each known task's state (TaskState), in one round trip per few hundred ids."""
    def results(self, task_ids: list[str]) -> dict[str, Result]: ...
    def purge_tasks(self, older_than_s: float) -> int:
        """The tasks' retention: drop the finished tasks past ``older_than_s`` that expiry does not drop as they are
        written (SQLite: finished tasks and their results, through an index by time; Redis: the dead-letter indexes,
        whose tasks' hashes, results and keys expire on their own). Never a scan of every task. Returns the tasks
        dropped."""


class TaskLogs(Protocol):
    """Event logs: a gateway opens one for each task it waits on; the worker appends to it as it goes, and the
    broker itself how the task ends ({"kind": "finished", "state": ..., "attempt": ...}, or "cancelled")."""

    def open_log(self, task_id: str, ttl_s: float) -> None:
        """Open the task's event log (before it is enqueued), kept ``ttl_s``."""
    def publish(self, task_id: str, event: dict[str, Any], keep: int = ...) -> None:
        """Append an event to the task's log; nothing when it has none. ``keep``: the log's most entries, about."""
    def read_logs(self, cursors: dict[str, str], wait_s: float = 0.0) -> list[tuple[str, str, dict[str, Any]]]:
        """The events after each cursor ("0": from the start) of these logs, as (task id, cursor, event); an engine
        that can be woken (Redis) waits up to ``wait_s`` for one, SQLite answers at once."""
    def trim_log(self, task_id: str, cursor: str) -> None:
        """Drop the log's events up to ``cursor`` (its reader's: what it has read), so a log read for as long as
        a gateway lives holds only what is still unread."""
    def purge_logs(self, older_than_s: float) -> None:
        """The logs' retention: drop the logs past the ``ttl_s`` they were opened with (SQLite, through an index by
        time; Redis: they expire on their own)."""


class NodeRegistry(Protocol):
    """The nodes' (and gateways') records, refreshed by their heartbeats."""

    def register(self, node: NodeRecord) -> float:
        """The node's record, its start and heartbeat stamped on the broker's clock (returned)."""
    def heartbeat(self, node_id: str, fields: dict[str, Any]) -> float | None:
        """``fields`` merged into the node's record and its heartbeat stamped on the broker's clock (returned;
        None when the node is not registered)."""
    def nodes(self) -> list[NodeRecord]:
        """Every record, ``heartbeat_at`` on the broker's clock (compare it with ``now()``)."""
    def purge_nodes(self, older_than_s: float) -> None:
        """The records' retention: drop the records of nodes not heard from for ``older_than_s`` (SQLite; on Redis a
        record expires on its own after the retention, and ``nodes`` unlists it)."""


class HistoryStore(Protocol):
    """The fleet's history: a flat map of numbers per minute of the broker's time (fleet/history.py), kept
    ``keep_s``."""

    def history_add(self, minute: int, counts: dict[str, float], keep_s: float) -> None:
        """Add ``counts`` to the minute's fields (counters: several writers add up)."""
    def history_set(self, minute: int, values: dict[str, float], keep_s: float) -> None:
        """Set the minute's fields to ``values`` (gauges: the last write wins)."""
    def history(self, first_minute: int, kinds: tuple[str, ...] | None = None) -> dict[int, dict[str, float]]:
        """Every kept minute from ``first_minute`` on; ``kinds``: only the fields of these kinds (their first
        letter: "t", "d", "n"...)."""
    def purge_history(self, older_than_s: float) -> None:
        """The history's retention is its writes': a minute past ``keep_s`` goes as a later minute is written
        (SQLite), or expires (Redis). Nothing is left for the purge."""


class Events(Protocol):
    """The fleet's event log: placements, evictions, operators' actions; bounded (the newest EVENTS_KEPT)."""

    def record_event(self, event: dict[str, Any]) -> None:
        """Append an event, stamped ``at`` with the broker's time."""
    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest events first."""
    def purge_events(self, older_than_s: float) -> None:
        """The event log's retention is its bound: each write drops what is past the newest EVENTS_KEPT. Nothing
        is left for the purge."""


class Documents(Protocol):
    """Documents: the Batch API's files and batches, kept where every node's server reads them."""

    def doc_put(self, kind: str, doc_id: str, data: dict[str, Any], body: str | bytes | Any = None,
                version: int | None = None) -> bool:
        """Write a document: a new one (``version`` None; False if it exists) or over the version read (False
        when another writer changed it since: read again). ``body``: a new document's content (a file's: text, its
        UTF-8 bytes, or a binary file they are read from, in pieces where the engine can)."""
    def doc_get(self, kind: str, doc_id: str) -> tuple[dict[str, Any], int] | None:
        """The document and its version."""
    def doc_body(self, kind: str, doc_id: str) -> str | None: ...
    def doc_list(self, kind: str, after: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        """Newest first; ``after``: the id the previous page ended with."""
    def doc_delete(self, kind: str, doc_id: str) -> bool: ...
    def doc_expire(self, kind: str, doc_id: str, at: float) -> None:
        """The document goes at ``at`` (the broker's time): on its own (Redis), or at the next purge (SQLite)."""
    def purge_documents(self, older_than_s: float) -> None:
        """The documents' retention: drop those past the time ``doc_expire`` gave them (SQLite; on Redis they
        expire on their own)."""


class KeyValues(Protocol):
    """Small values with an expiry (the operator's page's sessions, stored responses)."""

    def kv_put(self, key: str, value: str, ttl_s: float, bound: tuple[int, int] | None = None) -> None:
        """Keep ``value`` under ``key`` for ``ttl_s`` seconds (the broker's clock). ``bound``: (most values, most
        bytes) of the key's collection (its name up to the first ``:``, e.g. ``response``), the oldest dropped first
        to stay within them, in the same step."""
    def kv_get(self, key: str) -> str | None:
        """The value, or None when there is none or it expired."""
    def kv_delete(self, key: str) -> None: ...
    def purge_kv(self, older_than_s: float) -> None:
        """The values' retention: drop those past their ``ttl_s`` (SQLite, which also drops them at each write;
        on Redis they expire on their own)."""


class Broker(TaskQueue, TaskLogs, NodeRegistry, HistoryStore, Events, Documents, KeyValues, Protocol):
    """The broker: every store over one connection (one database, one Redis), on the broker's one clock."""

    url: str

    def now(self) -> float:
        """The broker's time (Unix seconds): what every lease, deadline and heartbeat is compared on."""
    def purge(self, older_than_s: float) -> int:
        """Drop what is past ``older_than_s`` and that expiry does not drop as it is written (SQLite: finished
        tasks, event logs and node records, through indexes by time; Redis: the dead-letter indexes, whose tasks'
        hashes, results and keys expire on their own). Never a scan of every task. Returns the tasks dropped.
        Both engines run every store's retention in turn (``purge_stores``)."""
    def settings(self) -> dict[str, Any]:
        """What the doctor and a starting worker check of the broker itself (``broker/advice.py`` reads it): for
        Redis its role, persistence, eviction policy, replicas and Sentinels; for SQLite its journal and free
        disk. A value that could not be read is absent."""
    def hurry(self) -> None:
        """The process is leaving: its calls stop riding out a broker outage (one try each from now on)."""
    def close(self) -> None: ...


# the stores a broker composes, each with its one retention hook (``purge_<concern>``)
STORES: tuple[type, ...] = (TaskQueue, TaskLogs, NodeRegistry, HistoryStore, Events, Documents, KeyValues)


def purge_stores(broker: Broker, older_than_s: float) -> int:
    """``Broker.purge`` as both engines run it: every store's retention in turn, the tasks' first. Returns the
    tasks dropped."""
    dropped = broker.purge_tasks(older_than_s)
    broker.purge_logs(older_than_s)
    broker.purge_nodes(older_than_s)
    broker.purge_history(older_than_s)
    broker.purge_events(older_than_s)
    broker.purge_documents(older_than_s)
    broker.purge_kv(older_than_s)
    return dropped


def kept_from(envelope: Envelope) -> float | None:
    """When a finished task's retention counts from, if later than its end: a batch line's from its batch's deadline
    (the window's end), so that a line finished early is still there when a batch that outlasts the retention ends
    and makes its output file (``fleet/batches.py``); None for any other task."""
    return envelope.deadline if envelope.batch and envelope.deadline else None


def frees_key(state: str, error: ErrorInfo | None) -> bool:
    """Whether a task ending so frees its idempotency key: dead at its deadline, unrun, is the verdict of whoever set
    the deadline (a gateway's request: the same as its own cancel at that time), so a retry with the key runs the
    work; any other end keeps the key naming it (``finish.lua`` says the same for Redis)."""
    return state == "dead" and error is not None and error.code == "deadline_exceeded"


def error_result(envelope: Envelope, error: ErrorInfo, attempts: int) -> Result:
    """The Result of a task that failed for good: an error, never a partial output."""
    return Result(task_id=envelope.id, type=queue_type(envelope.queue), status="error", error=error,
                  attempts=attempts)


UNPARSABLE = "__unparsable__"


def envelope_json_schema() -> dict[str, Any]:
    schema = Envelope.model_json_schema()
    schema["$comment"] = f"nodeagent queue envelope, contract {CONTRACT}: see schemas/redis-contract.md"
    return schema


def parse_envelope(text: str | bytes | None, task_id: str, queue: str) -> Envelope:
    """An envelope from what the queue held under ``task_id``. One that cannot be used as it is (not JSON, nested
    too deep, text that is not Unicode, fields that do not validate, another queue's or another task's) still
    becomes an envelope under that id carrying the reason, whatever the exception, so the worker dead-letters it
    at claim time instead of crashing on it."""
    queue = base_queue(queue)
    data: Any = None
    try:
        if text is None:
            raise PayloadError("no envelope")
        if len(text) > MAX_ENVELOPE_BYTES:
            raise PayloadError(f"the envelope is {len(text)} bytes, over the queue's limit of {MAX_ENVELOPE_BYTES}")
        data = payload.loads(text)
        if isinstance(data, dict):
            data.setdefault("id", task_id)  # a producer may leave the id to the queue
            data.setdefault("contract", UNVERSIONED)  # a writer from before versions: its results are 1.0's
        envelope = Envelope.model_validate(data)
        if envelope.queue != queue:
            raise PayloadError(f"envelope says queue {envelope.queue!r} but sits in {queue!r}")
        if envelope.id != task_id:
            raise PayloadError(f"the envelope names task {envelope.id!r} but is stored as task {task_id!r}")
        return envelope
    except Exception as exc:  # noqa: BLE001  (a poison payload, whatever it provokes, must not crash a claim)
        raw = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
        return Envelope(id=task_id, queue=queue, contract=_said_contract(data),
                        task={UNPARSABLE: payload.printable(raw, 2000), "error": payload.printable(_reason(exc), 500)})


def _said_contract(data: Any) -> str:
    """The contract an envelope that does not parse says it was written by (a later MAJOR's shape is not this
    code's to judge: such a task is given back for a node of that version, not dead-lettered); 1.0 when it says
    none readable."""
    said = data.get("contract") if isinstance(data, dict) else None
    if isinstance(said, str):
        import re

        if re.fullmatch(CONTRACT_PATTERN.strip("^$"), said):
            return said
    return UNVERSIONED


def _reason(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return validation_message(exc)
    return str(exc) if isinstance(exc, PayloadError) else f"{type(exc).__name__}: {exc}"
