"""What every request passes through: the bearer token, the body's bounds (size, time, nesting, Unicode), the
request metrics; and the exception handlers that give every error OpenAI's shape (a traceback goes to the log,
never to the client)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from nodeagent import payload
from nodeagent.errors import HttpError, validation_message
from nodeagent.server.state import Served

log = logging.getLogger(__name__)
access = logging.getLogger("nodeagent.access")
OPEN_PATHS = ("/healthz", "/readyz")


def reply(error: HttpError) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


def install(app: Any, served: Served, routes: set[str]) -> None:
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    config = served.config

    @app.exception_handler(HttpError)
    async def refused(request: Request, exc: HttpError) -> Any:
        request.state.code = exc.code  # for the access log
        return reply(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Any:
        first = exc.errors()[0] if exc.errors() else {"loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return reply(HttpError(400, validation_message(exc, skip=("body",)), code="invalid_request",
                               param=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return reply(HttpError(exc.status_code, str(exc.detail), kind, str(exc.status_code),
                               headers=dict(exc.headers or {})))  # a 405 says which methods are allowed

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> Any:  # the traceback goes to the log, not the client
        log.exception("%s %s failed", request.method, request.url.path)
        return reply(HttpError(500, "internal error: see the node's log", "server_error", "internal_error"))

    @app.middleware("http")
    async def bounded(request: Request, call_next: Any) -> Any:
        started = time.perf_counter()
        path = request.url.path
        try:
            if config.token and path not in OPEN_PATHS:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {config.token}".encode()):
                    raise HttpError(401, "a valid bearer token is required", "authentication_error",
                                    "invalid_api_key")
            length = request.headers.get("content-length")
            # an upload of a batch file may be larger than a request (its multipart framing on top)
            limit = config.max_batch_bytes + (64 << 10) if request.url.path == "/v1/files" else config.max_body_bytes
            if length is not None and length.isdigit() and int(length) > limit:
                raise HttpError(413, f"the request body is over {limit} bytes", code="body_too_large")
            if request.method in ("POST", "PUT"):
                body = await read_body(request, limit, config.client_timeout_s)
                if body and "json" in request.headers.get("content-type", "application/json"):
                    try:  # nesting and lone surrogates, before any route or library relies on the body
                        payload.loads(body)
                    except payload.PayloadError as exc:
                        if "not JSON" not in str(exc):  # FastAPI answers malformed JSON itself (400)
                            raise HttpError(400, f"the request body cannot be used: {exc}",
                                            code="invalid_body") from None
            response = await call_next(request)
        except HttpError as exc:
            response = reply(exc)
            request.state.code = exc.code
        route = path if path in routes else "other"
        seconds = time.perf_counter() - started
        served.metrics.request(route, response.status_code, seconds)
        fields = {"method": request.method, "route": route, "status": response.status_code,
                  "ms": round(1000 * seconds, 1), **getattr(request.state, "access", {})}
        if getattr(request.state, "code", None):
            fields["code"] = request.state.code
        access.info(" ".join(f"{k}={v}" for k, v in fields.items()), extra={"fields": fields})
        return response


async def read_body(request: Any, limit: int, timeout_s: float) -> bytes:
    """The whole body, bounded in size and in time (a client that drips it is cut off)."""
    async def read() -> bytes:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise HttpError(413, f"the request body is over {limit} bytes", code="body_too_large")
        return body

    try:
        body = await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise HttpError(408, f"the request body did not arrive within {timeout_s:g} s",
                        code="request_timeout") from None
    request._body = body  # read once, bounded: the routes read it from here
    return body
