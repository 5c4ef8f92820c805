"""What every request passes through, in this order: one framing of its body (a Content-Length beside a
Transfer-Encoding is a 400, RFC 9112 6.1), the Host it names (a loopback server answers only its own
loopback names and NODEAGENT_ALLOWED_HOSTS: a name an attacker rebound to 127.0.0.1 gets 421), the operator's page's
gate or the API's bearer token (bad ones counted per client address, and past ten a minute refused with 429), a
cross-site write refused when no token guards the API, the body's bounds (size, time, nesting whatever its type,
Unicode), the request metrics; and the exception handlers that give every error OpenAI's shape (a traceback goes to
the log, never to the client).

The body is read only when the route reads it: after the Host, the token and the route have been checked, so a
request without the token, or a POST to a path that takes none (``/healthz``), is answered without a byte of its
body held. Reading it is bounded in time and size, linear (chunks joined once), and per client address: a client
may hold at most NODEAGENT_MAX_BODY_BYTES twice over in bodies being read at once beyond its first, each charged
what it holds (its Content-Length, or its route's limit when it has none, and any byte read past that)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from nodeagent import payload
from nodeagent.errors import HttpError, param_of, validation_message
from nodeagent.server.served import Served
from nodeagent.ui import security

log = logging.getLogger(__name__)
access = logging.getLogger("nodeagent.access")
OPEN_PATHS = ("/healthz", "/readyz", "/favicon.ico")  # the icon: what a browser asks for on its own
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
OPEN_BODY_BYTES = 64 << 10  # the sign-in form's body: what a request without the token may send
UPLOADS = ("/v1/files",)  # the one route whose body is not JSON (a multipart upload): passed on as it comes
PARSED = "json"  # where the body's JSON, read once and checked, waits for the route (``scope["state"]``)

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
        return reply(HttpError(400, validation_message(exc, skip=("body",)), code="invalid_request",
                               param=param_of(exc, skip=("body",))))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
        if isinstance(exc.__cause__, HttpError):  # the body's bounds, met while FastAPI read it for the route
            request.state.code = exc.__cause__.code
            return reply(exc.__cause__)
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
        self.bodies = BodyBudget(2 * served.config.max_body_bytes)

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
            client = (scope.get("client") or ("?", 0))[0]
            _one_framing(headers)
            if not host_allowed(headers.get("host"), config.host, config.allowed_hosts):
                raise HttpError(421, f"this server answers for {config.host} and its own names, not for "
                                     f"{headers.get('host')!r}: add the name to NODEAGENT_ALLOWED_HOSTS if clients "
                                     "reach it by it", code="misdirected_request")
            signed = True
            if page:
                answer = _page_gate(scope, headers, self.served, client)
                if answer is not None:
                    raise _Answered(answer)
                signed = security.signed_in(headers, config.token, self.served.sessions)
            elif config.token and path not in OPEN_PATHS:
                given = headers.get("authorization", "")
                right = hmac.compare_digest(given.encode(), f"Bearer {config.token}".encode())
                if not right:
                    if given:  # a guess (a client that sent none is not guessing): counted, slowed past the limit
                        _throttled(self.served.throttle.judge(client, False), client)
                    raise HttpError(401, "a valid bearer token is required", "authentication_error",
                                    "invalid_api_key")
            elif not config.token and not security.same_origin(scope.get("method", "GET"), headers,
                                                                headers.get("host")):
                raise HttpError(403, "a write from another site is refused (Origin/Sec-Fetch-Site): with no token, "
                                     "the API answers only this machine's own clients", "permission_error",
                                "cross_site")
            length = headers.get("content-length")
            # an upload of a batch file may be larger than a request (its multipart framing on top); what arrives
            # unsigned (the page's sign-in form) is small
            limit = config.max_batch_bytes + (64 << 10) if path == "/v1/files" else config.max_body_bytes
            limit = limit if signed else OPEN_BODY_BYTES
            if length is not None and length.isdigit() and int(length) > limit:
                raise HttpError(413, f"the request body is over {limit} bytes", code="body_too_large")
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                kind = "form" if page else "upload" if path in UPLOADS else "json"
                if kind == "json":
                    _json_type(headers.get("content-type", ""))
                    if "content-type" not in headers:  # a body without a type is read as JSON by every route
                        scope["headers"] = [*scope.get("headers", []), (b"content-type", b"application/json")]
                receive = _bounded(receive, limit, config.client_timeout_s, kind, self.bodies, client,
                                   int(length) if length and length.isdigit() else limit, state)
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


def _one_framing(headers: dict[str, str]) -> None:
    """A 400 (and the connection closed) for a request framed twice: a Content-Length beside a Transfer-Encoding is a
    request-smuggling vector (RFC 9112 6.1), and its length is not what is read (h11 reads the chunks)."""
    if "transfer-encoding" in headers and "content-length" in headers:
        raise HttpError(400, "a request with both Content-Length and Transfer-Encoding is refused (RFC 9112 6.1: a "
                             "request-smuggling vector): send one of them", code="ambiguous_framing",
                        headers={"Connection": "close"})


class _Answered(Exception):
    """The page's gate answered the request itself (a redirect, a refusal)."""

    def __init__(self, response: Any) -> None:
        self.response = response


def _throttled(wait: float, client: str) -> None:
    """A 429 for a wrong token from an address past its failures (``Throttle.judge``'s wait)."""
    if wait:
        raise HttpError(429, f"too many wrong tokens from {client}: try again in {wait:.0f} s", "rate_limit_exceeded",
                        "too_many_failures", headers={"Retry-After": str(int(wait) + 1)})


def host_allowed(host: str | None, bound: str, allowed: list[str]) -> bool:
    """Whether a request naming ``host`` (its Host header) may be answered by a server bound to ``bound``: a
    loopback server only for loopback names and addresses (a DNS rebinding names the attacker's host), plus
    ``allowed``; a server on another address for any name, unless ``allowed`` lists the ones it answers."""
    from nodeagent.server.served import is_loopback

    name = (host or "").strip().lower()
    name = name[1:].split("]", 1)[0] if name.startswith("[") else name.rsplit(":", 1)[0] if name.count(":") == 1 \
        else name
    if "*" in allowed or name in allowed:
        return True
    if is_loopback(bound):
        return name in LOOPBACK_NAMES or is_loopback(name)
    return not allowed


def _page_gate(scope: dict, headers: dict[str, str], served: Any, client: str) -> Any:
    """The operator's page (``ui/security.py``): a sign-in link opens a session, sets its cookie and redirects
    without the token; a request not signed in goes to the login form (a stream or a write gets a 401); a write
    from another origin gets a 403. None: the request goes on."""
    from fastapi.responses import JSONResponse, RedirectResponse

    token = served.config.token
    path, method = scope.get("path", ""), scope.get("method", "GET")
    query = scope.get("query_string", b"").decode("latin-1")
    if not security.same_origin(method, headers, headers.get("host")):
        return JSONResponse(HttpError(403, "a write from another site is refused (Sec-Fetch-Site/Origin)",
                                      "permission_error", "cross_site").body(), status_code=403)
    if path.startswith(security.OPEN):
        return None
    given, rest = security.link_token(query)
    if given is not None and token:  # a sign-in link: a session, its cookie, and the address without the token
        if security.is_token(given, token):
            out = RedirectResponse(path + (f"?{rest}" if rest else ""), status_code=303)
            out.headers["set-cookie"] = security.login_cookie(served.sessions.open(client),
                                                              scope.get("scheme") == "https")
            return out
        try:
            _throttled(served.throttle.judge(client, False), client)
        except HttpError as exc:
            return reply(exc)
    elif given is not None:  # no token to sign in with: the page is open; the address without the link's part
        return RedirectResponse(path + (f"?{rest}" if rest else ""), status_code=303)
    if security.signed_in(headers, token, served.sessions):
        return None
    if method == "GET" and "text/event-stream" not in headers.get("accept", ""):
        from urllib.parse import quote

        target = path + (f"?{query}" if query and given is None else "")
        return RedirectResponse(f"/ui/login?next={quote(target, safe='')}", status_code=303)
    return JSONResponse(HttpError(401, "sign in to the page first: /ui/login", "authentication_error",
                                  "invalid_api_key").body(), status_code=401)


class BodyBudget:
    """The bytes of bodies being read at once, per client address: a client's first body may be as large as its
    route allows; more at the same time only within ``per_client`` bytes in all (else 429)."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self.held: dict[str, int] = {}

    def take(self, client: str, nbytes: int, mine: int = 0) -> None:
        """Charge ``client`` ``nbytes`` more, or a 429; ``mine``: what the body asking holds already (a body the
        client sends alone is never refused here: its route's limit bounds it)."""
        now = self.held.get(client, 0)
        if now - mine and now + nbytes > self.per_client:
            raise HttpError(429, f"{client} is sending too many request bodies at once ({now} bytes): wait for "
                                 "their answers", "rate_limit_exceeded", "too_many_bodies",
                            headers={"Retry-After": "1"})
        self.held[client] = now + nbytes

    def give(self, client: str, nbytes: int) -> None:
        left = self.held.get(client, 0) - nbytes
        if left > 0:
            self.held[client] = left
        else:
            self.held.pop(client, None)


def _json_type(content_type: str) -> None:
    """A JSON route takes JSON: no content type, application/json, or a +json type; anything else is a 415 (a form
    or a multipart body is not read as JSON behind the checks)."""
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind and kind != "application/json" and not kind.endswith("+json"):
        raise HttpError(415, f"this route takes a JSON body (Content-Type: application/json), not {kind}",
                        code="unsupported_media_type")


def json_body(request: Any) -> Any:
    """The request's JSON body as the middleware read and checked it once (off the event loop), for a route that
    reads it itself; a body that is not JSON raises the route's 400."""
    state = request.scope.get("state", {})
    if PARSED in state:
        return state[PARSED]
    raise HttpError(400, "the request body is not JSON", code="invalid_json")


def _bounded(receive: Any, limit: int, timeout_s: float, kind: str, budget: BodyBudget, client: str,
             expected: int, state: dict) -> Any:
    """The connection's messages, the body read when the route first asks for it, bounded in size and time and
    within the client's budget. ``kind``: json (read whole and parsed once, off the event loop: its nesting, text and
    numbers checked, the value kept in ``state`` for the route), form (the page's forms: read whole), upload (passed
    on chunk by chunk as it comes: a 200 MB file is never held here). ``expected``: what the body is charged at its
    start (its Content-Length, or its route's limit); a body that outgrows it takes the rest from the budget as it
    arrives (or is a 429), and all it took is given back once it is read. Then the connection's own messages (a
    disconnect among them)."""
    if kind == "upload":
        return _streamed(receive, limit, timeout_s)
    done = False
    charged = 0  # what the budget holds for this body: ``expected`` at its start, and what is read past that

    async def read() -> bytes:
        nonlocal charged
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise HttpError(499, "the client went away", code="cancelled")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"the request body is over {limit} bytes", code="body_too_large")
            if size > charged:  # past what was charged at its start: the rest taken as it arrives, or a 429
                budget.take(client, size - charged, mine=charged)
                charged = size
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)  # joined once: linear in the body's size

    async def bounded() -> dict:
        nonlocal done, charged
        if done:
            return await receive()
        done = True
        budget.take(client, expected)
        charged = expected
        try:
            body = await asyncio.wait_for(read(), timeout_s)
        except asyncio.TimeoutError:
            raise HttpError(408, f"the request body did not arrive within {timeout_s:g} s",
                            code="request_timeout") from None
        finally:
            budget.give(client, charged)
        if body and kind == "json":
            try:  # nesting, lone surrogates, numbers: before any route or library relies on the body
                state[PARSED] = await asyncio.to_thread(payload.loads, body)
            except payload.PayloadError as exc:
                if not str(exc).startswith("not JSON"):  # a route answers a malformed JSON body itself (400)
                    raise HttpError(400, f"the request body cannot be used: {exc}", code="invalid_body") from None
        return {"type": "http.request", "body": body, "more_body": False}

    return bounded


def _streamed(receive: Any, limit: int, timeout_s: float) -> Any:
    """An upload's messages passed on as they come, each within the time left and the whole within ``limit``."""
    size = 0
    deadline: list[float] = []

    async def streamed() -> dict:
        nonlocal size
        loop = asyncio.get_running_loop()
        deadline[:1] = deadline[:1] or [loop.time() + timeout_s]
        try:
            message = await asyncio.wait_for(receive(), max(0.001, deadline[0] - loop.time()))
        except asyncio.TimeoutError:
            raise HttpError(408, f"the request body did not arrive within {timeout_s:g} s",
                            code="request_timeout") from None
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                raise HttpError(413, f"the request body is over {limit} bytes", code="body_too_large")
        return message

    return streamed
