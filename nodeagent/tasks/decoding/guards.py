"""The guards small models need under a grammar.

Each guard is written once, as the tokens it refuses at the position the answer stands at (a vectorised
predicate over token ids). ``Guards.narrow`` leaves them out of a choice when the grammar allows anything else;
``Guards.refuses`` asks the same of one token (a drafted one, which the model did not choose under the guards).

- **Loops**: the token that would continue a repetition (a token 12 times, a cycle of 2-16 tokens over 24) is
  refused ("1.0000000...", "\\u001b\\u001b...", ", 0, 0, 0").
- **Endless numbers**: past ``MAX_NUMBER_CHARS`` characters of a number, tokens that would extend it are refused.
- **Duplicate keys**: where the decoder took an object back to a key it wrote twice, the token that began that
  key is refused at that position (``banned``; the decoder gives up after ``MAX_KEY_RETRIES``).

Where the text stands (inside a string, in a number, a key written again) they read from the answer's one follower
(``decoding/reading.py``), which the decoder feeds.

To add a guard: a method that returns its refusal for the position (or None when it has nothing to say) and its
name in ``rules``; both the choice and the drafts then obey it.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from nodeagent.tasks.decoding.reading import Reading

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


Refusal = Callable[[np.ndarray], np.ndarray]  # token ids -> whether each is refused here


class Guards:
    """Every guard over one answer: what it has written (``out``, shared with the decoder), the answer's reading
    (shared too), and the tokens steered away from by position (``banned``)."""

    def __init__(self, out: list[int], detokenize: Callable[[list[int]], str], reading: Reading) -> None:
        self.out, self.detokenize, self.reading = out, detokenize, reading
        self.banned: dict[int, set[int]] = {}  # output position -> tokens that led to a duplicate key there

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
        if self.reading.closer.number_chars() < MAX_NUMBER_CHARS:
            return None
        return lambda ids: np.fromiter((self.detokenize([int(t)])[:1] in NUMBER_CHARS for t in ids), bool, ids.size)
