"""The OpenAI-compatible routes: /v1/models, /v1/chat/completions and /v1/completions, answered whole or streamed
as server-sent events, the same for `serve` and the gateway: the door here (parse the body, check it against the
field table), an executor that runs it (``server/executors/``: ``local.py``, a node this process holds;
``fleet.py``, the fleet's queue), and one rendering of its events (``server/events.py``).

Every field of a request is honoured, harmlessly ignored or refused with a 400 that names it
(``tasks/openai/fields.py``), before anything runs or is queued. Everything that can be known before the first token
(the model's name, the prompt's length, the schema, the tools) is answered with a status code, also for a stream;
what fails later in a stream ends it with an error event.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from fastapi import Request  # routes resolve their annotations from this module's names

from nodeagent.errors import HttpError, TaskFailed, param_of, validation_message
from nodeagent.server import events as ev
from nodeagent.server.executors import Call
from nodeagent.server.middleware import json_body
from nodeagent.server.served import Served
from nodeagent.tasks.contracts import Result
from nodeagent.tasks.openai.fields import CHAT, COMPLETIONS, FieldTable
from nodeagent.tasks.openai.requests import ChatRequest, CompletionRequest
from nodeagent.tasks.openai.spec import CompletionSpec, Limits

log = logging.getLogger(__name__)


class Door:
    """What every completion route does at the door: the body read and checked against its field table, the
    model's name checked, the limits (max_tokens, choices) applied, and the executor's events answered whole or
    streamed. ``/v1/responses`` (``server/responses_routes.py``) goes through the same door as a chat request."""

    def __init__(self, served: Served) -> None:
        self.served, self.config, self.executor = served, served.config, served.executor

    @staticmethod
    async def body_of(request: Request) -> dict[str, Any]:
        await request.body()  # read (and parsed once, off the event loop) by the middleware
        raw = json_body(request)
        if not isinstance(raw, dict):
            raise HttpError(400, "the request body must be a JSON object", code="invalid_request")
        return raw

    def call(self, kind: str, raw: dict[str, Any], request: Request) -> Call:
        """A chat or text completion request checked against its field table, parsed, its model one this door
        answers for (a 404 otherwise), and its run (``CompletionSpec``) within this server's limits: a 400 naming
        the field for anything refused (``Refused`` is an HttpError)."""
        table, model = (CHAT, ChatRequest) if kind == "chat" else (COMPLETIONS, CompletionRequest)
        parsed = self.parse(raw, table, model)
        spec = CompletionSpec.of(kind, parsed, Limits(self.config.max_tokens, bounded=True, max_n=self.config.max_n))
        return Call(spec, raw, request)

    def parse(self, raw: dict[str, Any], table: FieldTable, model: Any) -> Any:
        """The body checked against its field table and parsed (Refused, or a 400 naming the field), its model one
        this door answers for (a 404 otherwise)."""
        table.check(raw)
        from pydantic import ValidationError

        try:
            parsed = model.model_validate(raw)
        except ValidationError as exc:
            raise HttpError(400, validation_message(exc), code="invalid_value", param=param_of(exc)) from None
        self.executor.resolve(parsed.model)  # the 404 for a name it does not answer to
        return parsed

    async def whole(self, call: Call, request: Request) -> ev.Finished:
        """The executor's answer, whole (its HTTP error raised as such)."""
        events = self.executor.completion(call)
        try:
            done = await until_gone(request, ev.whole(events))
        finally:
            await events.aclose()
        request.state.access = ev.access_fields(done)
        return done

    async def streamed(self, call: Call, request: Request) -> tuple[ev.Prepared | ev.Finished, AsyncIterator[Any]]:
        """The executor's first event (which settles the status: its HTTP error raised as such) and the rest."""
        events = self.executor.completion(call)
        try:
            head = await until_gone(request, ev.first(events))
        except BaseException:
            await events.aclose()
            raise
        return head, events

    async def answer(self, call: Call, request: Request) -> Any:
        """The executor's events, whole as JSON or streamed in the chunk shape."""
        from fastapi.responses import JSONResponse, StreamingResponse

        if not call.spec.stream:
            done = await self.whole(call, request)
            return JSONResponse(done.body, headers=ev.headers(done.notes, done))
        head, events = await self.streamed(call, request)
        chunks = ev.Chunks(call.spec.kind, self.executor.resolve(call.spec.model), call.spec.include_usage)

        async def body() -> Any:
            try:
                async for b in ev.stream(chunks, head, events):
                    yield b
            finally:  # the client went away mid-stream: the executor stops its work (its task is cancelled)
                await events.aclose()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers=ev.headers(head.notes, head if isinstance(head, ev.Finished) else None))


def router(served: Served, door: Door) -> Any:
    from fastapi import APIRouter

    api = APIRouter()
    executor = served.executor

    def model_entry(ident: str, extra: dict[str, Any]) -> dict[str, Any]:
        return {"id": ident, "object": "model", "created": int(served.metrics.started), "owned_by": "nodeagent",
                **extra}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        """Every model this door answers for, with its state (a node's set: loaded or not, slots; a gateway's
        fleet: the nodes that hold it, their state and free slots)."""
        return {"object": "list", "data": [model_entry(i, x) for i, x in await executor.models()]}

    @api.get("/v1/models/{model:path}")
    async def one_model(model: str) -> Any:
        for ident, extra in await executor.models():
            if ident == model or model in extra.get("names", ()):
                return model_entry(ident, extra)
        raise executor.not_found(model)

    async def ran(request: Request, task: Any, model: str | None) -> tuple[Result, str]:
        """A task of a door of its own (embeddings, rerank) on this node or through the queue: its ok Result, and
        the model the answer names (the one asked for, or in a set the member that answered); the 404 for a name
        it does not answer to, the task's error as its HTTP error."""
        from nodeagent.tasks.openai.bodies import model_id

        named = executor.resolve(model)
        result = await until_gone(request, executor.task(task, model))
        served.metrics.task(result)
        request.state.access = {"prompt_tokens": result.tokens.prompt}
        if result.error is not None:
            raise HttpError.of_task(TaskFailed(result.error.code, result.error.message, result.error.retryable))
        return result, named if model else model_id(result.model or named)

    @api.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        """Vectors for texts in OpenAI's shape (floats, or base64 of float32), from an embedding model: run as an
        embed.v1 task, on this node or through the fleet's queue."""
        from nodeagent.tasks.openai.embeddings import embed_task, embeddings_body

        body, task = embed_task(await door.body_of(request))  # Refused: a 400 naming the field
        return embeddings_body(*await ran(request, task, body.model))

    @api.post("/v1/rerank")
    async def rerank(request: Request) -> Any:
        """Documents scored against a query, most relevant first, in llama-server's shape (Jina's and Cohere's
        clients read it): run as a rerank.v1 task on a reranker or a model that generates, on this node or through
        the fleet's queue."""
        from nodeagent.tasks.openai.rerank import rerank_body, rerank_task

        body, task = rerank_task(await door.body_of(request))  # Refused: a 400 naming the field
        return rerank_body(*await ran(request, task, body.model), body, task)

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await door.answer(door.call("chat", await door.body_of(request), request), request)

    @api.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await door.answer(door.call("text", await door.body_of(request), request), request)

    return api


async def until_gone(request: Request, work: Any) -> Any:
    """``work``, unless the client goes away first (then the request ends there: its work is given up)."""
    import asyncio

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise HttpError(499, "the client went away", code="cancelled")
    finally:
        watch.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away: once the body is read, the only message the connection can still
    bring is that (nothing is polled: a waiting request costs nothing)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
