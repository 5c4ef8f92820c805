"""The page's safety: who may see it, what it may load, who may press its buttons.

- **The same bearer token as the API.** A browser gives it once, through the login form or the ``/ui?token=T``
  link that `serve` and `gateway` print at start; the answer opens a session (``ui/sessions.py``: a random id kept
  server-side with an expiry) and keeps its id as an HttpOnly, SameSite=Strict cookie scoped to ``/ui``, then
  redirects to the page without the token in its address. The cookie opens the page, never the API; signing out
  ends its session, and a new token ends them all. Wrong tokens are counted per client address and, past ten a
  minute, refused with a 429 (``server/throttle.py``). Without a token configured (loopback), the page is open as
  the API.
- **Nothing loaded from elsewhere**: every page is served with a Content-Security-Policy that allows this
  origin's scripts, styles and streams only, no inline script, no framing.
- **Writes are same-origin**: a POST whose ``Sec-Fetch-Site`` is not ``same-origin`` (or, from a browser that does
  not send it, whose ``Origin`` is not this server) is refused with a 403, before any route runs.
- Read-only unless the server was started with ``--ui-admin``.
"""

from __future__ import annotations

import hmac
from typing import Any
from urllib.parse import parse_qs, urlencode

COOKIE = "nodeagent_ui"
PREFIX = "/ui"
OPEN = ("/ui/login", "/ui/static/")  # the login form and the page's own files need no token
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
           "x-frame-options": "DENY", "cache-control": "no-store"}


def cookies(headers: dict[str, str]) -> dict[str, str]:
    out = {}
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name:
            out[name] = value
    return out


def is_page(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def is_token(given: str, token: str) -> bool:
    """Whether ``given`` is this server's token (compared in constant time)."""
    return hmac.compare_digest(given.encode(), token.encode())


def signed_in(headers: dict[str, str], token: str | None, sessions: Any) -> bool:
    """Whether a page request may see the page: no token configured, the bearer token, or an open session's
    cookie."""
    if not token:
        return True
    if is_token(headers.get("authorization", ""), f"Bearer {token}"):
        return True
    return sessions.valid(cookies(headers).get(COOKIE))


def session_of(headers: dict[str, str]) -> str | None:
    return cookies(headers).get(COOKIE) or None


def login_cookie(session_id: str, secure: bool) -> str:
    return (f"{COOKIE}={session_id}; Path={PREFIX}; HttpOnly; SameSite=Strict"
            + ("; Secure" if secure else ""))


def logout_cookie() -> str:
    return f"{COOKIE}=; Path={PREFIX}; HttpOnly; SameSite=Strict; Max-Age=0"


def link_token(query: str) -> tuple[str | None, str]:
    """The ``token`` a sign-in link carries, and the query without it."""
    params = parse_qs(query, keep_blank_values=True)
    given = params.pop("token", [None])[0]
    return given, urlencode(params, doseq=True)


def same_origin(method: str, headers: dict[str, str], host: str | None) -> bool:
    """Whether a request may change something: safe methods always; a write only from this origin."""
    if method in ("GET", "HEAD", "OPTIONS"):
        return True
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site == "same-origin"
    origin = headers.get("origin")
    if origin is None or host is None:  # neither header: not a browser's cross-site form (curl, a script)
        return origin is None
    return origin.split("://", 1)[-1] == host
