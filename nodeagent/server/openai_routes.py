"""The OpenAI-compatible routes: /v1/models, /v1/chat/completions and /v1/completions, streamed as
server-sent events or not, on the completion engine (``tasks/completion.py``).

Every field of a request is honoured, harmlessly ignored or refused with a 400 that names it
(``tasks/openai_api.py``). Everything that can be known before the first token (the fields, the model's name,
the prompt's length, the schema, the tools) is answered with a status code, also for a stream; what fails
later in a stream ends it with an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request  # routes resolve their annotations from this module's names

from nodeagent.errors import HttpError, TaskFailed, UsageError, validation_message
from nodeagent.server.state import Served
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


def router(served: Served) -> Any:
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, StreamingResponse

    api = APIRouter()
    config = served.config

    def model_entry(ident: str, extra: dict[str, Any]) -> dict[str, Any]:
        return {"id": ident, "object": "model", "created": int(served.metrics.started), "owned_by": "nodeagent",
                **extra}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        """Every model this node serves (with several: loaded or not, pinned, slots, context per slot)."""
        return {"object": "list", "data": [model_entry(i, x) for i, x in served.listed()]}

    @api.get("/v1/models/{model:path}")
    async def one_model(model: str) -> Any:
        if not served.answers_to(model):
            raise not_found(model)
        listed = served.listed()
        if served.models is not None:
            held = served._member(model)
            listed = [x for x, m in zip(listed, served.models.members) if m is held]
        return model_entry(*listed[0])

    @api.post("/v1/embeddings")
    async def embeddings() -> Any:
        raise HttpError(404, "embeddings are not this node's job: it serves chat, completions, extraction and "
                             "classification (see /v1/models)", "invalid_request_error", "not_found")

    def not_found(model: str | None) -> HttpError:
        return HttpError(404, f"The model `{model}` does not exist on this node: it serves `{served.model_id}` "
                              f"(start it with --any-model-name to answer any name)", "invalid_request_error",
                         "model_not_found", param="model")

    async def body_of(request: Request, table: dict[str, Any], model: Any) -> Any:
        raw = await request.json()
        if not isinstance(raw, dict):
            raise HttpError(400, "the request body must be a JSON object", code="invalid_request")
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
        if parsed.model is not None and not config.any_model_name and not served.answers_to(parsed.model):
            raise not_found(parsed.model)
        return parsed

    def cap(max_tokens: int | None, default: int) -> int:
        value = default if max_tokens is None else max_tokens
        if value > config.max_tokens:
            raise HttpError(400, f"max_tokens {value} is over this server's limit of {config.max_tokens}",
                            code="max_tokens_too_large", param="max_tokens")
        return value

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body: ChatRequest = await body_of(request, CHAT_FIELDS, ChatRequest)
        # no max_tokens: the room the context leaves, up to the server's limit (prepare_chat fits it)
        max_tokens = cap(body.max_completion_tokens or body.max_tokens, config.max_tokens)
        try:
            top = body.top_k()
            schema = body.schema_for_output()
        except ValueError as exc:
            raise HttpError(400, str(exc), param="logprobs" if "logprobs" in str(exc) else "response_format") from None

        def prepare(runner: Any) -> Any:
            return engine.prepare_request(runner, body, max_tokens, top, schema)

        return await complete("chat", prepare, body.n or 1, body.stream, body.include_usage(), request, body)

    @api.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body: CompletionRequest = await body_of(request, COMPLETION_FIELDS, CompletionRequest)
        max_tokens = cap(body.max_tokens, 16)
        n = body.n or 1
        best_of = body.best_of or n
        if best_of < n:
            raise HttpError(400, f"best_of ({best_of}) must be at least n ({n})", code="invalid_value",
                            param="best_of")
        if body.stream and best_of > n:
            raise HttpError(400, "best_of cannot be streamed", code="invalid_value", param="best_of")
        prompts = body.prompts()

        def prepare(runner: Any) -> Any:
            return engine.prepare_text(runner, prompts, max_tokens, body.sampling(body.logprobs), n,
                                       bool(body.echo), best_of)

        return await complete("text", prepare, best_of, body.stream, body.include_usage(), request, body)

    async def complete(kind: str, prepare: Callable[[Any], Any], slots: int, stream: bool | None,
                       include_usage: bool, request: Request, body: Any) -> Any:
        from nodeagent.modelset import keep_alive_seconds

        if slots > config.max_n:
            what = "n" if kind == "chat" or body.best_of is None else "best_of"
            raise HttpError(400, f"{what} {slots} asks for more choices than this server gives one request: at most "
                                 f"{config.max_n} (NODEAGENT_MAX_N)", code="invalid_value", param=what)
        try:  # Ollama's keep_alive: how long the request's model stays loaded after it (a model set's)
            keep = keep_alive_seconds(body.keep_alive)
        except ValueError:
            raise HttpError(400, f"keep_alive {body.keep_alive!r} is not a duration: give seconds, or 30s, 5m, 1h",
                            code="invalid_value", param="keep_alive") from None
        held = served.use(body.model, keep)  # the request's model's node, loaded and held until the answer ends
        node = await held.__aenter__()
        released = False

        async def let_go() -> None:  # once, whichever way the answer ends
            nonlocal released
            if not released:
                released = True
                await held.__aexit__(None, None, None)

        try:
            return await answer(node, kind, prepare, slots, stream, include_usage, request, let_go)
        except BaseException:
            await let_go()
            raise

    async def answer(node: Any, kind: str, prepare: Callable[[Any], Any], slots: int, stream: bool | None,
                     include_usage: bool, request: Request, let_go: Callable[[], Any]) -> Any:
        """The completion on ``node``; the node is let go when the answer (or its stream) ends."""
        model_name = engine.model_id(str(node.model or node.plan.model)) if served.models is not None \
            else served.model_id
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()
        prepared_at: asyncio.Future[Any] = loop.create_future()

        def on_prepared(value: Any) -> None:  # the request is known good (or bad) before the first token
            loop.call_soon_threadsafe(lambda: prepared_at.done() or prepared_at.set_result(value))

        def emit(index: int, what: str, value: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("piece", (index, what, value)))

        def work() -> Any:
            try:
                return node.completion(prepare, slots, emit if stream else None, on_prepared)
            except UsageError as exc:  # more choices than slots
                on_prepared(exc)
                raise

        gate = served.gate
        await gate.__aenter__()
        job = asyncio.ensure_future(asyncio.to_thread(work))
        try:
            ready = await asyncio.wait({prepared_at, job}, return_when=asyncio.FIRST_COMPLETED)
            first = prepared_at.result() if prepared_at in ready[0] else None
            if isinstance(first, BaseException) or (first is None and job.exception() is not None):
                raise _http(first if isinstance(first, BaseException) else job.exception(), served) from None
        except BaseException:
            await _finish(job)
            await gate.__aexit__(None, None, None)
            raise
        prepared = first
        headers = {"x-nodeagent-notes": json.dumps(prepared.notes)} if prepared.notes else {}
        if not stream:
            try:
                result = await job
            except BaseException as exc:  # noqa: BLE001
                raise _http(exc, served) from None
            finally:
                await gate.__aexit__(None, None, None)
                await let_go()
            prepared, choices = result
            if prepared.notes:  # read-back may add to them (repeated calls left out)
                headers["x-nodeagent-notes"] = json.dumps(prepared.notes)
            body = (engine.chat_body if kind == "chat" else engine.text_body)(model_name, prepared, choices,
                                                                               runner_session(node))
            if prepared.sampling.top_logprobs is not None:
                headers["x-nodeagent-logprobs"] = engine.logprob_kind(choices)
            served.metrics.tokens(body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
            request.state.access = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
            return JSONResponse(body, headers=headers)

        async def sse() -> AsyncIterator[bytes]:
            ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            created = int(time.time())
            calls_seen: dict[int, int] = {}
            done = asyncio.ensure_future(job)
            done.add_done_callback(lambda _: events.put_nowait(("done", None)))
            try:
                if kind == "chat":
                    for i in range(prepared.n):
                        yield _sse(_chunk(ident, created, model_name, i, {"role": "assistant", "content": ""}))
                elif prepared.echo:  # the prompt first, as the answer's text starts with it
                    for i in range(len(prepared.prompts) * prepared.n):
                        yield _sse({"id": ident, "object": "text_completion", "created": created,
                                    "model": model_name, "choices": [{
                                        "index": i, "text": prepared.prompt_texts[i // prepared.n],
                                        "finish_reason": None, "logprobs": None}]})
                while True:
                    what, value = await events.get()
                    if what == "done":
                        break
                    index, piece, data = value
                    if kind == "text":
                        yield _sse({"id": ident, "object": "text_completion", "created": created,
                                    "model": model_name, "choices": [{"index": index, "text": data,
                                                                           "finish_reason": None, "logprobs": None}]})
                    elif piece == "content":
                        yield _sse(_chunk(ident, created, model_name, index, {"content": data}))
                    elif piece == "tool_calls":
                        for call in data:
                            k = calls_seen.get(index, 0)
                            calls_seen[index] = k + 1
                            yield _sse(_chunk(ident, created, model_name, index, {"tool_calls": [
                                {"index": k, "id": call["id"], "type": "function",
                                 "function": {"name": call["function"]["name"], "arguments": ""}}]}))
                            yield _sse(_chunk(ident, created, model_name, index, {"tool_calls": [
                                {"index": k, "function": {"arguments": call["function"]["arguments"]}}]}))
                try:
                    prepared_done, choices = done.result()
                except BaseException as exc:  # noqa: BLE001  (the stream ends with an error event)
                    yield _sse(_http(exc, served).body())
                    yield b"data: [DONE]\n\n"
                    return
                for c in choices:
                    finish = engine.finish_reason(c)
                    if kind == "chat":
                        lp = None
                        if prepared_done.sampling.top_logprobs is not None:
                            lp = {"content": [engine.token_entry(runner_session(node), x) for x in c.logprobs],
                                  "refusal": None}
                        yield _sse(_chunk(ident, created, model_name, c.index, {}, finish, lp))
                    else:
                        lp = engine.legacy_logprobs(runner_session(node), prepared_done, c, c.index // prepared_done.n) \
                            if prepared_done.sampling.top_logprobs is not None else None
                        yield _sse({"id": ident, "object": "text_completion", "created": created,
                                    "model": model_name, "choices": [{"index": c.index, "text": "",
                                                                           "finish_reason": finish, "logprobs": lp}]})
                u = engine.usage(prepared_done, choices)
                served.metrics.tokens(u["prompt_tokens"], u["completion_tokens"])
                if include_usage:
                    yield _sse({"id": ident, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                                "created": created, "model": model_name, "choices": [], "usage": u})
                yield b"data: [DONE]\n\n"
            finally:
                await _finish(job)
                await gate.__aexit__(None, None, None)
                await let_go()

        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)

    return api


def runner_session(node: Any) -> Any:
    return node.runner().session


def _chunk(ident: str, created: int, model: str, index: int, delta: dict[str, Any], finish: str | None = None,
           logprobs: Any = None) -> dict[str, Any]:
    return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}


def _sse(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


async def _finish(job: Any) -> None:
    try:
        await job
    except BaseException:  # noqa: BLE001  (reported already)
        pass


def _http(exc: BaseException | None, served: Served) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, TaskFailed):
        served.metrics.chat_error(exc.code)
        return HttpError.of_task(exc)
    if isinstance(exc, UsageError):
        return HttpError(400, str(exc), code="invalid_value", param="n")
    log.error("a completion failed: %s", exc, exc_info=exc)
    return HttpError(500, "internal error: see the node's log", "server_error", "internal_error")
