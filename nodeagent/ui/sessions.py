"""The operator's page's sessions: a sign-in makes a random session id, kept server-side with an expiry (in the
broker, so every gateway behind a load balancer knows it; in this process when there is no broker), and the cookie
holds only that id. Signing out deletes it; changing the token ends every session; a session lasts
NODEAGENT_UI_SESSION_S at most.

What the store keeps is keyed by an HMAC of the session id under the token, and holds who signed in and when:
nothing of the token, so a reader of the broker can neither replay a cookie nor test guesses of the token offline
(each guess would need a session id, 256 random bits). A new token finds none of the keys the old one made: every
session ends with it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from typing import Any, Protocol


class Store(Protocol):
    def kv_put(self, key: str, value: str, ttl_s: float) -> None: ...
    def kv_get(self, key: str) -> str | None: ...
    def kv_delete(self, key: str) -> None: ...


class MemoryStore:
    """A store in this process (a server without a broker)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._values: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def kv_put(self, key: str, value: str, ttl_s: float) -> None:
        with self._lock:
            now = self._clock()
            self._values = {k: v for k, v in self._values.items() if v[1] > now}
            self._values[key] = (value, now + ttl_s)

    def kv_get(self, key: str) -> str | None:
        with self._lock:
            got = self._values.get(key)
            return got[0] if got and got[1] > self._clock() else None

    def kv_delete(self, key: str) -> None:
        with self._lock:
            self._values.pop(key, None)


def _key(token: str, session_id: str) -> str:
    """Where a session is kept: bound to the token it was opened with (another token's key is another)."""
    return "ui-session:" + hmac.new(token.encode(), session_id.encode(), hashlib.sha256).hexdigest()


class Sessions:
    def __init__(self, store: Store, token: str | None, ttl_s: float) -> None:
        self.store, self.token, self.ttl_s = store, token, ttl_s

    def open(self, who: str) -> str:
        """A new session for a sign-in with the token; its id (the cookie's value)."""
        assert self.token, "no token: the page is open, there is no session to make"
        session_id = secrets.token_urlsafe(32)
        self.store.kv_put(_key(self.token, session_id), json.dumps({"who": who, "at": time.time()}), self.ttl_s)
        return session_id

    def valid(self, session_id: str | None) -> bool:
        """Whether a cookie's session is open, and was opened with this token."""
        if not self.token or not session_id or len(session_id) > 200:
            return False
        try:
            text = self.store.kv_get(_key(self.token, session_id))
            data = json.loads(text) if text else None
        except (ValueError, OSError):
            return False
        return isinstance(data, dict)

    def close(self, session_id: str | None) -> None:
        if session_id and self.token:
            self.store.kv_delete(_key(self.token, session_id))
