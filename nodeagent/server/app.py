"""The HTTP API: OpenAI-compatible chat completions and models, the typed task routes, probes and metrics.

Built on Starlette through FastAPI (request and response models from the pydantic contracts, so
``/openapi.json`` documents them), served by uvicorn. Up to the plan's slots requests run at once, each on a
slot of the node (decoded together in one batch); the rest wait in a bounded queue and past it get 429 with
Retry-After.
Every error is JSON in OpenAI's shape; a traceback never reaches a client.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from nodeagent import payload
from nodeagent.values import Frozen
from nodeagent.node import Node
from nodeagent.server.metrics import Metrics
from nodeagent.server.openai_types import ChatRequest
from nodeagent.tasks.codes import code
from nodeagent.tasks.contracts import ClassifyTask, ErrorInfo, ExtractTask, Result

log = logging.getLogger(__name__)
OPEN_PATHS = ("/healthz", "/readyz")


class ServerConfig(Frozen):
    host: str = "127.0.0.1"
    port: int = 8400
    token: str | None = None
    insecure: bool = False
    max_body_bytes: int = 4 << 20
    max_tokens: int = 4096
    queue_size: int = 16
    retry_after_s: int = 2
    client_timeout_s: float = 20.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers or {}
        self.param = param


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def task_error(info: ErrorInfo) -> "ApiError":
    """A task's error as an HTTP error: the status its code is declared with (tasks/codes.py)."""
    status = code(info.code).http_status
    return ApiError(status, info.message, "invalid_request_error" if status < 500 else "server_error", info.code)


class Gate:
    """At most ``slots`` requests inside the model, at most ``queue_size`` waiting; the rest are refused."""

    def __init__(self, slots: int, queue_size: int, retry_after_s: int = 2) -> None:
        self.slots, self.queue_size, self.retry_after_s = slots, queue_size, retry_after_s
        self.inside = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(slots)

    async def __aenter__(self) -> "Gate":
        if self.inside >= self.slots and self.waiting >= self.queue_size:
            raise ApiError(429, f"busy: {self.inside} requests running and {self.waiting} waiting",
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


def create_app(node: Node, config: ServerConfig, metrics: Metrics | None = None, guard: Any = None,
               broker: Any = None, worker: Any = None) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    metrics = metrics or Metrics(node, guard=guard, broker=broker)
    # the plan's slots run at once inside the model (Node.slot() hands each request a slot of its own)
    gate = Gate(max(1, node.plan.settings.slots), config.queue_size, config.retry_after_s)
    app = FastAPI(title="nodeagent", version=__import__("nodeagent").__version__,
                  description="A local-inference node: OpenAI-compatible chat, typed extraction and classification.")
    app.state.gate, app.state.metrics = gate, metrics
    model_name = node.model or node.plan.model

    def reply(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Any:
        return reply(exc.status, error_body(exc.message, exc.kind, exc.code, exc.param), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Any:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return reply(400, error_body(f"{first['msg']}" + (f" ({where})" if where else ""), "invalid_request_error",
                                     "invalid_request", where or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return reply(exc.status_code, error_body(str(exc.detail), kind, str(exc.status_code)),
                     dict(exc.headers or {}))  # a 405 says which methods are allowed

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> Any:  # the traceback goes to the log, not the client
        log.exception("%s %s failed", request.method, request.url.path)
        return reply(500, error_body("internal error: see the node's log", "server_error", "internal_error"))

    @app.middleware("http")
    async def guard_requests(request: Request, call_next: Any) -> Any:
        started = time.perf_counter()
        path = request.url.path
        route = path if path in ROUTES else "other"
        try:
            if config.token and path not in OPEN_PATHS:
                given = request.headers.get("authorization", "")
                expected = f"Bearer {config.token}"
                if not hmac.compare_digest(given.encode(), expected.encode()):
                    raise ApiError(401, "a valid bearer token is required", "authentication_error", "invalid_api_key")
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
                raise ApiError(413, f"the request body is over {config.max_body_bytes} bytes",
                               "invalid_request_error", "body_too_large")
            if request.method in ("POST", "PUT"):
                body = await _read_body(request, config.max_body_bytes, config.client_timeout_s)
                if body and "json" in request.headers.get("content-type", "application/json"):
                    try:  # nesting and lone surrogates, before any route or library relies on the body
                        payload.loads(body)
                    except payload.PayloadError as exc:
                        if "not JSON" not in str(exc):  # FastAPI answers malformed JSON itself (400)
                            raise ApiError(400, f"the request body cannot be used: {exc}", "invalid_request_error",
                                           "invalid_body") from None
            response = await call_next(request)
        except ApiError as exc:
            response = reply(exc.status, error_body(exc.message, exc.kind, exc.code), exc.headers)
        metrics.request(route, response.status_code, time.perf_counter() - started)
        return response

    async def in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
        async with gate:
            return await asyncio.to_thread(fn, *args, **kwargs)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Any:
        """The model is loaded, the guard is not tripped, and the queue's worker loop (with --broker) serves."""
        state = guard.state if guard is not None else "ok"
        queue = None if worker is None else ("serving" if worker.serving else
                                             "stopped" if worker.stopped.is_set() else "broker unreachable")
        if not node.loaded or state != "ok" or queue not in (None, "serving"):
            return reply(503, {"status": "not ready", "loaded": node.loaded, "guard": state, "queue": queue})
        return {"status": "ready", "model": model_name, "guard": state, "queue": queue}

    @app.get("/metrics")
    async def prometheus() -> Any:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(metrics.started),
                                            "owned_by": "nodeagent"}]}

    @app.post("/v1/extract", response_model=Result)
    async def extract(task: ExtractTask) -> Any:
        """Run an extract.v1 task; the Result (an error Result when the task failed)."""
        return await typed(task)

    @app.post("/v1/classify", response_model=Result)
    async def classify(task: ClassifyTask) -> Any:
        """Run a classify.v1 task; the Result (an error Result when the task failed)."""
        return await typed(task)

    async def typed(task: Any) -> Any:
        result: Result = await in_thread(node.run, task)
        metrics.task(result)
        return JSONResponse(json.loads(result.model_dump_json()))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> Any:
        max_tokens = body.max_completion_tokens or body.max_tokens or min(512, config.max_tokens)
        if max_tokens > config.max_tokens:
            raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit of {config.max_tokens}",
                           code="max_tokens_too_large")
        if body.n not in (None, 1):
            raise ApiError(400, "only n=1 is supported", code="unsupported_n")
        try:
            schema = body.schema_for_output()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="response_format") from None
        options = dict(max_tokens=max_tokens, temperature=body.temperature or 0.0,
                       top_p=body.top_p if body.top_p is not None else 1.0, seed=body.seed, json_schema=schema,
                       stop=tuple(body.stop_list()))
        messages = body.plain_messages()
        ident = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            return StreamingResponse(stream(ident, created, messages, options, body.include_usage()),
                                     media_type="text/event-stream")
        out = await in_thread(run_chat, messages, options)
        return {"id": ident, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "finish_reason": out.finish_reason, "logprobs": None}],
                "usage": usage(out)}

    def run_chat(messages: list[dict[str, str]], options: dict[str, Any], on_text: Any = None) -> Any:
        from nodeagent.tasks.runner import TaskFailed

        try:
            out = node.chat(messages, on_text=on_text, **options)
        except TaskFailed as exc:
            metrics.chat_error(exc.info.code)
            raise task_error(exc.info) from None
        metrics.tokens(out.prompt_tokens, out.completion_tokens)
        return out

    def usage(out: Any) -> dict[str, int]:
        return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens}

    async def stream(ident: str, created: int, messages: list[dict[str, str]], options: dict[str, Any],
                     include_usage: bool) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()

        def chunk(delta: dict[str, Any], finish: str | None = None, extra: dict | None = None) -> bytes:
            body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                    **(extra or {})}
            return f"data: {json.dumps(body)}\n\n".encode()

        def on_text(text: str) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, ("text", text))

        async def work() -> None:
            try:
                out = await in_thread(run_chat, messages, options, on_text)
                await pieces.put(("done", out))
            except ApiError as exc:
                await pieces.put(("error", exc))
            except Exception:  # noqa: BLE001  (the stream ends with an error event, whatever failed)
                log.exception("a streamed chat completion failed")
                await pieces.put(("error", ApiError(500, "internal error: see the node's log", "server_error",
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
                    body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_name,
                            "choices": [], "usage": usage(value)}
                    yield f"data: {json.dumps(body)}\n\n".encode()
                break
            else:
                yield f"data: {json.dumps(error_body(value.message, value.kind, value.code))}\n\n".encode()
                break
        await task
        yield b"data: [DONE]\n\n"

    return app


ROUTES = ("/v1/chat/completions", "/v1/models", "/v1/extract", "/v1/classify", "/healthz", "/readyz", "/metrics")


async def _read_body(request: Any, limit: int, timeout_s: float) -> bytes:
    """The whole body, bounded in size and in time (a client that drips it is cut off)."""
    async def read() -> bytes:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the request body is over {limit} bytes", "invalid_request_error",
                               "body_too_large")
        return body

    try:
        body = await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", "invalid_request_error",
                       "request_timeout") from None
    request._body = body  # read once, bounded: the routes read it from here
    return body


def check_binding(config: ServerConfig) -> str | None:
    """None when this host/token combination may serve; else why not. Loopback needs nothing; any other address
    needs a token, or --insecure (which is logged as a warning). A blank token is never accepted."""
    if config.token is not None and not config.token.strip():
        return "the bearer token is blank: give a real one (--token or NODEAGENT_TOKEN), or none on loopback"
    loopback = config.host in ("127.0.0.1", "localhost", "::1") or config.host.startswith("127.")
    if loopback or config.token:
        return None
    if config.insecure:
        log.warning("serving on %s without a token (--insecure): anyone who reaches it can use the model",
                    config.host)
        return None
    return (f"binding {config.host} needs a bearer token (--token or NODEAGENT_TOKEN), or --insecure to serve "
            "without one")


__all__ = ["ApiError", "ErrorInfo", "ServerConfig", "check_binding", "create_app"]
