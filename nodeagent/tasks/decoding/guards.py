"""The guards small models need under a grammar, and the JSON tail they read.

Each guard is written once, as the tokens it refuses at the position the answer stands at (a vectorised
predicate over token ids). ``Guards.narrow`` leaves them out of a choice when the grammar allows anything else;
``Guards.refuses`` asks the same of one token (a drafted one, which the model did not choose under the guards).

- **Loops**: the token that would continue a repetition (a token 12 times, a cycle of 2-16 tokens over 24) is
  refused ("1.0000000...", "\\u001b\\u001b...", ", 0, 0, 0").
- **Endless numbers**: past ``MAX_NUMBER_CHARS`` characters of a number, tokens that would extend it are refused.
- **Duplicate keys**: where the decoder took an object back to a key it wrote twice, the token that began that
  key is refused at that position (``banned``; the decoder gives up after ``MAX_KEY_RETRIES``).

To add a guard: a method that returns its refusal for the position (or None when it has nothing to say) and its
name in ``rules``; both the choice and the drafts then obey it.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

# After this many identical tokens in a row, the repeated token is left out of the next choice when the
# grammar allows anything else: greedy decoding on small models otherwise loops ("1.0000000...").
MAX_REPEAT = 12
# A JSON number never needs more characters than this (float64's longest form, "-1.7976931348623157e+308");
# past it, tokens that would extend the number are left out when the grammar allows another. JSON Schema
# bounds a number's value, not its length, and small models loop in digits ("0.0010000000000010...").
MAX_NUMBER_CHARS = 24
NUMBER_CHARS = frozenset("0123456789.eE+-")


# A cycle of 2 to MAX_PERIOD tokens repeated over CYCLE_TOKENS tokens (and at least 4 times) is a loop: the
# token that would continue it is left out when the grammar allows another ("\u001b\u001b...", ", 0, 0, 0").
MAX_PERIOD = 16
CYCLE_TOKENS = 24
# An object that keeps starting a key it already has is steered away this many times, then the task stops.
MAX_KEY_RETRIES = 4


def cycle_token(out: list[int]) -> int | None:
    """The token that would continue a repetition loop at the end of ``out``, or None."""
    if len(out) >= MAX_REPEAT and len(set(out[-MAX_REPEAT:])) == 1:
        return out[-1]
    for period in range(2, MAX_PERIOD + 1):
        need = max(CYCLE_TOKENS, 4 * period)
        if len(out) < need:
            break
        tail = out[-need:]
        if all(tail[i] == tail[i - period] for i in range(period, need)):
            return out[-period]
    return None


class JsonTail:
    """Where JSON text fed piece by piece ends: inside a string, how many characters of a number, and the keys
    of every open object (``duplicate`` is set when a key closes that its object already has; ``key_at`` is
    the index of the token where that key's text began)."""

    def __init__(self) -> None:
        self.in_string = self.escaped = False
        self.number_chars = 0
        self.frames: list[dict | None] = []  # an open object: {"keys", "expect_key"}; an open array: None
        self.key: list[str] | None = None  # the key being written
        self.value: list[str] | None = None  # the string value being written (its characters, escapes as written)
        self.key_at: int | None = None
        self.duplicate: str | None = None

    def feed(self, text: str, token_index: int = 0) -> None:
        for ch in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.key is not None:
                        if self.key_at is None:  # an empty key: steer at its closing quote
                            self.key_at = token_index
                        self._key_done("".join(self.key))
                    self.value = None
                    continue
                if self.key is not None:
                    if not self.key:
                        self.key_at = token_index
                    self.key.append(ch)
                elif self.value is not None:
                    self.value.append(ch)
                continue
            top = self.frames[-1] if self.frames else None
            if ch == '"':
                self.in_string, self.number_chars = True, 0
                if top is not None and top["expect_key"]:
                    self.key, self.key_at = [], None
                else:
                    self.value = []
            elif ch == "{":
                self.frames.append({"keys": set(), "expect_key": True})
            elif ch == "[":
                self.frames.append(None)
            elif ch in "}]":
                if self.frames:
                    self.frames.pop()
            elif ch == "," and top is not None:
                top["expect_key"] = True
            elif ch in NUMBER_CHARS:
                self.number_chars += 1
                continue
            self.number_chars = 0

    def _key_done(self, key: str) -> None:
        top = self.frames[-1]
        assert top is not None
        if key in top["keys"]:
            self.duplicate = key
        top["keys"].add(key)
        top["expect_key"] = False
        self.key = None


Refusal = Callable[[np.ndarray], np.ndarray]  # token ids -> whether each is refused here


class Guards:
    """Every guard over one answer: what it has written (``out``, shared with the decoder), its JSON tail, and the
    tokens steered away from by position (``banned``)."""

    def __init__(self, out: list[int], detokenize: Callable[[list[int]], str]) -> None:
        self.out, self.detokenize = out, detokenize
        self.tail = JsonTail()  # fed token by token: the output is not re-read at every step
        self.banned: dict[int, set[int]] = {}  # output position -> tokens that led to a duplicate key there

    def feed(self, token: int) -> None:
        self.tail.feed(self.detokenize([token]), len(self.out) - 1)

    def rebuild(self) -> None:
        """The tail read again from the output (after a rollback)."""
        self.tail = JsonTail()
        for i, t in enumerate(self.out):
            self.tail.feed(self.detokenize([t]), i)

    def steer_from(self, position: int) -> None:
        """The token at ``position`` led to a duplicate key: refused there from now on."""
        self.banned.setdefault(position, set()).add(self.out[position])

    def short_of_banned(self, tokens: list[int]) -> list[int]:
        """``tokens``, to be taken from the next position on, up to the first position a rollback steered away
        from: that one is the model's to choose again."""
        for i in range(len(tokens)):
            if len(self.out) + i in self.banned:
                return tokens[:i]
        return tokens

    def rules(self) -> Iterator[Refusal]:
        for guard in (self._loop, self._steered, self._endless_number):
            refusal = guard()
            if refusal is not None:
                yield refusal

    def narrow(self, allowed: np.ndarray) -> np.ndarray:
        """``allowed`` less what each guard refuses, where that leaves the grammar anything to allow."""
        for refusal in self.rules():
            keep = allowed[~refusal(allowed)]
            if keep.size:
                allowed = keep
        return allowed

    def refuses(self, token: int) -> bool:
        ids = np.array([token])
        return any(bool(refusal(ids)[0]) for refusal in self.rules())

    def _loop(self) -> Refusal | None:
        loop = cycle_token(self.out)
        return None if loop is None else (lambda ids: ids == loop)

    def _steered(self) -> Refusal | None:
        bad = self.banned.get(len(self.out))
        return None if not bad else (lambda ids: np.isin(ids, list(bad)))

    def _endless_number(self) -> Refusal | None:
        if self.tail.in_string or self.tail.number_chars < MAX_NUMBER_CHARS:
            return None
        return lambda ids: np.fromiter((self.detokenize([int(t)])[:1] in NUMBER_CHARS for t in ids), bool, ids.size)
