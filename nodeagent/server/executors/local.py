"""The executor of `nodeagent serve`: a request runs on a node this process holds (its model loaded, or a model
set's member loaded for it), on as many of its slots as the request has choices, behind the gate that bounds how
many wait. It turns the completion engine's callbacks (``tasks/completion.py``) into the event sequence of
``server/events.py``; a consumer that stops listening (the client went away) stops the decoding at its next
token."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterator

from nodeagent.errors import HttpError, TaskFailed, UsageError
from nodeagent.server.executors import Call
from nodeagent.server.served import Served
from nodeagent.tasks import completion as engine
from nodeagent.tasks.contracts import ErrorInfo, Result
from nodeagent.tasks.events import Event, Failed, Finished, Piece, Prepared

log = logging.getLogger(__name__)


def http_error(exc: BaseException | None, served: Served) -> HttpError:
    """A failure under a request as the HTTP error it is (a task's code has its declared status)."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, TaskFailed):
        served.metrics.chat_error(exc.code)
        return HttpError.of_task(exc)
    if isinstance(exc, UsageError):
        return HttpError(400, str(exc), code="invalid_value", param="n")
    log.error("a completion failed: %s", exc, exc_info=exc)
    return HttpError(500, "internal error: see the node's log", "server_error", "internal_error")


class LocalExecutor:
    def __init__(self, served: Served) -> None:
        self.served = served

    async def models(self) -> list[tuple[str, dict[str, Any]]]:
        return self.served.listed()

    def resolve(self, model: str | None) -> str:
        """The id an answer to a request naming ``model`` carries: the set member's, or this node's model's (any
        name with --any-model-name); a name this node does not go by is the 404."""
        served = self.served
        if not (model is None or served.config.any_model_name or served.answers_to(model)):
            raise self.not_found(model)
        member = served._member(model) if served.models is not None else None
        return model_name(served, member.node) if member is not None else served.model_id

    def not_found(self, model: str | None) -> HttpError:
        return HttpError(404, f"The model `{model}` does not exist on this node: it serves `{self.served.model_id}` "
                              f"(start it with --any-model-name to answer any name)", "invalid_request_error",
                         "model_not_found", param="model")

    async def ready(self) -> tuple[bool, dict[str, Any]]:
        s = self.served
        state = s.guard.state if s.guard is not None else "ok"
        worker = s.worker
        queue = None if worker is None else ("serving" if worker.serving else
                                             "stopped" if worker.stopped.is_set() else "broker unreachable")
        loaded = s.node.loaded or s.models is not None  # a model set loads its models on demand
        ok = loaded and state == "ok" and queue in (None, "serving")
        facts = {"loaded": loaded, "model": s.model_id, "guard": state, "queue": queue}
        if s.guard is not None:
            from nodeagent.server.health_metrics import readiness

            why = readiness(s.guard)  # paused for heat, battery or memory pressure, in words
            if why:
                facts["why"] = why
        return ok, facts

    async def task(self, task: Any) -> Result:
        return await self.served.in_thread((self.served.models or self.served.node).run, task)

    async def completion(self, call: Call) -> AsyncIterator[Event]:
        """The request on this process's node: Prepared, its pieces, Finished (or Failed)."""
        from nodeagent.modelset import keep_alive_seconds

        served = self.served
        try:  # Ollama's keep_alive: how long the request's model stays loaded after it (a model set's)
            keep = keep_alive_seconds(call.body.keep_alive)
        except ValueError:
            yield Failed(HttpError(400, f"keep_alive {call.body.keep_alive!r} is not a duration: give seconds, or "
                                        "30s, 5m, 1h", code="invalid_value", param="keep_alive"))
            return
        try:
            async with served.use(call.body.model, keep) as node, served.gate:
                async for ev in self._run(node, call):
                    yield ev
        except HttpError as exc:  # the model could not be had in time, or the gate is full
            yield Failed(exc)

    async def _run(self, node: Any, call: Call) -> AsyncIterator[Event]:
        served = self.served
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()
        gone = threading.Event()  # the consumer stopped listening: decoding stops at its next token

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        def on_prepared(value: Any) -> None:
            if not isinstance(value, BaseException):
                put(Prepared.of(value))

        def stop() -> ErrorInfo | None:
            return ErrorInfo(code="cancelled", message="the client went away", retryable=False) if gone.is_set() \
                else None

        def work() -> Any:
            prepared, choices = node.completion(call.prepare, call.choices,
                                                lambda i, what, v: put(Piece(i, what, v)), on_prepared, stop=stop)
            session = node.runner().session
            body = (engine.chat_body if call.kind == "chat" else engine.text_body)(model_name(served, node),
                                                                                   prepared, choices, session)
            kind = engine.logprob_kind(choices) if prepared.sampling.top_logprobs is not None else None
            return Finished(body, tuple(prepared.notes), kind)

        job = asyncio.ensure_future(asyncio.to_thread(work))
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
                yield Failed(http_error(exc, served))
                return
            served.metrics.tokens(finished.body["usage"]["prompt_tokens"], finished.body["usage"]["completion_tokens"])
            yield finished
        finally:
            gone.set()
            try:
                await job
            except BaseException:  # noqa: BLE001  (reported already, or the client left)
                pass


def model_name(served: Served, node: Any) -> str:
    """The model's id as the answer names it: the member's, in a model set."""
    return engine.model_id(str(node.model or node.plan.model)) if served.models is not None else served.model_id
