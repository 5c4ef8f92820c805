"""The executor of `nodeagent serve`: a request runs on a node this process holds (its model loaded, or a model
set's member loaded for it), on as many of its slots as the request has choices, behind the gate that bounds how
many wait. It turns the completion engine's callbacks (``tasks/openai/engine.py``) into the event sequence of
``server/events.py``; a consumer that stops listening (the client went away) stops the decoding at its next
token."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from nodeagent.errors import HttpError, TaskFailed, UsageError
from nodeagent.model_names import match
from nodeagent.server.executors import Call
from nodeagent.server.served import ServerConfig
from nodeagent.tasks import registry
from nodeagent.tasks.contracts import ErrorInfo, Result
from nodeagent.tasks.events import Event, Failed
from nodeagent.tasks.openai.bodies import model_id

log = logging.getLogger(__name__)


def http_error(exc: BaseException | None, metrics: Any) -> HttpError:
    """A failure under a request as the HTTP error it is (a task's code has its declared status)."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, TaskFailed):
        metrics.chat_error(exc.code)
        return HttpError.of_task(exc)
    if isinstance(exc, UsageError):
        return HttpError(400, str(exc), code="invalid_value", param="n")
    log.error("a completion failed: %s", exc, exc_info=exc)
    return HttpError(500, "internal error: see the node's log", "server_error", "internal_error")


class Gate:
    """At most ``slots`` requests inside the model, at most ``queue_size`` waiting; the rest are refused."""

    def __init__(self, slots: int, queue_size: int, retry_after_s: int = 2) -> None:
        self.slots, self.queue_size, self.retry_after_s = slots, queue_size, retry_after_s
        self.inside = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(slots)

    async def __aenter__(self) -> "Gate":
        if self.inside >= self.slots and self.waiting >= self.queue_size:
            raise HttpError(429, f"busy: {self.inside} requests running and {self.waiting} waiting",
                            "rate_limit_exceeded", "queue_full", headers={"Retry-After": str(self.retry_after_s)})
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.inside += 1
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.inside -= 1
        self._sem.release()


class LocalExecutor:
    """A request on this process's node (or the member of its model set the request names), behind its gate."""

    def __init__(self, node: Any, config: ServerConfig, metrics: Any, gate: Gate, guard: Any = None,
                 worker: Any = None, models: Any = None) -> None:
        self.node, self.config, self.metrics, self.gate = node, config, metrics, gate
        self.guard, self.worker, self.model_set = guard, worker, models

    @functools.cached_property
    def model_id(self) -> str:
        """The model's id for clients: its catalog name, or its file's name without the extension (never a
        path of this machine)."""
        return model_id(str(self.node.model or self.node.plan.model))

    @functools.cached_property
    def names(self) -> set[str]:
        """Every name a request's ``model`` may give this node's model: its id, the spec it was started with,
        the file's name and stem, the catalog's name and sha256 of the file."""
        from nodeagent.fleet.registration import routing_names

        plan_file = Path(self.node.plan.model)
        return {self.model_id, plan_file.name, plan_file.stem, *routing_names(self.node)}

    def member(self, model: str | None, task_type: str | None = None) -> Any:
        """The model set's member a request names (the set's own lookup: for a request naming none, one whose kind
        runs ``task_type``), or None for a name it does not hold."""
        try:
            return self.model_set.member(model, task_type)
        except TaskFailed:
            return None

    async def models(self) -> list[tuple[str, dict[str, Any]]]:
        return self.listed()

    def listed(self) -> list[tuple[str, dict[str, Any]]]:
        """Every model this server answers for, with its state: (id, extra fields of /v1/models)."""
        if self.model_set is None:
            return [(self.model_id, {})]
        return [(model_id(state["model"]), {k: state[k] for k in ("loaded", "pinned", "slots",
                                                                          "ctx_per_slot")})
                for state in self.model_set.state()]

    def answers_to(self, model: str) -> bool:
        if self.model_set is not None:
            return self.member(model) is not None
        return match(model, self.names) is not None

    def resolve(self, model: str | None) -> str:
        """The id an answer to a request naming ``model`` carries: the set member's, or this node's model's (any
        name with --any-model-name); a name this node does not go by is the 404."""
        if not (model is None or self.config.any_model_name or self.answers_to(model)):
            raise self.not_found(model)
        member = self.member(model) if self.model_set is not None else None
        return self.model_name(member.node) if member is not None else self.model_id

    def model_name(self, node: Any) -> str:
        """The model's id as the answer names it: the member's, in a model set."""
        return model_id(str(node.model or node.plan.model)) if self.model_set is not None else self.model_id

    def not_found(self, model: str | None) -> HttpError:
        served = ", ".join(f"`{name}`" for name, _ in self.listed())
        hint = "" if self.model_set is not None else " (start it with --any-model-name to answer any name)"
        return HttpError(404, f"The model `{model}` does not exist on this node: it serves {served}{hint}",
                         "invalid_request_error", "model_not_found", param="model")

    @contextlib.asynccontextmanager
    async def use(self, model: str | None, keep_alive_s: float | None = None,
                  task_type: str | None = None) -> AsyncIterator[Any]:
        """The node that serves a request naming ``model`` (for one naming none, the first of a set whose kind runs
        ``task_type``), held loaded for the request; 404 for a model the set does not hold, 503 (retryable) when
        no room comes in time."""
        if self.model_set is None:
            yield self.node
            return
        m = self.member(model, task_type)
        if m is None:
            raise self.not_found(model)
        try:
            await asyncio.to_thread(self.model_set.acquire, m)
        except TaskFailed as exc:
            raise HttpError(503, str(exc), "server_error", exc.code, headers={"Retry-After": "5"}) from None
        try:
            yield m.node
        finally:
            self.model_set.release(m, keep_alive_s)

    async def in_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, stop=..., **kwargs)`` on a worker thread, once the gate lets the request into the model. A
        request given up (its coroutine cancelled: the client went away) while it waits at the gate never enters;
        one given up inside is told to stop (``stop`` answers ``cancelled`` from then on, asked between the task's
        steps) and keeps its place in the gate, and its thread, until it has: the next request finds the slot
        free, not held by work nobody waits for."""
        gone = threading.Event()

        def stop() -> ErrorInfo | None:
            return ErrorInfo(code="cancelled", message="the client went away", retryable=False) if gone.is_set() \
                else None

        async with self.gate:
            job = asyncio.ensure_future(asyncio.to_thread(fn, *args, stop=stop, **kwargs))
            try:
                return await asyncio.shield(job)
            except asyncio.CancelledError:
                gone.set()
                await _settled(job)
                raise

    async def ready(self) -> tuple[bool, dict[str, Any]]:
        s = self
        state = s.guard.state if s.guard is not None else "ok"
        worker = s.worker
        queue = None if worker is None else ("serving" if worker.serving else
                                             "stopped" if worker.stopped.is_set() else "broker unreachable")
        loaded = s.node.loaded or s.model_set is not None  # a model set loads its models on demand
        nodes = [m.node for m in s.model_set.members] if s.model_set is not None else [s.node]
        fault = next((f for f in (n.fault for n in nodes) if f), None)  # loaded again before its next task
        ok = loaded and fault is None and state == "ok" and queue in (None, "serving")
        facts = {"loaded": loaded, "model": s.model_id, "guard": state, "queue": queue}
        if fault is not None:
            facts["fault"] = fault
        if s.guard is not None:
            from nodeagent.server.health_metrics import readiness

            why = readiness(s.guard)  # paused for heat, battery or memory pressure, in words
            if why:
                facts["why"] = why
        return ok, facts

    async def task(self, task: Any, model: str | None = None) -> Result:
        """A typed task on this node (or the set's member ``model`` names), behind the gate; given up (the route's
        client went away), it stops at its next step (``in_thread``)."""
        if self.model_set is not None:
            return await self.in_thread(self.model_set.run, task, model=model)
        return await self.in_thread(self.node.run, task)

    async def completion(self, call: Call) -> AsyncIterator[Event]:
        """The request on this process's node: Prepared, its pieces, Finished (or Failed)."""
        from nodeagent.modelset import keep_alive_seconds

        try:  # Ollama's keep_alive: how long the request's model stays loaded after it (a model set's)
            keep = keep_alive_seconds(call.spec.keep_alive)
        except ValueError:
            yield Failed(HttpError(400, f"keep_alive {call.spec.keep_alive!r} is not a duration: give seconds, or "
                                        "30s, 5m, 1h", code="invalid_value", param="keep_alive"))
            return
        try:
            async with self.use(call.spec.model, keep, registry.get("chat").name) as node, self.gate:
                async for ev in self._run(node, call):
                    yield ev
        except HttpError as exc:  # the model could not be had in time, or the gate is full
            yield Failed(exc)

    async def _run(self, node: Any, call: Call) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()
        gone = threading.Event()  # the consumer stopped listening: decoding stops at its next token

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        def stop() -> ErrorInfo | None:
            return ErrorInfo(code="cancelled", message="the client went away", retryable=False) if gone.is_set() \
                else None

        job = asyncio.ensure_future(asyncio.to_thread(node.completion, call.spec, put, stop=stop))
        job.add_done_callback(lambda _: events.put_nowait(None))
        try:
            while True:
                item = await events.get()
                if item is None:
                    break
                yield item
            try:
                finished = job.result()
            except BaseException as exc:  # noqa: BLE001  (the request's failure, in OpenAI's shape)
                yield Failed(http_error(exc, self.metrics))
                return
            self.metrics.tokens(finished.body["usage"]["prompt_tokens"], finished.body["usage"]["completion_tokens"])
            yield finished
        finally:
            gone.set()
            try:
                await job
            except BaseException:  # noqa: BLE001  (reported already, or the client left)
                pass


async def _settled(job: asyncio.Future) -> None:
    """Wait for work told to stop until it has, through further cancels (its thread cannot be cancelled: the
    slot it holds is free only once it returns); its outcome is nobody's now."""
    while not job.done():
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            continue
        except BaseException:  # noqa: BLE001  (its failure: the client that asked is gone)
            return
    if not job.cancelled():
        job.exception()  # read, so that its failure is not reported as never retrieved
