"""The OpenAI-compatible routes: /v1/models and /v1/chat/completions (streamed as server-sent events or not;
``response_format`` enforced by the same constrained decoder as extraction)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from nodeagent.errors import HttpError, TaskFailed
from nodeagent.server.openai_types import ChatRequest
from nodeagent.server.state import Served

log = logging.getLogger(__name__)


def router(served: Served) -> Any:
    from fastapi import APIRouter
    from fastapi.responses import StreamingResponse

    api = APIRouter()
    config, node, metrics = served.config, served.node, served.metrics

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.model_name, "object": "model",
                                            "created": int(metrics.started), "owned_by": "nodeagent"}]}

    @api.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> Any:
        max_tokens = body.max_completion_tokens or body.max_tokens or min(512, config.max_tokens)
        if max_tokens > config.max_tokens:
            raise HttpError(400, f"max_tokens {max_tokens} is over this server's limit of {config.max_tokens}",
                            code="max_tokens_too_large")
        if body.n not in (None, 1):
            raise HttpError(400, "only n=1 is supported", code="unsupported_n")
        try:
            schema = body.schema_for_output()
        except ValueError as exc:
            raise HttpError(400, str(exc), param="response_format") from None
        options = dict(max_tokens=max_tokens, temperature=body.temperature or 0.0,
                       top_p=body.top_p if body.top_p is not None else 1.0, seed=body.seed, json_schema=schema,
                       stop=tuple(body.stop_list()))
        messages = body.plain_messages()
        ident = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            return StreamingResponse(stream(ident, created, messages, options, body.include_usage()),
                                     media_type="text/event-stream")
        out = await served.in_thread(run_chat, messages, options)
        return {"id": ident, "object": "chat.completion", "created": created, "model": served.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "finish_reason": out.finish_reason, "logprobs": None}],
                "usage": usage(out)}

    def run_chat(messages: list[dict[str, str]], options: dict[str, Any], on_text: Any = None) -> Any:
        try:
            out = node.chat(messages, on_text=on_text, **options)
        except TaskFailed as exc:
            metrics.chat_error(exc.code)
            raise HttpError.of_task(exc) from None
        metrics.tokens(out.prompt_tokens, out.completion_tokens)
        return out

    async def stream(ident: str, created: int, messages: list[dict[str, str]], options: dict[str, Any],
                     include_usage: bool) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": served.model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            return f"data: {json.dumps(body)}\n\n".encode()

        def on_text(text: str) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, ("text", text))

        async def work() -> None:
            try:
                out = await served.in_thread(run_chat, messages, options, on_text)
                await pieces.put(("done", out))
            except HttpError as exc:
                await pieces.put(("error", exc))
            except Exception:  # noqa: BLE001  (the stream ends with an error event, whatever failed)
                log.exception("a streamed chat completion failed")
                await pieces.put(("error", HttpError(500, "internal error: see the node's log", "server_error",
                                                     "internal_error")))

        task = asyncio.create_task(work())
        yield chunk({"role": "assistant", "content": ""})
        while True:
            kind, value = await pieces.get()
            if kind == "text":
                yield chunk({"content": value})
            elif kind == "done":
                yield chunk({}, value.finish_reason)
                if include_usage:
                    body = {"id": ident, "object": "chat.completion.chunk", "created": created,
                            "model": served.model_name, "choices": [], "usage": usage(value)}
                    yield f"data: {json.dumps(body)}\n\n".encode()
                break
            else:
                yield f"data: {json.dumps(value.body())}\n\n".encode()
                break
        await task
        yield b"data: [DONE]\n\n"

    return api


def usage(out: Any) -> dict[str, int]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}
