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
from nodeagent.ui import security

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

    app.add_middleware(Bounded, served=served, routes=routes)


class Bounded:
    """Every request, as plain ASGI (a route can then tell when its client goes away): the bearer token, the
    body read whole within its bounds (size, time, nesting, Unicode) and handed on, and after the answer the
    metrics and one access-log line (with what the route put in ``request.state``: tokens, task, node, code)."""

    def __init__(self, app: Any, served: Served, routes: set[str]) -> None:
        self.app, self.served, self.routes = app, served, routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        config = self.served.config
        path = scope.get("path", "")
        state = scope.setdefault("state", {})
        status = {"code": 500}

        page = security.is_page(path)

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                if page:  # the page's policy: nothing loaded from elsewhere, no framing, no caching
                    message = {**message, "headers": [*message.get("headers", []),
                                                      *((k.encode(), v.encode()) for k, v in security.HEADERS.items())]}
            await send(message)

        try:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            answer = _page_gate(scope, headers, config.token) if page else None
            if answer is not None:
                raise _Answered(answer)
            if not page and config.token and path not in OPEN_PATHS:
                given = headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {config.token}".encode()):
                    raise HttpError(401, "a valid bearer token is required", "authentication_error",
                                    "invalid_api_key")
            length = headers.get("content-length")
            # an upload of a batch file may be larger than a request (its multipart framing on top)
            limit = config.max_batch_bytes + (64 << 10) if path == "/v1/files" else config.max_body_bytes
            if length is not None and length.isdigit() and int(length) > limit:
                raise HttpError(413, f"the request body is over {limit} bytes", code="body_too_large")
            if scope.get("method") in ("POST", "PUT"):
                body = await read_body(receive, limit, config.client_timeout_s)
                if body and "json" in headers.get("content-type", "application/json"):
                    try:  # nesting and lone surrogates, before any route or library relies on the body
                        payload.loads(body)
                    except payload.PayloadError as exc:
                        if "not JSON" not in str(exc):  # FastAPI answers malformed JSON itself (400)
                            raise HttpError(400, f"the request body cannot be used: {exc}",
                                            code="invalid_body") from None
                receive = _replay(body, receive)
            await self.app(scope, receive, sending)
        except _Answered as done:
            await done.response(scope, receive, sending)
        except HttpError as exc:
            state["code"] = exc.code
            await reply(exc)(scope, receive, sending)
        route = path if path in self.routes else "other"
        seconds = time.perf_counter() - started
        self.served.metrics.request(route, status["code"], seconds)
        fields = {"method": scope.get("method"), "route": route, "status": status["code"],
                  "ms": round(1000 * seconds, 1), **state.get("access", {})}
        if state.get("code"):
            fields["code"] = state["code"]
        access.info(" ".join(f"{k}={v}" for k, v in fields.items()), extra={"fields": fields})


class _Answered(Exception):
    """The page's gate answered the request itself (a redirect, a refusal)."""

    def __init__(self, response: Any) -> None:
        self.response = response


def _page_gate(scope: dict, headers: dict[str, str], token: str | None) -> Any:
    """The operator's page (``ui/security.py``): a sign-in link sets the cookie and redirects without the token; a
    request not signed in goes to the login form (a stream or a write gets a 401); a write from another origin gets
    a 403. None: the request goes on."""
    from fastapi.responses import JSONResponse, RedirectResponse

    path, method = scope.get("path", ""), scope.get("method", "GET")
    query = scope.get("query_string", b"").decode("latin-1")
    if not security.same_origin(method, headers, headers.get("host")):
        return JSONResponse(HttpError(403, "a write from another site is refused (Sec-Fetch-Site/Origin)",
                                      "permission_error", "cross_site").body(), status_code=403)
    if path.startswith(security.OPEN):
        return None
    given, rest = security.link_token(query)
    if given is not None:  # a sign-in link: the cookie, and the address without the token
        target = path + (f"?{rest}" if rest else "")
        if not token or security.is_token(given, token):
            out = RedirectResponse(target, status_code=303)
            if token:
                out.headers["set-cookie"] = security.login_cookie(token, scope.get("scheme") == "https")
            return out
    if security.signed_in(headers, token):
        return None
    if method == "GET" and "text/event-stream" not in headers.get("accept", ""):
        from urllib.parse import quote

        target = path + (f"?{query}" if query and given is None else "")
        return RedirectResponse(f"/ui/login?next={quote(target, safe='')}", status_code=303)
    return JSONResponse(HttpError(401, "sign in to the page first: /ui/login", "authentication_error",
                                  "invalid_api_key").body(), status_code=401)


def _replay(body: bytes, receive: Any) -> Any:
    """The body once, then the connection's own messages (a disconnect among them)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def read_body(receive: Any, limit: int, timeout_s: float) -> bytes:
    """The whole body, bounded in size and in time (a client that drips it is cut off)."""
    async def read() -> bytes:
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise HttpError(499, "the client went away", code="cancelled")
            body += message.get("body", b"")
            if len(body) > limit:
                raise HttpError(413, f"the request body is over {limit} bytes", code="body_too_large")
            if not message.get("more_body"):
                return body

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise HttpError(408, f"the request body did not arrive within {timeout_s:g} s",
                        code="request_timeout") from None
