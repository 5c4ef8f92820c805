"""The worker: claim -> run -> result -> ack, with lease renewal, heartbeats, the guard and a clean drain.

The worker runs tasks in its own process, on the model its node loaded (a process holding gigabytes of
weights is not forked per task). It gets its broker, its node (the core's ``Node``, or anything with the same
``run``), its guard and its clocks passed in, so tests drive it with a fake backend and made-up readings.

Time: deadlines and a task's wait in the queue are the broker's time (``broker.now()``); the drain and the lease
renewals are durations on the monotonic clock. The node's own wall clock is only measured against the broker's,
at every heartbeat (``clock_offset_s`` in its record, which ``status`` shows and alerts on).

- A claimed task is checked before it runs: a payload that is not a task, a type that does not match its
  queue, a deadline already passed, or too many attempts (its workers kept dying) goes to the dead letters
  with the reason, and the worker keeps serving. A task written by a newer contract that this node cannot read
  (another MAJOR, or a field or value its version does not know) is given back for a newer node, its attempt
  uncounted, and counted in the node's record (``deferred``).
- While a task runs, a thread renews its lease every third of the lease; a lease that cannot be renewed (it
  expired and another worker took the task, or the task was cancelled) stops the task at the next token and
  nothing is written.
- A task past its time limit is stopped (``timeout``, not retried: greedy decoding would do it again).
- A retryable failure goes back with full-jitter exponential backoff held by the broker; a final one goes to
  the dead letters, whose last error becomes the task's Result.
- SIGTERM drains: no more claims, the running task may finish within ``drain_s``, else it is given back
  unrun; the node record is marked, and the worker exits before a service manager's stop timeout. With
  ``drain_handoff``, a stream is given back at once, for another node to continue from what was sent.
- With ``slots`` above 1 the worker holds up to that many tasks at once, each on a thread of its own, and the
  node decodes them together (parallel sequences of one context); a claim is made only when a slot is free.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

from pydantic import Field, TypeAdapter, ValidationError

from nodeagent.broker.base import (
    CONTRACT,
    DEFER_S,
    UNPARSABLE,
    Broker,
    Claim,
    NodeRecord,
    Purge,
    backoff_s,
    blip_delay_s,
    contract_parts,
    error_result,
    lost_after,
    newer_contract,
    readable_contract,
)
from nodeagent.clock import pause
from nodeagent.codes import code
from nodeagent.config import NodeConfig, default_of
from nodeagent.errors import validation_message
from nodeagent.fleet.affinity import WARM_KEYS, Peer, WarmKeys, leave_to, peers_of, prefix_key
from nodeagent.fleet.controls import Controls, read_controls
from nodeagent.fleet.guard import Guard
from nodeagent.fleet.history import DepthSampler, Rollup
from nodeagent.tasks.contracts import BATCH_SUFFIX, ChatTask, ErrorInfo, Result, Task, queue_type
from nodeagent.tasks.events import Follower, Progress, Resume, Started, from_wire
from nodeagent.values import Frozen

log = logging.getLogger(__name__)
_TASK = TypeAdapter(Task)
COUNTS_BEAT_S = 1.0  # a settled task's counts reach the node's record within about this (not a heartbeat later)
PEERS_READ_S = 2.0  # the other nodes' records (their warm prefixes) read again at most this often
LEAVE_PAUSE_S = 0.05  # after giving a task back for a warm node: its next claim is not that task again at once


class Runs(Protocol):
    def run(self, task: Any, *, queue_wait_s: float = 0.0, attempt: int = 1,
            stop: Callable[[], ErrorInfo | None] | None = None, timeout_s: float | None = None) -> Result: ...


def _setting(name: str) -> Any:
    return Field(default_factory=lambda: default_of(name))


class WorkerConfig(Frozen):
    """What the worker loop needs; ``from_config`` builds it from the resolved settings, and a field left out
    (a test's) takes its setting's one default."""

    node_id: str
    queues: list[str] = Field(description="Task types served, e.g. classify.v1")
    models: list[str] = Field(default_factory=list, description="Model names tasks may be bound to")
    lease_s: float = _setting("lease_s")
    heartbeat_s: float = _setting("heartbeat_s")
    task_timeout_s: dict[str, float] = Field(default_factory=dict, description="Per task type")
    default_timeout_s: float = Field(default_factory=lambda: float(default_of("task_timeout_s")),
                                     description="For a type task_timeout_s does not name")
    max_attempts: int = Field(default_factory=lambda: default_of("max_attempts"),
                              description="This node's cap on any task's attempts (the task's own applies too)")
    retry_base_s: float = _setting("retry_base_s")
    retry_cap_s: float = _setting("retry_cap_s")
    result_retention_s: float = _setting("result_retention_s")
    drain_s: float = _setting("drain_s")
    drain_handoff: bool = _setting("drain_handoff")
    prefer_warm_s: float = _setting("prefer_warm_s")
    warm_keys: int = Field(WARM_KEYS, ge=1, description="The prefix keys it says it holds warm: its last tasks'")
    history_keep_s: float = Field(default_factory=lambda: default_of("history_days") * 86400.0,
                                  description="How long the fleet's history keeps what this worker adds to it")
    idle_s: float = 0.01
    idle_max_s: float = 0.1
    burst: bool = False
    slots: int = Field(1, ge=1, description="Tasks held and run at once (the node's slots)")
    max_tokens: int = Field(default_factory=lambda: default_of("max_tokens"),
                            description="The budget of a queued chat that gives none (NODEAGENT_MAX_TOKENS): what "
                                        "the context leaves, up to this")

    @classmethod
    def from_config(cls, config: NodeConfig, node_id: str, queues: list[str], limit: Callable[[str], float],
                    **fields: Any) -> "WorkerConfig":
        """The worker's config from the resolved settings; ``limit``: a task type's time limit (the node's)."""
        return cls(node_id=node_id, queues=queues, lease_s=config.lease_s, heartbeat_s=config.heartbeat_s,
                   task_timeout_s={q: limit(q) for q in queues}, max_attempts=config.max_attempts,
                   retry_base_s=config.retry_base_s, retry_cap_s=config.retry_cap_s,
                   result_retention_s=config.result_retention_s, drain_s=config.drain_s,
                   drain_handoff=config.drain_handoff, prefer_warm_s=config.prefer_warm_s,
                   history_keep_s=config.history_days * 86400.0,
                   max_tokens=config.max_tokens, **fields)


class Worker:
    def __init__(self, broker: Broker, node: Runs, config: WorkerConfig, record: NodeRecord | None = None,
                 guard: Guard | None = None, clock: Callable[[], float] | None = None,
                 duties: list[tuple[float, Callable[[], Any]]] | None = None,
                 beat_fields: Callable[[], dict[str, Any]] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        """``clock``: the broker's time (default ``broker.now``); ``wall``: this node's wall clock, only ever
        measured against it. ``duties``: (every seconds, work) the claim loop does between claims (a following
        node's look at its assignment, an embedded scheduler's round); an error in one is logged, never the end
        of the worker. ``beat_fields``: more of the node's record that each heartbeat refreshes (what a model set
        holds)."""
        self.broker, self.node, self.config = broker, node, config
        self._duties = [[every, fn, 0.0] for every, fn in (duties or [])]
        self._beat_fields = beat_fields
        self.record = record
        self.guard = guard or Guard(node_id=config.node_id)
        self.clock = clock or broker.now
        self.wall = wall
        self.clock_offset_s: float | None = None
        self.draining = threading.Event()
        self.stopped = threading.Event()
        self.in_flight = 0
        self.completed = 0
        self.failed = 0
        self.deferred = 0  # tasks given back unread for a newer node
        self.deferred_why: str | None = None
        self.warm = WarmKeys(config.warm_keys)  # the prefix keys of the tasks it ran last (fleet/affinity.py)
        self.left_warm = 0  # tasks given back for a node that held their prefix warm
        self._peers_read: tuple[float, list[Peer]] = (-math.inf, [])
        self._deferred_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._state = "starting"
        self._leases = LeaseKeeper(broker, config.lease_s)
        self._outage = Outage(f"node {config.node_id}")
        self._beat_now = threading.Event()
        self._urgent = False  # the beat asked for says a change of state or of holdings: not held back for counts
        self._last_beat = 0.0  # monotonic
        self._beat_lock = threading.RLock()  # re-entrant: a signal handler may drain in the middle of a beat
        self._count_lock = threading.Lock()
        self._free = threading.Semaphore(config.slots)
        self.rollup = Rollup(config.node_id)  # what it ran, added to the fleet's history at each heartbeat
        self._depths = DepthSampler()
        self._purge = Purge(broker, config.result_retention_s)  # from the heartbeat loop (a worker has no app)
        self.controls = Controls()  # the operator's: read at each heartbeat
        self._pool = ThreadPoolExecutor(config.slots, thread_name_prefix="slot") if config.slots > 1 else None

    # -- lifecycle -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, int]:
        """Serve until drained (SIGTERM, ``stop()``) or, in burst mode, until nothing is left to do. A broker
        that cannot be reached, or any error in the loop itself, is waited out with backoff (the node's record
        says ``degraded``): the worker serves again when the broker is back."""
        self._call_until_done(lambda: self.record is not None and self._measured(lambda: self.broker.register(
            self.record.model_copy(update={"state": "ready", "heartbeat_s": self.config.heartbeat_s}))),
                              "register")
        if self.draining.is_set():
            return self._finish()
        log_broker_advice(self.broker)
        self._state = "ready"
        log.info("node %s ready: serving %s", self.config.node_id, ", ".join(self.config.queues))
        beat = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        beat.start()
        idle = self.config.idle_s
        try:
            while not self.draining.is_set():
                self._do_duties()
                if not self._free.acquire(timeout=self.config.idle_max_s):  # every slot busy
                    continue
                try:
                    claim, done = self._claim()
                except Exception as exc:  # noqa: BLE001  (an outage, or a bug: never the end of the worker)
                    self._free.release()
                    self.draining.wait(self._outage.failed(exc))
                    self._set_state("degraded")
                    continue
                if self._outage.recovered():
                    self._set_state("ready")
                if claim is None:
                    self._free.release()
                    if done:
                        break
                    if hasattr(self.node, "reap"):  # a model set: unload what is idle past its keep-alive
                        self.node.reap()
                    if not getattr(self.broker, "blocks", False) or self.config.burst:
                        self.draining.wait(idle)
                        idle = min(idle * 2, self.config.idle_max_s)
                    continue
                idle = self.config.idle_s
                if self._pool is None:
                    self._process_then_free(claim)
                else:
                    self._pool.submit(self._process_then_free, claim)
        finally:
            self._finish()
        return {"completed": self.completed, "failed": self.failed}

    def _do_duties(self) -> None:
        now = time.monotonic()
        for duty in self._duties:
            every, fn, due = duty
            if now < due:
                continue
            duty[2] = now + every
            try:
                if fn():
                    self._beat_soon(urgent=True)  # what the node holds changed: say so now
            except Exception as exc:  # noqa: BLE001  (fail-static: what the node holds stays; tried again later)
                log.warning("%s failed: %s: %s", getattr(fn, "__qualname__", "a duty"), type(exc).__name__,
                            _one_line(exc))

    def _claim(self) -> tuple[Claim | None, bool]:
        """A claimed task, or None; and whether a burst worker is done (nothing left that it could get)."""
        if not self.guard.may_claim():
            self._set_state("unhealthy" if self.guard.state == "unhealthy" else "ready")
            self.draining.wait(min(1.0, self.config.idle_max_s))
            return None, False
        self._set_state("ready" if not self._outage.failing else "degraded")
        blocks = getattr(self.broker, "blocks", False) and not self.config.burst
        interactive = self.controls.queues(self.config.queues)  # less the queues the operator paused
        if not interactive:
            self.draining.wait(min(1.0, self.config.idle_max_s))
            return None, False
        batch = [q + BATCH_SUFFIX for q in interactive]
        claim = None
        every = self.config.models or None
        if hasattr(self.node, "routing_names"):  # a model set: its members may change (a following node)
            every = self.node.routing_names() or None
            if every is None:  # holding nothing yet: no task to take (an unbound one would fail here)
                self.draining.wait(min(1.0, self.config.idle_max_s))
                return None, False
        # a model set: tasks for the models it holds loaded (or for none) before those that need a load
        loaded = self.node.loaded_names() if hasattr(self.node, "loaded_names") else None
        first = [loaded, every] if loaded and every and set(loaded) != set(every) else [every]
        # interactive work first, a batch's lines when there is none (a batch must not starve interactive work);
        # an engine that can wait for a task then waits on both
        tiers = [(q, 0.0, models) for q in (interactive, batch) for models in first]
        for queues, wait_s, models in [*tiers, (interactive + batch, self.config.idle_max_s, every)]:
            if wait_s and not blocks:
                break
            claim = self.broker.claim(queues, self.config.node_id, self.config.lease_s, models, wait_s=wait_s)
            if claim is not None:
                break
        done = (claim is None and self.config.burst and self.in_flight == 0
                and self.broker.outstanding(interactive + batch, every) == 0)
        return claim, done

    def _finish(self) -> dict[str, int]:
        if self._pool is not None:  # the tasks in hand finish (or are stopped by the drain)
            self._pool.shutdown(wait=True)
        self.stopped.set()
        self._leases.close()
        self._set_state("stopped")
        self._beat(final=True)
        log.info("node %s stopped: %d completed, %d failed", self.config.node_id, self.completed, self.failed)
        return {"completed": self.completed, "failed": self.failed}

    def _call_until_done(self, fn: Callable[[], Any], what: str) -> None:
        """``fn`` until it works (a broker that is down at start is waited for), or until the worker drains."""
        while not self.draining.is_set():
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                self.draining.wait(self._outage.failed(exc, what))
                continue
            self._outage.recovered()
            return

    @property
    def serving(self) -> bool:
        """Whether the loop can serve now: not stopped, and the broker answered its last call."""
        return not self.stopped.is_set() and not self._outage.failing

    def stop(self) -> None:
        """Drain: claim nothing more; the running task gets ``drain_s`` to finish."""
        if not self.draining.is_set():
            log.info("draining: no more claims")
            self.draining.set()
            self._state = "draining"
            # its beats and claims stop riding out an outage (a stop during one took 85 s, past systemd's
            # patience); the task in hand writes its outcome through its own retries while its lease lasts
            self.broker.hurry()
            self._beat()

    # -- one task ------------------------------------------------------------------------------------------
    def _process_then_free(self, claim: Claim) -> None:
        try:
            self.process(claim)
        except Exception:  # noqa: BLE001  (a bug under one task must not take a slot away)
            log.exception("task %s could not be settled; its lease will expire and it runs again",
                          claim.envelope.id)
        finally:
            self._free.release()

    def _count(self, field: str, delta: int) -> None:
        with self._count_lock:
            setattr(self, field, getattr(self, field) + delta)

    def process(self, claim: Claim) -> None:
        e = claim.envelope
        task, problem = self._check(claim)
        if isinstance(problem, str):  # not for this node's version: another node's
            self._defer(claim, problem)
            return
        if problem is not None:
            log.warning("task %s dead-lettered: %s: %s", e.id, problem.code, problem.message)
            self._settle_surely(claim, lambda: self.broker.bury(claim, problem))
            self._count("failed", 1)
            self.rollup.attempt(e.queue, error_result(e, problem, claim.attempt), "dead")
            return
        assert task is not None
        key = prefix_key(task, e.model)
        if self._leave_warm(claim, key):
            return
        timeout = self.config.task_timeout_s.get(queue_type(e.queue), self.config.default_timeout_s)
        lost = self._leases.hold(claim)
        drain_deadline: list[float] = []
        deadline = _deadline(e.deadline, task)
        task = task.model_copy(update={"deadline": None}) if getattr(task, "deadline", None) is not None else task
        task = self._budgeted(task)

        def stop() -> ErrorInfo | None:
            if lost.is_set():
                return ErrorInfo(code="lease_lost", message="the lease was lost or the task cancelled",
                                 retryable=True)
            if deadline is not None and self.clock() >= deadline:  # the broker's time, never this node's
                return ErrorInfo(code="deadline_exceeded", retryable=False,
                                 message="the deadline passed; no partial result is returned")
            if self.draining.is_set() and self.config.drain_handoff and e.progress:  # another node continues it
                return ErrorInfo(code="draining", message="the worker is stopping: the stream is handed over",
                                 retryable=True)
            if self.draining.is_set():
                now = time.monotonic()
                drain_deadline[:1] = drain_deadline[:1] or [now + self.config.drain_s]
                if now > drain_deadline[0]:
                    return ErrorInfo(code="draining", message="the worker is stopping", retryable=True)
            return None

        extra: dict[str, Any] = {}
        if e.progress:  # a gateway waits on it: which attempt runs where, then the answer piece by piece
            try:
                sent = self._sent_before(e.id)
            except Exception as exc:  # noqa: BLE001  (the broker's blip outlasted its retries)
                # what went out is unknown: neither continued nor begun again, it goes back for a next claim
                log.warning("task %s: its stream's log could not be read (%s); given back", e.id, _one_line(exc))
                self._leases.drop(claim)
                self._settle_surely(claim, lambda: self.broker.release(claim, delay_s=random.uniform(*DEFER_S)))
                return
            extra["progress"] = self._reporter(e.id, claim.attempt, sent)
            extra["progress"](Started(self.config.node_id).to_wire())
        self._count("in_flight", 1)
        try:
            try:
                result = self.node.run(task, queue_wait_s=max(0.0, self.clock() - e.created_at),
                                       attempt=claim.attempt, stop=stop, timeout_s=timeout, model=e.model, **extra)
            except Exception as exc:  # noqa: BLE001  (a bug under one task must not take the worker down)
                log.exception("task %s raised", e.id)
                result = Result(task_id=e.id, type=task.type, status="error", attempts=claim.attempt,
                                error=ErrorInfo(code="worker_error", message=f"{type(exc).__name__}: {exc}",
                                                retryable=True))
            # written for the task's writer: what its contract does not know is left out (it reads the rest)
            self._settle(claim, result.for_reader(contract_parts(e.contract)), lost)  # the lease is renewed till then
        finally:
            with self._count_lock:
                self.warm.ran(key)  # its prefix is in a slot here now (and on disk once it recurs)
            self._leases.drop(claim)
            self._count("in_flight", -1)

    def _leave_warm(self, claim: Claim, key: str | None) -> bool:
        """Give the task back, at once and uncounted, for a node that holds its prefix warm (``affinity.leave_to``),
        while it has waited less than NODEAGENT_PREFER_WARM_S; whether it did."""
        bound = self.config.prefer_warm_s
        with self._count_lock:
            warm_here = key in self.warm
        if key is None or bound <= 0 or warm_here:
            return False
        age = max(0.0, self.clock() - claim.envelope.created_at)
        peer = leave_to(key, age, (), self._peers(), bound) if age < bound else None
        if peer is None:
            return False
        log.debug("task %s left to node %s, which holds its prefix warm (waited %.2f s)", claim.envelope.id, peer, age)
        self._settle_surely(claim, lambda: self.broker.release(claim))
        self._count("left_warm", 1)
        self.draining.wait(LEAVE_PAUSE_S)  # (its next claim is not the same task again at once)
        return True

    def _peers(self) -> list[Peer]:
        """The other nodes serving now, as their records say (read at most every PEERS_READ_S)."""
        read_at, peers = self._peers_read
        if time.monotonic() - read_at < min(PEERS_READ_S, self.config.heartbeat_s):
            return peers
        try:
            peers = peers_of(self.broker.nodes(), self.config.node_id, self.clock(),
                             lost_after(self.config.heartbeat_s))
        except Exception as exc:  # noqa: BLE001  (no peers known: the task runs here)
            log.debug("the fleet's records could not be read: %s", exc)
            peers = []
        self._peers_read = (time.monotonic(), peers)
        return peers

    def _budgeted(self, task: Any) -> Any:
        """A chat that gave no budget bounded by this node's own NODEAGENT_MAX_TOKENS, as `serve` bounds one
        (``spec.budgeted``); any other task as it is."""
        if not isinstance(task, ChatTask):  # (a text completion's default budget is OpenAI's 16)
            return task
        from nodeagent.tasks.openai.spec import budgeted

        return task.model_copy(update={"request": budgeted(task.request, self.config.max_tokens)})

    def _defer(self, claim: Claim, why: str) -> None:
        """Give a task back unread for a newer node: ready again after a short delay, its attempt uncounted."""
        e = claim.envelope
        delay = random.uniform(*DEFER_S)
        # said once a task (it comes back every few seconds while no newer node takes it)
        (log.debug if e.id in self._deferred_ids else log.warning)("task %s given back for a newer node: %s", e.id,
                                                                   why)
        self._deferred_ids[e.id] = None
        while len(self._deferred_ids) > 1000:
            self._deferred_ids.popitem(last=False)
        self._settle_surely(claim, lambda: self.broker.release(claim, delay_s=delay))
        with self._count_lock:
            self.deferred += 1
            self.deferred_why = why[:300]
        self.rollup.deferred(e.queue)
        self._beat_soon()

    def _reporter(self, task_id: str, attempt: int, sent: Resume | None) -> Progress:
        """What reports an attempt's progress to the task's log: each event numbered (``seq``, from 1, in the order
        published, by claim: ``run``), so a reader drops a copy that a retried write left, and knows a gap for what
        it is. An attempt first reads what the claims before it sent (``Progress.resume``), to continue from it."""
        lock = threading.Lock()
        count = [0]

        run = uuid.uuid4().hex[:12]  # this claim: a claim given back unrun keeps the attempt's number

        def report(event: dict[str, Any]) -> None:
            with lock:
                count[0] += 1
                self._publish(task_id, {**event, "attempt": attempt, "run": run, "seq": count[0]})

        return Progress(report, sent)

    def _sent_before(self, task_id: str) -> Resume | None:
        """What the earlier attempts of a streamed task sent, read from its log as the gateway read it (the same
        ``Follower``); None when nothing went out. Raises what the broker raised when the log cannot be read."""
        follower = Follower()
        cursor = "0"
        while True:
            got = self.broker.read_logs({task_id: cursor})
            for _, cursor, event in got:
                follower.take(from_wire(event))
            if not got:
                break
        return follower.resume()

    def _publish(self, task_id: str, event: dict[str, Any]) -> None:
        """An event of a task's progress; a broker blip loses it (the task's own outcome is written surely)."""
        try:
            self.broker.publish(task_id, event)
        except Exception as exc:  # noqa: BLE001
            log.warning("task %s: its progress could not be published: %s", task_id, _one_line(exc))

    def _check(self, claim: Claim) -> tuple[Any, ErrorInfo | str | None]:
        """The task, or why not: an ErrorInfo to dead-letter it with, or (a str) why it is a newer node's."""
        e = claim.envelope
        if e.deadline is not None and self.clock() > e.deadline:  # whoever could read it, it is too late to start
            return None, ErrorInfo(code="deadline_exceeded", retryable=False,
                                   message="the deadline passed before the task started (on the broker's clock)")
        if not readable_contract(e.contract):  # another major's shape is its own to judge, parsed or not
            return None, f"written by contract {e.contract}, another major version than this node's {CONTRACT}"
        if UNPARSABLE in e.task:
            return None, ErrorInfo(code="invalid_task", retryable=False,
                                   message=f"the queued payload is not a task envelope: {e.task.get('error')}")
        if claim.attempt > self._max_attempts(claim):
            return None, ErrorInfo(code="too_many_attempts", retryable=False,
                                   message=f"attempt {claim.attempt} of at most {self._max_attempts(claim)}: the "
                                           "workers that took it stopped before finishing")
        try:
            task = _TASK.validate_python(e.task)
        except ValidationError as exc:
            if newer_contract(e.contract):  # a field or a value this version does not know: a newer node's task
                return None, (f"written by contract {e.contract}, newer than this node's {CONTRACT}, which cannot "
                              f"read it: {validation_message(exc)}")
            return None, ErrorInfo(code="invalid_task", retryable=False, message=validation_message(exc))
        except Exception as exc:  # noqa: BLE001  (whatever a payload provokes in validation: a dead letter)
            return None, ErrorInfo(code="invalid_task", retryable=False,
                                   message=f"the task could not be validated: {type(exc).__name__}: {exc}"[:500])
        if task.type != queue_type(e.queue):
            return None, ErrorInfo(code="invalid_task", retryable=False,
                                   message=f"a {task.type} task in the {e.queue} queue")
        if task.id != e.id:  # the queue's id is the task's (a producer may leave the task's own id out)
            task = task.model_copy(update={"id": e.id})
        deadline = _deadline(e.deadline, task)
        if deadline is not None and self.clock() > deadline:
            return None, ErrorInfo(code="deadline_exceeded", retryable=False,
                                   message="the deadline passed before the task started (on the broker's clock)")
        return task, None

    def _max_attempts(self, claim: Claim) -> int:
        return min(claim.envelope.max_attempts, self.config.max_attempts)

    def _settle(self, claim: Claim, result: Result, lost: threading.Event) -> None:
        e = claim.envelope
        if lost.is_set() or (result.error is not None and result.error.code == "lease_lost"):
            log.warning("task %s: lease lost; another worker has it, nothing written", e.id)
            return
        if result.error is not None and result.error.code == "draining":
            self._settle_surely(claim, lambda: self.broker.release(claim))
            return
        if result.status == "ok":
            self._settle_surely(claim, lambda: self.broker.complete(claim, result))
            self._count("completed", 1)
            self.rollup.attempt(e.queue, result, "ok")
            self._history_now()
            self._counts_now()
            self.guard.record(True)
            return
        error = result.error
        assert error is not None
        if error.retryable and claim.attempt < self._max_attempts(claim):
            delay = backoff_s(claim.attempt, self.config.retry_base_s, self.config.retry_cap_s)
            log.info("task %s: %s; retry %d in %.1f s", e.id, error.code, claim.attempt, delay)
            self._settle_surely(claim, lambda: self.broker.retry(claim, error, delay))
            self.rollup.attempt(e.queue, result, "retry")
        else:
            log.warning("task %s dead-lettered after %d attempts: %s", e.id, claim.attempt, error.code)
            self._settle_surely(claim, lambda: self.broker.bury(claim, error))
            self.rollup.attempt(e.queue, result, "dead")
        self._history_now()
        self._count("failed", 1)
        self._counts_now()
        if code(error.code).fault == "node":  # what the task itself caused says nothing of this node's health
            self.guard.record(False, f"{e.queue} {e.id}: {error.code}")

    def _counts_now(self) -> None:
        """The node's counts said soon (``status`` lists them beside the queue's own done column): the heartbeat
        thread beats once COUNTS_BEAT_S has passed since its last beat."""
        self._beat_soon()

    def _beat_soon(self, urgent: bool = False) -> None:
        """A beat asked of the heartbeat thread before its interval: at once for a change of state or of what the
        node holds (``urgent``), else (counts) not sooner than COUNTS_BEAT_S after the last beat."""
        if urgent:
            self._urgent = True
        self._beat_now.set()

    def _history_now(self) -> None:
        """The attempt just settled, added to the fleet's history at once: held until the next heartbeat, a node
        killed with -9 took up to a beat of finished tasks out of the page's counts (7 of 40 in three kills).
        A failed write keeps the counts for the heartbeat's."""
        try:
            self.rollup.flush(self.broker, self.clock(), self.config.history_keep_s)
        except Exception as exc:  # noqa: BLE001  (a broker blip: the next beat writes them)
            log.debug("history not written now: %s", _one_line(exc))

    def _settle_surely(self, claim: Claim, write: Callable[[], Any]) -> None:
        """Write a task's outcome, retrying through a broker blip while the lease (still renewed) lasts; past
        that, the lease expires and the task runs again elsewhere (its result is written once either way)."""
        delay, give_up = 0.05, time.monotonic() + self.config.lease_s
        while True:
            try:
                write()
                return
            except Exception as exc:  # noqa: BLE001
                if time.monotonic() + delay > give_up:
                    raise
                log.warning("task %s: writing its outcome failed (%s: %s); retrying", claim.envelope.id,
                            type(exc).__name__, exc)
                pause(delay)
                delay = min(delay * 2, 2.0)

    # -- background ----------------------------------------------------------------------------------------

    def _heartbeats(self) -> None:
        while not self.stopped.is_set():
            woken = self._beat_now.wait(max(0.0, self._last_beat + self.config.heartbeat_s - time.monotonic()))
            self._beat_now.clear()
            if self.stopped.is_set():
                return
            if woken and not self._urgent:  # a settled task's counts: not sooner than COUNTS_BEAT_S after the last
                pause(max(0.0, self._last_beat + min(COUNTS_BEAT_S, self.config.heartbeat_s) - time.monotonic()))
            self._urgent = False
            self._beat()
            try:  # what expiry leaves, past the retention (``Purge``: at most once a PURGE_EVERY_S)
                self._purge()
            except Exception as exc:  # noqa: BLE001
                log.warning("purging old results failed: %s", exc)

    def _beat(self, final: bool = False) -> None:
        """One heartbeat. One at a time: the heartbeat thread's beat in flight when the worker stops lands before
        the final one (``stopped`` on the record last), and none starts after the worker stopped."""
        if self.record is None:
            return
        with self._beat_lock:
            if self.stopped.is_set() and not final:
                return
            self._beat_once()

    def _beat_once(self) -> None:
        self._last_beat = time.monotonic()
        try:
            import psutil

            guard = self.guard.status()  # read once: its state after the health reading it takes, not before
            with self._count_lock:
                warm = self.warm.keys()
            fields = {"state": self._state, "guard": guard["state"], "in_flight": self.in_flight,
                      "completed": self.completed, "failed": self.failed, "deferred": self.deferred,
                      "deferred_why": self.deferred_why, "warm": warm, "left_warm": self.left_warm,
                      "ram_available_bytes": psutil.virtual_memory().available,
                      "guard_status": guard, "clock_offset_s": self.clock_offset_s,
                      **(self._beat_fields() if self._beat_fields else {})}
            now = self._measured(lambda: self.broker.heartbeat(self.config.node_id, fields))
            if now is None:
                return
            self._apply(read_controls(self.broker, self.config.node_id))
            keep = self.config.history_keep_s
            self.rollup.flush(self.broker, now, keep)  # what it ran since the last beat, into the history
            self._depths.sample(self.broker, now, keep)
        except Exception as exc:  # noqa: BLE001
            (log.debug if self._outage.failing else log.warning)("heartbeat failed: %s", exc)

    def _apply(self, controls: Controls) -> None:
        """The operator's controls: queues paused fleet-wide, and this node's own hold (through its guard)."""
        if controls.paused_queues != self.controls.paused_queues:
            paused = sorted(controls.paused_queues & {q.removesuffix(BATCH_SUFFIX) for q in self.config.queues})
            log.info("queues paused by the operator: %s", ", ".join(paused) or "none")
        if controls.hold != self.controls.hold:
            log.info("node %s: %s", self.config.node_id, controls.hold or "resumed by the operator")
            self.guard.hold(controls.hold)
        self.controls = controls

    def _measured(self, write: Callable[[], float | None]) -> float | None:
        """A write the broker stamps with its time: this node's wall clock measured against that stamp (the
        middle of the round trip), for the next heartbeat to record. Returns the stamp."""
        before = self.wall()
        stamped = write()
        after = self.wall()
        if stamped is not None:
            offset = (before + after) / 2 - stamped
            if self.clock_offset_s is None or abs(offset - self.clock_offset_s) > 1.0:
                log.info("node %s: its wall clock is %+.1f s off the broker's", self.config.node_id, offset)
            self.clock_offset_s = offset
        return stamped

    def _set_state(self, state: str) -> None:
        """The state the node's record shows; the heartbeat thread writes it (never the claim loop: a broker
        that does not answer must not hold the loop)."""
        if self.draining.is_set() and state not in ("stopped",):
            state = "draining"
        if state != self._state:
            self._state = state
            self._beat_soon(urgent=True)


class LeaseKeeper:
    """One thread per worker that renews the lease of every task in hand every third of the lease (a thread per
    task cost more than a 0 ms task). ``hold`` returns an event set when that lease is lost."""

    def __init__(self, broker: Broker, lease_s: float) -> None:
        self.broker, self.lease_s = broker, lease_s
        self._cond = threading.Condition()
        self._held: dict[int, tuple[Claim, threading.Event, float]] = {}  # id(claim) -> claim, lost, renew at
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="lease", daemon=True)
        self._thread.start()

    def hold(self, claim: Claim) -> threading.Event:
        lost = threading.Event()
        with self._cond:
            self._held[id(claim)] = (claim, lost, time.monotonic() + self.lease_s / 3)
            self._cond.notify()
        return lost

    def drop(self, claim: Claim) -> None:
        with self._cond:
            self._held.pop(id(claim), None)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(5)

    def _loop(self) -> None:
        every = self.lease_s / 3
        with self._cond:
            while not self._closed:
                if not self._held:
                    self._cond.wait()
                    continue
                key, (claim, lost, due) = min(self._held.items(), key=lambda kv: kv[1][2])
                wait = due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue  # finished, replaced or joined by another meanwhile: look again
                self._held[key] = (claim, lost, time.monotonic() + every)
                try:
                    if not self.broker.renew(claim, self.lease_s):
                        lost.set()
                        self._held.pop(key, None)
                except Exception as exc:  # noqa: BLE001  (a broker blip: try again; the lease has 2/3 left)
                    log.warning("lease renewal of %s failed: %s", claim.envelope.id, exc)


class Outage:
    """Consecutive failures of the broker (or of the loop around it): a delay before the next try, with full
    jitter from 0.1 s doubling to 5 s (``blip_delay_s``); one log line when it starts, one a minute while it lasts,
    one when it ends."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.failures = 0
        self.since = 0.0
        self._said = 0.0

    @property
    def failing(self) -> bool:
        return self.failures > 0

    def failed(self, exc: Exception, what: str = "claim") -> float:
        now = time.monotonic()
        if self.failures == 0:
            self.since = self._said = now
            log.warning("%s: the broker failed (%s: %s: %s); retrying with backoff, serving nothing meanwhile",
                        self.who, what, type(exc).__name__, _one_line(exc))
        elif now - self._said >= 60:
            self._said = now
            log.warning("%s: the broker still fails after %.0f s (%d tries): %s: %s", self.who, now - self.since,
                        self.failures, type(exc).__name__, _one_line(exc))
        self.failures += 1
        return blip_delay_s(self.failures)

    def recovered(self) -> bool:
        """True once after failures: the broker answers again."""
        if self.failures == 0:
            return False
        log.warning("%s: the broker answers again after %.1f s (%d failed tries); serving", self.who,
                    time.monotonic() - self.since, self.failures)
        self.failures = 0
        return True


def log_broker_advice(broker: Broker) -> None:
    """The broker's own settings judged as `nodeagent doctor` judges them (``broker/advice.py``): each warning and
    failure logged once, when a worker (or a gateway) starts."""
    from nodeagent.broker.advice import advise

    try:
        findings = advise(broker.settings())
    except Exception as exc:  # noqa: BLE001  (a reading refused or failing says nothing against the queue itself)
        log.debug("the broker's settings could not be read: %s", _one_line(exc))
        return
    for f in findings:
        if f.status != "ok":
            log.warning("broker %s (%s): %s%s", f.name.removeprefix("broker "), f.status, f.detail,
                        f"; fix: {f.fix}" if f.fix else "")


def _deadline(envelope_deadline: float | None, task: Any) -> float | None:
    """A task's deadline as an instant: the envelope's, else the task's own (a producer that wrote only that)."""
    if envelope_deadline is not None:
        return envelope_deadline
    own = getattr(task, "deadline", None)
    return own.timestamp() if own is not None else None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300]
