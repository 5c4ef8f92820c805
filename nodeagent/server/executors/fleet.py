"""The gateway's executor: the fleet as one endpoint. A request becomes a task of its type on the durable queue,
bound to the model it names; a worker that serves that model runs it with the same code as `serve`, and its
progress comes back through the task's event log (``broker.open_log``/``read_logs``), which this process reads
for all its requests at once (``LogReader``: one reader, however many requests wait). The answer is the task's
result in the route's own shape; a stream relays the worker's pieces as they come.

- **Failover.** A task whose worker dies is leased again by another node: a whole answer never learns of it but
  by ``x-nodeagent-attempts``; a stream that has sent no piece yet follows the new attempt; one that has goes on
  from the new attempt, which continues from exactly what was sent (``tasks/events.Follower``; the final chunk
  says ``nodeagent_resumed``). Where the next node cannot continue it (several choices, log-probabilities asked
  for, the context full, a node too old), the stream ends with an error event (``node_lost``, retryable, with the
  reason) and its task is cancelled; nothing waits past the request's deadline.
- **Deadline.** The client's own limit (the openai package's ``X-Stainless-Timeout``), or
  NODEAGENT_GATEWAY_TIMEOUT_S, becomes the task's deadline; a client that goes away cancels its task (a task never
  started is never run).
- **Backpressure.** A request the fleet could not start within NODEAGENT_GATEWAY_MAX_WAIT_S, by the queue ahead of
  it and the rate its model's tasks finish at, gets 429 with a Retry-After from that estimate; a model no live node
  serves is a 404, unless following nodes may be given it by the scheduler: then the request waits (its demand is
  what places it) up to NODEAGENT_GATEWAY_PLACEMENT_WAIT_S, and past that gets 503 with Retry-After.

The gateway keeps no state of its own beyond what it waits on: several can run behind a load balancer.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
import uuid
from typing import Any, AsyncIterator

from nodeagent import classify_routes
from nodeagent.broker.base import ROUTED_SINCE, Broker, Envelope, NodeRecord, contract_parts, lost_after
from nodeagent.classify_routes import RouteChooser
from nodeagent.errors import HttpError, TaskFailed
from nodeagent.fleet.labelled_sets import LabelledSets
from nodeagent.model_names import match
from nodeagent.server.executors import Call
from nodeagent.tasks import registry
from nodeagent.tasks.contracts import ChatTask, ClassifyTask, CompletionTask, Result, queue_type
from nodeagent.tasks.events import Ended, Event, Failed, Finished, Follower, from_wire, node_lost
from nodeagent.tasks.openai.bodies import model_id
from nodeagent.tasks.runner import wrong_kind

log = logging.getLogger(__name__)
LOG_GRACE_S = 60.0  # an event log outlives its request's deadline by this much
GATEWAY_VERDICTS = ("node_lost", "timeout", "model_unavailable")  # ends the gateway decides: its task is cancelled
RATE_WINDOW_S = 60.0  # completions per model are counted over this window, for the backpressure estimate
CHECK_S = 2.0  # the wake log's trim, and a whole request's state asked of the broker, this often


def _delivered(answer: Event) -> bool:
    """Whether the request's answer holds all its task's end says: its result, or a refusal of the request itself
    (a task fault, a 4xx). A failure of the fleet (a node's: backend_error past its attempts) stays a dead letter for
    the operator's failures page."""
    from nodeagent.codes import code as code_of

    if isinstance(answer, Finished):
        error = answer.body.get("error") if isinstance(answer.body, dict) else None
        return not isinstance(error, dict) or code_of(str(error.get("code"))).fault == "task"
    return isinstance(answer, Failed) and answer.error.status < 500 and code_of(answer.error.code).fault == "task"


def _unrun(answer: Event) -> bool:
    """Whether the answer of the task a key named says the task ended without its work: cancelled (the 409 of
    ``_result_of``), or dead at its deadline (the broker frees the key of such a task: ``broker.base.frees_key``)."""
    if isinstance(answer, Failed):
        return answer.error.code == "task_cancelled"
    error = answer.body.get("error") if isinstance(answer, Finished) else None
    return isinstance(error, dict) and error.get("code") == "deadline_exceeded"


class LogReader:
    """One thread that reads the event logs this gateway waits on, and hands each event to its request's queue on
    the event loop. The gateway's own log is told how each of its whole requests ends (the envelope's
    ``notify``): one log read for all of them, however many wait. A streamed request has a log of its own (its
    pieces, then its end, in order). A Redis read blocks until an event comes (a new streamed request interrupts
    it, through the gateway's log); SQLite is polled."""

    def __init__(self, broker: Broker, name: str) -> None:
        self.broker, self.wake = broker, f"gateway-{name}"
        self._lock = threading.Lock()
        self._active: dict[str, tuple[str, asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # own logs
        # told through the gateway's log: its loop and queue, and since when it waits (monotonic)
        self._told: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, float]] = {}
        self._wake_cursor = "0"
        self._trimmed = "0"  # the wake log is trimmed to what was read, at most once a CHECK_S
        self._checked = time.monotonic()
        self._stop = threading.Event()
        self._blocks = bool(getattr(broker, "blocks", False))
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="gateway-logs", daemon=True)
        self._thread.start()

    def follow(self, task_id: str, own_log: bool) -> asyncio.Queue:
        """The queue the task's events come to: from its own log, or from the gateway's (how it ends)."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if own_log:
                self._active[task_id] = ("0", asyncio.get_running_loop(), queue)
            self._told[task_id] = (asyncio.get_running_loop(), queue, time.monotonic())
        return queue

    def refresh(self) -> None:
        """(Re)open the wake-up log for another day (the gateway's heartbeat does it)."""
        self.broker.open_log(self.wake, ttl_s=86400)

    def nudge(self) -> None:
        """Wake the reader (a request joined: its log is read from now on)."""
        if self._blocks:
            self.broker.publish(self.wake, {"kind": "wake"}, keep=100)

    def forget(self, task_id: str) -> None:
        with self._lock:
            self._active.pop(task_id, None)
            self._told.pop(task_id, None)

    def close(self) -> None:
        self._stop.set()
        try:
            self.nudge()
        except Exception as exc:  # noqa: BLE001  (a broker gone: the reader's own wait ends it within a poll)
            log.debug("the reader could not be woken to stop: %s", exc)
        self._thread.join(5)

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            with self._lock:
                cursors = {t: c for t, (c, _, _) in self._active.items()}
            cursors[self.wake] = self._wake_cursor
            try:
                got = self.broker.read_logs(cursors, wait_s=1.0 if self._blocks else 0.0)
                failures = 0
            except Exception as exc:  # noqa: BLE001  (a broker blip: the requests wait; their deadlines hold)
                failures += 1
                (log.debug if failures > 1 else log.warning)("reading the event logs failed: %s", exc)
                self._stop.wait(min(0.1 * 2 ** failures, 2.0))
                continue
            for task_id, cursor, event in got:
                with self._lock:
                    if task_id == self.wake:  # a whole request's end, or a wake-up
                        self._wake_cursor = cursor
                        told = self._told.get(event.get("task", ""))
                        target = (told[0], told[1]) if told is not None else None
                    else:
                        entry = self._active.get(task_id)
                        if entry is not None:
                            self._active[task_id] = (cursor, entry[1], entry[2])
                        target = (entry[1], entry[2]) if entry is not None else None
                if target is not None:
                    target[0].call_soon_threadsafe(target[1].put_nowait, event)
            if time.monotonic() - self._checked >= CHECK_S:
                self._checked = time.monotonic()
                self._housekeeping()
            if not self._blocks and not got:
                self._stop.wait(0.005)

    def _housekeeping(self) -> None:
        """Every CHECK_S: the wake log trimmed to what was read (it is told of every whole request's end, and would
        otherwise grow by one entry a request for as long as the gateway lives), and the whole requests that have
        waited a CHECK_S asked of the broker directly: one whose end is gone from the log (a reader far behind its
        cap, or a node of a version that tells no log) is ended from its task's state, never left to its deadline."""
        try:
            if self._wake_cursor != self._trimmed:
                self.broker.trim_log(self.wake, self._wake_cursor)
                self._trimmed = self._wake_cursor
            with self._lock:
                waited = [t for t, (_, _, since) in self._told.items()
                          if t not in self._active and time.monotonic() - since >= CHECK_S]
            for i in range(0, len(waited), 500):
                for task_id, state in self.broker.states(waited[i:i + 500]).items():
                    if state not in ("done", "dead", "cancelled"):
                        continue
                    with self._lock:
                        told = self._told.get(task_id)
                    if told is not None:
                        event = {"kind": "cancelled", "task": task_id} if state == "cancelled" else \
                            {"kind": "finished", "state": state, "task": task_id}
                        told[0].call_soon_threadsafe(told[1].put_nowait, event)
        except Exception as exc:  # noqa: BLE001  (a broker blip: tried again at the next check)
            log.debug("the event logs' housekeeping failed: %s", exc)


class Directory:
    """The fleet as the gateway sees it: the node records (read once a second at most), which are live, which
    models they serve, and how fast each model's tasks finish here."""

    def __init__(self, broker: Broker, lost_after_s: float, refresh_s: float = 1.0) -> None:
        self.broker, self.lost_after_s, self.refresh_s = broker, lost_after_s, refresh_s
        self._at = -math.inf
        self._nodes: list[NodeRecord] = []
        self._now = 0.0
        self._lock = threading.Lock()
        self._done: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._demand_at = -math.inf
        self._ready: dict[str, int] = {}

    def nodes(self) -> list[NodeRecord]:
        with self._lock:
            if time.monotonic() - self._at > self.refresh_s:
                self._nodes, self._now, self._at = self.broker.nodes(), self.broker.now(), time.monotonic()
            return self._nodes

    def live(self, record: NodeRecord) -> bool:
        """Serving (``NodeRecord.liveness``) at the broker's time of the last read."""
        self.nodes()
        return record.liveness(self._now, self.lost_after_s) == "serving"

    def serving(self, queue: str, model: str | None) -> tuple[list[NodeRecord], str | None]:
        """The live nodes that take tasks of ``queue`` for ``model`` (any such node for none), and the name they
        know the model by (a stream is bound to the exact name: a request's may differ in case)."""
        nodes, name = self.holding(model)
        return [r for r in nodes if not r.task_types or queue in r.task_types], name

    def preferred(self, queue: str) -> str | None:
        """For a task naming no model: a model of the kind its type prefers (``registry.preferred``: a reranker for
        rerank.v1, before the generators that also run it) that a live node taking ``queue`` holds, or None (any
        node that takes the queue then)."""
        kind = registry.preferred(queue_type(queue))
        if kind is None:
            return None
        return next((name for r in self.serving(queue, None)[0] for name in r.models if r.kind_of(name) is kind),
                    None)

    def classify_routes(self) -> list[str]:
        """One model of each kind that classifies, held by a live node that takes classify.v1, the embedding model's
        first: the routes a classify task naming no model is measured on (``classify_routes.py``)."""
        records = self.serving(classify_routes.CLASSIFY, None)[0]
        return classify_routes.routes_of((r.kind_of(name), name) for r in records for name in r.models)

    def holding(self, model: str | None) -> tuple[list[NodeRecord], str | None]:
        """The live nodes that hold ``model`` (every live node for none), whatever task types they take, and the
        name they know it by."""
        out, name = [], model
        for r in self.nodes():
            if r.role != "node" or not self.live(r):
                continue
            if model is None:
                out.append(r)
                continue
            exact = match(model, r.models)
            if exact is not None:
                out.append(r)
                name = exact
        return out, name

    def lost(self, node_id: str | None) -> bool:
        found = next((r for r in self.nodes() if r.id == node_id), None)
        return found is not None and (found.state in ("stopped", "draining") or not self.live(found))

    def following(self) -> list[NodeRecord]:
        return [r for r in self.nodes() if r.role == "node" and r.follow and self.live(r)]

    def finished(self, model: str | None) -> None:
        self._done[model or ""].append(time.monotonic())

    def rate(self, model: str | None) -> float | None:
        """The model's tasks finished per second here over the last minute; None until enough have."""
        done = self._done[model or ""]
        now = time.monotonic()
        while done and now - done[0] > RATE_WINDOW_S:
            done.popleft()
        if len(done) < 5:
            return None
        return len(done) / max(now - done[0], 1.0)

    def ready_depth(self, queue: str, model: str | None) -> int:
        """Tasks waiting to start on the model's queue (the broker's count, read once a second at most)."""
        with self._lock:
            if time.monotonic() - self._demand_at > self.refresh_s:
                self._ready = {f"{d.queue}@{d.model or ''}": d.ready for d in self.broker.demand()}
                self._demand_at = time.monotonic()
            return self._ready.get(f"{queue}@{model or ''}", 0)


class FleetExecutor:
    """A request through the fleet's queue (see the module's docstring)."""

    def __init__(self, broker: Broker, config: Any, name: str | None = None) -> None:
        self.broker, self.config = broker, config
        self.name = name or uuid.uuid4().hex[:12]
        self.reader = LogReader(broker, self.name)
        self.fleet = Directory(broker, lost_after(config.heartbeat_s))
        self.max_attempts = config.max_attempts
        self._unstarted: collections.Counter = collections.Counter()  # this gateway's requests not yet begun
        self.record: NodeRecord | None = None  # the gateway's own, once started
        self.routes = RouteChooser()  # a classify task naming no model: the route measured best, fleet-wide
        # the label sets' registered sets, to measure a task without examples on
        self.labelled = LabelledSets(broker, config.labelled_set_refresh_s)

    # -- the gateway's own life: registered, beating, stopped -----------------------------------------------
    def start(self, record: NodeRecord) -> None:
        """Register the gateway (`nodeagent status` lists it) and say what the broker's settings mean."""
        from nodeagent.fleet.worker import log_broker_advice

        self.record = record
        self.broker.register(record)
        log_broker_advice(self.broker)

    def beat(self) -> None:
        """The record, and the wake-up log the reader listens on, kept fresh (every heartbeat). (What expiry leaves
        past the retention is the gateway app's ``Purge``, on its own timer.)"""
        if self.record is not None:
            self.broker.heartbeat(self.record.id, {"state": "ready"})
        self.reader.refresh()

    # -- what the door asks --------------------------------------------------------------------------------
    async def models(self) -> list[tuple[str, dict[str, Any]]]:
        """Every model a live node serves (the nodes that hold it, their state and free slots), and the
        catalog's models when following nodes may be given them by the scheduler."""
        records = await asyncio.to_thread(self.fleet.nodes)
        rows: dict[str, dict[str, Any]] = {}
        for r in records:
            if r.role != "node" or not self.fleet.live(r):
                continue
            name = r.model or (r.models[0] if r.models else None)
            for entry in [m.get("model") for m in r.model_set] or [name]:
                if not entry:
                    continue
                row = rows.setdefault(model_id(entry), {"names": set(), "nodes": [], "placeable": False})
                row["names"] |= set(r.models)
                row["nodes"].append({"id": r.id, "state": r.state, "guard": r.guard,
                                     "free_slots": max(0, r.slots - r.in_flight)})
        if self.fleet.following():
            from nodeagent.store.catalog import load_catalog

            for ident in load_catalog():
                rows.setdefault(ident, {"names": {ident}, "nodes": [], "placeable": True})
        return [(k, {**v, "names": sorted(v["names"])}) for k, v in sorted(rows.items())]

    def not_found(self, model: str | None) -> HttpError:
        return HttpError(404, f"The model `{model}` does not exist in this fleet: no live node serves it and the "
                              "scheduler cannot place it (see /v1/models)", "invalid_request_error",
                         "model_not_found", param="model")

    def resolve(self, model: str | None) -> str:
        """Any name: routing is the queue's (a model no node serves is a 404 or a wait for its placement, when the
        request runs)."""
        return model or "nodeagent"

    async def ready(self) -> tuple[bool, dict[str, Any]]:
        try:
            records = await asyncio.to_thread(self.fleet.nodes)
        except Exception as exc:  # noqa: BLE001
            return False, {"broker": f"unreachable: {type(exc).__name__}", "nodes": 0}
        live = [r for r in records if r.role == "node" and self.fleet.live(r)]
        return bool(live), {"broker": "answers", "nodes": len(live), "gateway": self.name}

    # -- running a request ----------------------------------------------------------------------------------
    async def completion(self, call: Call) -> AsyncIterator[Event]:
        raw = {k: v for k, v in call.raw.items() if k not in ("stream", "stream_options")}
        task = (ChatTask if call.spec.kind == "chat" else CompletionTask)(request=raw)
        async for ev in self._run(task, call.spec.model, call.request, progress=call.spec.stream):
            yield ev

    async def task(self, task: Any, model: str | None = None) -> Result:
        """A typed task through the queue (bound to ``model`` where a request names one): its Result (an error
        Result when it failed). A classify task naming no model, in a fleet holding models of several kinds that
        classify, goes by the route measured best on its examples (``classify_routes.py``), each route's tasks
        bound to its model."""
        if model is None and isinstance(task, ClassifyTask):
            routes = await asyncio.to_thread(self.fleet.classify_routes)
            if len(routes) > 1:
                return await self._routed(task, routes)
        async for ev in self._run(task, model, None, progress=False, typed=True):
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, Finished):
                return Result.model_validate(ev.body)
        raise HttpError(500, "the task ended without a result", "server_error", "internal_error")

    async def _routed(self, task: ClassifyTask, routes: list[str]) -> Result:
        """``task`` by the route its examples measured best, or without them its label set's registered set (the
        embedding model's without either, said): the measurement's tasks through the queue, each its own."""
        loop = asyncio.get_running_loop()

        def run(sub: ClassifyTask, route: str) -> Result:
            return asyncio.run_coroutine_threadsafe(self.task(sub, route), loop).result()

        try:
            plan = await asyncio.to_thread(classify_routes.routed, task, routes, self.routes, run, self.labelled.lookup)
        except TaskFailed as exc:
            return Result(task_id=task.id, type=task.type, status="error", error=exc.info)
        return classify_routes.answered(task, routes, plan, [await self.task(t, r) for t, r in plan.runs])

    def _timeout(self, request: Any) -> float:
        said = request.headers.get("x-stainless-timeout") if request is not None else None
        try:
            return max(1.0, float(said)) if said else self.config.gateway_timeout_s
        except ValueError:
            return self.config.gateway_timeout_s

    async def _admit(self, queue: str, model: str | None, needed: str | None = None
                     ) -> tuple[str | None, float | None]:
        """The name to bind the task to, and None when it may be queued now or else the seconds to wait for a
        placement. Raises the 404, the 429 or the 503 it gets instead. ``needed``: the contract the task's fields
        need (a node of an older one would not take it)."""
        if model is None and registry.preferred(queue_type(queue)) is not None:  # (where the fleet holds one)
            model = await asyncio.to_thread(self.fleet.preferred, queue)
        serving, name = await asyncio.to_thread(self.fleet.serving, queue, model)
        if serving and not any(r.reads(needed) for r in serving):
            raise _too_old(queue, model, needed, serving)
        if not serving:
            holding, _ = await asyncio.to_thread(self.fleet.holding, model)
            if holding:  # the model is here, but no node takes this type of request
                raise _type_unavailable(queue, model, holding)
            if model is not None and self.fleet.following():
                return model, self.config.gateway_placement_wait_s
            raise self.not_found(model)
        model = name
        rate = self.fleet.rate(model)
        if rate:
            ahead = max(self._unstarted[model], await asyncio.to_thread(self.fleet.ready_depth, queue, model))
            wait_s = ahead / rate
            if wait_s > self.config.gateway_max_wait_s:
                retry = max(1, math.ceil(wait_s - self.config.gateway_max_wait_s))
                raise HttpError(429, f"the fleet could not start this request within "
                                     f"{self.config.gateway_max_wait_s:g} s: {ahead} waiting for {model or 'any model'}"
                                     f" at {rate:.1f}/s (about {wait_s:.0f} s)", "rate_limit_exceeded", "queue_full",
                                headers={"Retry-After": str(retry)})
        return model, None

    async def _run(self, task: Any, model: str | None, request: Any, progress: bool,
                   typed: bool = False) -> AsyncIterator[Event]:
        from nodeagent.node import oversized

        needed = Envelope.of(task).needs
        try:
            too_large = oversized(task, self.config.max_input_bytes)  # refused here, keeping nothing
            if too_large is not None:
                raise HttpError.of_task(TaskFailed("input_too_large", too_large, False))
            model, placement = await self._admit(task.type, model, needed)
        except HttpError as exc:
            yield Failed(exc)
            return
        timeout_s = self._timeout(request)
        now = await asyncio.to_thread(self.broker.now)
        envelope = Envelope.of(task, id=task.id, model=model, idempotency_key=getattr(task, "idempotency_key", None),
                               deadline=now + timeout_s, progress=progress, max_attempts=self.max_attempts,
                               created_at=now, notify=None if progress else self.reader.wake)
        events = self.reader.follow(task.id, own_log=progress)
        self._unstarted[model] += 1
        started = finished = False
        answered: Event | None = None  # what the request got of its own task
        try:
            queued_as = await asyncio.to_thread(self._enqueue, envelope, timeout_s)
            end = time.monotonic() + timeout_s
            while queued_as != task.id:  # an idempotency key used before: the first task's result is the answer
                answer = await self._result_of(queued_as, end)
                if _unrun(answer):
                    # ended unrun: by its own request's verdict (a gateway's cancel, its deadline), which freed the
                    # key (this request then runs under it), or by an operator, whose cancel keeps the key naming it
                    again = await asyncio.to_thread(self._enqueue, envelope, timeout_s)
                    if again != queued_as:
                        queued_as = again
                        continue
                finished = True
                yield answer
                return
            async for ev in self._follow(envelope, events, timeout_s, placement, typed):
                if not started and not isinstance(ev, Failed):
                    started = True
                    self._unstarted[model] -= 1
                # the task ended on its own; a gateway's own verdict (lost node, deadline, no placement) cancels it
                finished = finished or isinstance(ev, Finished) or (
                    isinstance(ev, Failed) and ev.error.code not in GATEWAY_VERDICTS)
                answered = ev if finished else answered
                yield ev
        finally:
            if not started:
                self._unstarted[model] -= 1
            self.reader.forget(task.id)
            if answered is not None and envelope.idempotency_key is None and _delivered(answered):
                try:  # the answer is the request's now; without a key nothing else points at the task
                    await asyncio.to_thread(self.broker.forget, task.id, self.config.answered_keep_s)
                except Exception as exc:  # noqa: BLE001  (it expires with the retention all the same)
                    log.debug("task %s: could not be dropped: %s", task.id, exc)
            if not finished:  # the client went away (or the stream ended early): its task is not run for nobody
                try:
                    # the gateway's own verdict frees the task's idempotency key with it: a retry with the key
                    # runs the work again instead of waiting on a task that can no longer finish
                    await asyncio.to_thread(self.broker.cancel, task.id, True)
                except Exception as exc:  # noqa: BLE001
                    log.warning("task %s: could not be cancelled: %s", task.id, exc)

    def _enqueue(self, envelope: Envelope, timeout_s: float) -> str:
        if envelope.progress:  # a log of its own, read from now on
            self.broker.open_log(envelope.id, timeout_s + LOG_GRACE_S)
        queued_as = self.broker.enqueue(envelope)
        if envelope.progress:
            self.reader.nudge()
        return queued_as

    async def _result_of(self, task_id: str, end: float) -> Event:
        """A task this request did not queue (its idempotency key's first): its Result, when it comes; at once a
        409 when it was cancelled (``_run`` then asks the key again: a gateway's own verdict freed it)."""
        delay = 0.02
        while time.monotonic() < end:
            result = await asyncio.to_thread(self.broker.result, task_id)
            if result is not None:
                return Finished(result.model_dump(mode="json"), tuple(result.notes),
                                where={"task": task_id, "attempts": result.attempts})
            state = (await asyncio.to_thread(self.broker.states, [task_id])).get(task_id)
            if state in ("cancelled", None):
                return Failed(HttpError(409, f"the task this idempotency key names ({task_id}) was "
                                             f"{'cancelled by an operator' if state else 'removed'}: send the "
                                             "request with a new key to run it", "invalid_request_error",
                                        "task_cancelled", param="idempotency_key"))
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        return Failed(HttpError(504, f"task {task_id} (this idempotency key's) did not finish in time",
                                "server_error", "timeout"))

    async def _follow(self, e: Envelope, events: asyncio.Queue, timeout_s: float, placement_s: float | None,
                      typed: bool) -> AsyncIterator[Event]:
        """The task's events as the request's (``Follower``), within its deadline, its placement's wait, and its
        node's life: see the module's docstring for failover."""
        end = time.monotonic() + timeout_s + 2.0
        start_by = time.monotonic() + placement_s if placement_s is not None else None
        quiet_s = max(2.0, 2 * self.config.heartbeat_s)
        f = Follower()
        while True:
            wait = end - time.monotonic()
            if start_by is not None and not f.begun:
                wait = min(wait, start_by - time.monotonic())
            try:
                data = await asyncio.wait_for(events.get(), timeout=max(0.01, min(wait, quiet_s)))
            except asyncio.TimeoutError:
                if time.monotonic() >= end:
                    yield Failed(node_lost(f.node, "no live node continued the answer within the request's "
                                                   f"deadline ({timeout_s:g} s)") if f.pieces else
                                 HttpError(504, f"no answer within {timeout_s:g} s (the request's deadline): task "
                                                f"{e.id} was cancelled", "server_error", "timeout"))
                    return
                if start_by is not None and not f.begun and time.monotonic() >= start_by:
                    yield Failed(HttpError(503, f"no node took the model `{e.model}` within {placement_s:g} s: the "
                                                "scheduler is placing it; ask again", "server_error",
                                           "model_unavailable", headers={"Retry-After": "30"}))
                    return
                continue  # a lost node's task is leased again: the next attempt continues the stream
            out = f.take(from_wire(data))
            if isinstance(out, Ended):
                if out.state == "cancelled":
                    yield Failed(HttpError(499, f"task {e.id} was cancelled", code="cancelled"))
                    return
                result = await asyncio.to_thread(self.broker.result, e.id)
                self.fleet.finished(e.model)
                if f.resumes and result is not None and not _continues(result, f.sent.get(0, "")):
                    yield Failed(node_lost(f.node, "the answer's end does not continue the text that was sent"))
                    return
                attempts = result.attempts if result is not None else out.attempt or 1
                yield self._outcome(result, e, f.node, attempts, typed, f.resumes)
                return
            if out is not None:
                yield out
                if isinstance(out, Failed):
                    return

    @staticmethod
    def _outcome(result: Result | None, e: Envelope, node: str | None, attempts: int, typed: bool,
                 resumes: int = 0) -> Event:
        where = {"task": e.id, "node": node, "attempts": attempts, **({"resumes": resumes} if resumes else {})}
        if result is None:
            return Failed(HttpError(500, f"task {e.id} ended without a result", "server_error", "internal_error"))
        if typed:
            return Finished(result.model_dump(mode="json"), tuple(result.notes), where=where)
        if result.status != "ok" or not isinstance(result.output, dict):
            err = result.error
            return Failed(HttpError.of_task(TaskFailed(err.code, err.message, err.retryable)) if err else
                          HttpError(500, "the task failed without an error", "server_error", "internal_error"))
        return Finished(result.output, tuple(result.notes), None, where)

    def close(self) -> None:
        self.broker.hurry()  # leaving: a broker outage is not waited out (one try each)
        self.reader.close()
        if self.record is not None:
            try:
                self.broker.heartbeat(self.record.id, {"state": "stopped"})
            except Exception as exc:  # noqa: BLE001  (a broker gone: the record ages out as lost)
                log.warning("the gateway's record could not be marked stopped: %s", exc)


def gateway_record(name: str, host: str, endpoint: str, heartbeat_s: float) -> NodeRecord:
    """A gateway's NodeRecord: it holds no model and runs no task, but is listed and its version counted."""
    from nodeagent import __version__
    from nodeagent.broker.base import CONTRACT

    return NodeRecord(id=name, hostname=host, agent_version=__version__, contract=CONTRACT, os="-", arch="-",
                      backend="gateway", role="gateway", state="ready", endpoint=endpoint, heartbeat_s=heartbeat_s)


def _type_unavailable(queue: str, model: str | None, holding: list[NodeRecord]) -> HttpError:
    """Live nodes hold the model, but none takes ``queue`` tasks: a 400 where the model is not of the kind (an
    embedding model asked to generate, a generator to embed); else a 503: their versions predate the type (say
    which, so the operator knows to upgrade one), or they were started without it (--types)."""
    what = f"`{model}`" if model else "any model"
    kinds = {r.kind_of(model) for r in holding} - {None} if model else set()
    if len(kinds) == 1 and not registry.runs(queue_type(queue), next(iter(kinds))):
        failed = wrong_kind(model, next(iter(kinds)), queue_type(queue))  # the model's kind cannot run the type
        return HttpError(400, failed.message, code=failed.code, param="model")
    if not any(r.runs(queue) for r in holding):
        versions = sorted({f"nodeagent {r.agent_version} (contract {r.contract})" for r in holding})
        message = (f"no live node can run {queue} requests: the nodes holding {what} run {', '.join(versions)}, "
                   f"which predates them; upgrade a node")
    else:
        message = (f"no live node holding {what} takes {queue} requests (their NODEAGENT_TYPES leave it out); start "
                   f"one with --types including {queue.split('.')[0]}")
    return HttpError(503, message, "server_error", "type_unavailable", headers={"Retry-After": "30"})


def _continues(result: Result, sent: str) -> bool:
    """Whether a resumed stream's Result holds, as its first choice's content, the text its stream sent (a stream
    that moved to another node must end as it went out, or not at all: a node that could not continue it exactly
    says so before its first piece, and this is the last check)."""
    if result.status != "ok" or not isinstance(result.output, dict) or not sent:
        return True
    choices = result.output.get("choices") or [{}]
    first = choices[0]
    content = (first.get("message") or {}).get("content") if "message" in first else first.get("text")
    return isinstance(content, str) and content.startswith(sent)


def _too_old(queue: str, model: str | None, needed: str | None, serving: list[NodeRecord]) -> HttpError:
    """503: live nodes take ``queue`` for the model, but the request sets a field a later contract added, and
    none of them reads it (the nodes are upgraded before the producers that use a newer field)."""
    versions = sorted({f"nodeagent {r.agent_version} (contract {r.contract})" for r in serving})
    reader = max(needed or ROUTED_SINCE, ROUTED_SINCE, key=contract_parts)
    return HttpError(503, f"no live node holding {f'`{model}`' if model else 'any model'} can run this {queue} "
                          f"request: it sets a field of contract {needed}, which nodes of contract {reader} or later "
                          f"read, and they run {', '.join(versions)}; upgrade a node", "server_error",
                     "type_unavailable", headers={"Retry-After": "30"})

