"""Room kept, at every token, for what closes the answer: the decoder takes a token only if the shortest valid
ending after it (a ``Closer``'s ``closing()``, ``decoding/closer.py``) still fits in the tokens left, and counts
the ending's tokens as the grammar would take them (forced ones free, ``chosen_tokens``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nodeagent.backends.session import TokenSession
from nodeagent.tasks.decoding.closer import Closer
from nodeagent.tasks.decoding.reading import Reading


def chosen_tokens(session: TokenSession, matcher: Any, text: str) -> int:
    """How many of the tokens that write ``text`` from ``matcher``'s state would be chosen rather than forced
    (``fast_forward``): walked on a copy of the matcher, the grammar's forced tokens taken where ``text`` goes
    on with them, else the text's own next token counted and taken."""
    m = matcher.deep_copy()
    rest, chosen = text.encode(), 0
    while rest:
        ff = m.compute_ff_tokens()
        data = b"".join(session.token_bytes(t) for t in ff)
        if ff and rest.startswith(data):
            m.consume_tokens(ff)
            rest = rest[len(data):]
            continue
        step = session.tokenize_continuation(rest.decode("utf-8", "replace"))[:1]
        if not step:
            break
        chosen += 1
        taken = session.token_bytes(step[0])
        if not m.consume_token(step[0]) or not rest.startswith(taken):
            return chosen + len(session.tokenize_continuation(rest[len(taken):].decode("utf-8", "replace")))
        rest = rest[len(taken):]
    return chosen


class RoomToClose:
    """Room kept, at every token, for what closes the answer (``decoding/closer.py``): a token is taken only if the
    shortest valid ending after it still fits in the tokens left. When the model's token would not leave that
    room, the ending's own next token is taken instead (the value being written is cut short, and ``cut`` says
    where; between two calls, no further call is begun); when it would make an ending impossible (a call past the
    answer's cap), the best token that keeps one possible is taken. Reads the answer's follower (``reading``,
    which the decoder feeds and rebuilds).

    Two counts bound the ending: the tokens charged to ``max_tokens`` (with ``matcher`` given, the forced ones
    are free: only the ending's chosen tokens count, ``chosen_tokens``) and all tokens, within ``room``."""

    def __init__(self, session: TokenSession, reading: Reading, max_tokens: int, matcher: Any = None,
                 room: int | None = None) -> None:
        self.s, self.reading, self.max_tokens, self.matcher = session, reading, max_tokens, matcher
        self.room = max_tokens if room is None else room

    @property
    def closer(self) -> Closer:
        return self.reading.closer

    def fits(self, token: int, left: int, total_left: int | None = None) -> bool | None:
        """Whether the answer can still close after ``token`` within ``left`` charged tokens and ``total_left``
        tokens in all (the same as ``left`` unless forced tokens are free); None if it cannot close."""
        total_left = left if total_left is None else total_left
        after = self.closer.copy()
        after.feed(self.s.token_bytes(token))
        text = after.closing()
        if text is None:
            return None
        if len(text.encode()) <= min(left, total_left):  # a token holds at least one byte
            return True
        every = len(self.s.tokenize_continuation(text))  # not empty: it holds more bytes than tokens left
        if every > total_left:
            return False
        if self.matcher is None:
            return every <= left
        m = self.matcher.deep_copy()
        if not m.consume_token(token):
            return False
        return chosen_tokens(self.s, m, text) <= left

    def choose(self, token: int, used: int, total: int, allowed: np.ndarray | None,
               logits: np.ndarray) -> tuple[int, bool]:
        """The token to take (``used`` tokens charged so far, ``total`` written): the model's when the answer
        stays closable, else one that keeps it so; and whether the answer is being cut short for the budget."""
        if token in self.s.eog_tokens:
            return token, False
        left, total_left = self.max_tokens - used - 1, self.room - total - 1
        fit = self.fits(token, left, total_left)
        if fit:
            return token, False
        ending = self.closer.closing()
        first = (self.s.tokenize_continuation(ending)[:1] + self.s.tokenize_continuation(ending[:1])[:1]) \
            if ending else []
        pool = allowed if allowed is not None else np.arange(logits.shape[0])
        ranked = pool[np.argsort(-logits[pool])[:32]].tolist()
        for t in first + ranked:
            if t != token and _has(pool, t) and self.fits(t, left, total_left):  # declining a call cuts nothing
                return int(t), fit is False and not self.closer.between_items()
        return token, False  # nothing keeps it closable: it may end cut, its unfinished call left out


def _has(sorted_ids: np.ndarray, token: int) -> bool:
    i = int(np.searchsorted(sorted_ids, token))
    return i < sorted_ids.shape[0] and int(sorted_ids[i]) == token
