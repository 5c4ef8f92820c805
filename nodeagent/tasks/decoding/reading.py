"""The answer's one reading: its follower (a ``Closer``, ``decoding/closer.py``) fed every token's bytes as the
token is taken, and where each token ends. The guards, the budget and the drafts all read this one; after a
rollback it is read again from the tokens that stand. Without a format of its own (extraction, a response
format), the follower is a schema-less ``JsonCloser``: every grammar here writes JSON in one compact style."""

from __future__ import annotations

from typing import Callable

from nodeagent.backends.session import TokenSession
from nodeagent.tasks.decoding.closer import Closer, JsonCloser
from nodeagent.tasks.decoding.instances import Schemas

_ANY = Schemas(True)


def any_json() -> Closer:
    """A follower of any JSON value (nothing to close towards but its brackets)."""
    return JsonCloser(True, schemas=_ANY)


class Reading:
    """``closer``: the follower over the answer so far; ``ends``: each output token's end, in bytes."""

    def __init__(self, session: TokenSession, make: Callable[[], Closer] | None) -> None:
        self.s, self.make = session, make or any_json
        self.closer = self.make()
        self.ends: list[int] = []

    def feed(self, token: int) -> None:
        data = self.s.token_bytes(token)
        self.closer.feed(data)
        self.ends.append((self.ends[-1] if self.ends else 0) + len(data))

    def rebuild(self, out: list[int], cap: int | None = None) -> None:
        """Read again from ``out`` (after a rollback); ``cap``: how many watched items it may still hold."""
        self.closer, self.ends = self.make(), []
        if cap is not None:
            self.closer.cap = cap
        for t in out:
            self.feed(t)

    def token_at(self, byte: int) -> int:
        """The output token that holds byte ``byte``."""
        return next(i for i, end in enumerate(self.ends) if end > byte)

    def repeated(self) -> int | None:
        """When the last item repeats an earlier one (a call made twice): the output token where it began."""
        at = self.closer.repeat_from
        return None if at is None else self.token_at(at)

    def duplicate_key(self) -> tuple[str, int] | None:
        """A key written again in its object, and the output token where its text began."""
        key, at = self.closer.duplicate, self.closer.duplicate_at
        return None if key is None or at is None else (key, self.token_at(at))
