"""The OpenAI-compatible routes: /v1/models, /v1/chat/completions and /v1/completions, answered whole or streamed
as server-sent events, the same for `serve` and the gateway: the door here (parse the body, check it against the
field table), an executor that runs it (``server/executors/``: ``local.py``, a node this process holds;
``queue.py``, the fleet's queue), and one rendering of its events (``server/events.py``).

Every field of a request is honoured, harmlessly ignored or refused with a 400 that names it
(``tasks/openai_api.py``), before anything runs or is queued. Everything that can be known before the first token
(the model's name, the prompt's length, the schema, the tools) is answered with a status code, also for a stream;
what fails later in a stream ends it with an error event.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from fastapi import Request  # routes resolve their annotations from this module's names

from nodeagent.errors import HttpError, validation_message
from nodeagent.server import events as ev
from nodeagent.server.executors import Call
from nodeagent.server.middleware import json_body
from nodeagent.server.served import Served
from nodeagent.tasks import completion as engine
from nodeagent.tasks.openai_api import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    ChatRequest,
    CompletionRequest,
    Refused,
    check_fields,
)

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

    def parse(self, raw: dict[str, Any], table: dict[str, Any], model: Any) -> Any:
        """The body checked against its field table and parsed (a 400 naming the field otherwise), its model
        one this door answers for (a 404 otherwise)."""
        try:
            check_fields(raw, table)
        except Refused as exc:
            raise HttpError(400, str(exc), code=exc.code, param=exc.param) from None
        from pydantic import ValidationError

        try:
            parsed = model.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise HttpError(400, validation_message(exc), code="invalid_value",
                            param=".".join(str(p) for p in first.get("loc", ())) or None) from None
        self.executor.resolve(parsed.model)  # the 404 for a name it does not answer to
        return parsed

    def cap(self, max_tokens: int | None, default: int, name: str = "max_tokens") -> int:
        value = default if max_tokens is None else max_tokens
        if value > self.config.max_tokens:
            raise HttpError(400, f"{name} {value} is over this server's limit of {self.config.max_tokens}",
                            code="max_tokens_too_large", param=name)
        return value

    def choices(self, n: int, what: str = "n") -> int:
        if n > self.config.max_n:
            raise HttpError(400, f"{what} {n} asks for more choices than this server gives one request: at most "
                                 f"{self.config.max_n} (NODEAGENT_MAX_N)", code="invalid_value", param=what)
        return n

    def chat_call(self, raw: dict[str, Any], request: Request, max_name: str = "max_tokens") -> Call:
        """A chat completion request, checked and ready to run (``max_name``: what the client calls the token
        budget, for its errors)."""
        body = self.parse(raw, CHAT_FIELDS, ChatRequest)
        # no max_tokens: the room the context leaves, up to the server's limit (prepare_chat fits it)
        max_tokens = self.cap(body.max_completion_tokens or body.max_tokens, self.config.max_tokens, max_name)
        try:
            top = body.top_k()
            schema = body.schema_for_output()
        except ValueError as exc:
            raise HttpError(400, str(exc), param="logprobs" if "logprobs" in str(exc) else "response_format") from None
        return Call("chat", body, raw, lambda runner: engine.prepare_request(runner, body, max_tokens, top, schema),
                    self.choices(body.n or 1), request)

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

    async def answer(self, call: Call, stream: bool, include_usage: bool, request: Request) -> Any:
        """The executor's events, whole as JSON or streamed in the chunk shape."""
        from fastapi.responses import JSONResponse, StreamingResponse

        if not stream:
            done = await self.whole(call, request)
            return JSONResponse(done.body, headers=ev.headers(done.notes, done))
        head, events = await self.streamed(call, request)
        chunks = ev.Chunks(call.kind, self.executor.resolve(call.body.model))

        async def body() -> Any:
            try:
                async for b in ev.stream(chunks, head, events, include_usage):
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

    @api.post("/v1/embeddings")
    async def embeddings() -> Any:
        raise HttpError(404, "embeddings are not this node's job: it serves chat, completions, extraction and "
                             "classification (see /v1/models)", "invalid_request_error", "not_found")

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        raw = await door.body_of(request)
        call = door.chat_call(raw, request)
        return await door.answer(call, bool(call.body.stream), call.body.include_usage(), request)

    @api.post("/v1/completions")
    async def completions(request: Request) -> Any:
        raw = await door.body_of(request)
        body = door.parse(raw, COMPLETION_FIELDS, CompletionRequest)
        max_tokens = door.cap(body.max_tokens, 16)
        n = body.n or 1
        best_of = body.best_of or n
        if best_of < n:
            raise HttpError(400, f"best_of ({best_of}) must be at least n ({n})", code="invalid_value",
                            param="best_of")
        if body.stream and best_of > n:
            raise HttpError(400, "best_of cannot be streamed", code="invalid_value", param="best_of")
        prompts = body.prompts()
        call = Call("text", body, raw, lambda runner: engine.prepare_text(
            runner, prompts, max_tokens, body.sampling(body.logprobs), n, bool(body.echo), best_of),
            door.choices(best_of, "n" if best_of == n else "best_of"), request)
        return await door.answer(call, bool(body.stream), body.include_usage(), request)

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
