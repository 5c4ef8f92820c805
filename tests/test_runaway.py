"""Runaway extraction, reproduced with adversarial made-up logits (a fake session that wants to loop), and
stopped by its guard: each test also shows the same run failing with the guard switched off."""

from __future__ import annotations

import numpy as np
import pytest

from nodeagent.backends.fake import EOS, N_VOCAB, FakeSession, FakeSpec
from nodeagent.tasks.contracts import ExtractTask
from nodeagent.tasks.decoding import closer as closer_mod  # the answer's follower, which notes a key written again
from nodeagent.tasks.decoding import guards as runner_mod  # the decoder's guards
from nodeagent.tasks.runner import TaskRunner
from nodeagent.tasks.schema import validate_output


class Stubborn(FakeSession):
    """A session with fixed preferences (no noise): whatever the grammar allows, it picks the same way."""

    def __init__(self, prefs: dict[str, float]) -> None:
        super().__init__(FakeSpec(), 4096)
        self.prefs = np.full(N_VOCAB, -5.0, dtype=np.float32)
        for ch, score in prefs.items():
            self.prefs[ord(ch)] = score
        self.prefs[EOS] = 0.0

    def _logits(self) -> np.ndarray:
        return self.prefs.copy()


def run(session: FakeSession, schema: dict, **kw) -> object:
    return TaskRunner(session, **kw).run(ExtractTask(input="anything", schema=schema))


ESCAPES = {"\\": 10, '"': 9.5, "u": 9, "0": 8, "}": 4, "a": 1}  # writes \\\\\\... (escaped backslashes)
NOTE = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"], "additionalProperties": False}


def test_an_escape_loop_is_broken(monkeypatch):
    r = run(Stubborn(ESCAPES), NOTE, max_string_chars=None)
    assert r.status == "ok" and validate_output(NOTE, r.output) is None
    assert r.output["note"].startswith("\\\\") and r.tokens.generated < 200
    monkeypatch.setattr(runner_mod, "cycle_token", lambda out: None)  # the guard off: "\u0000" forever
    r = run(Stubborn(ESCAPES), NOTE, max_string_chars=None)
    assert r.status == "error" and r.error.code == "output_truncated"


FREE_KEYS = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}}


class SameKey(Stubborn):
    """Wants every key to be "a" (then "b", "c"), every value 1, and ``keys`` of them before it closes."""

    def __init__(self, keys: int) -> None:
        super().__init__({})
        self.keys = keys

    def _logits(self) -> np.ndarray:
        text = self.detokenize(self._tokens).rsplit("assistant\n", 1)[-1]
        prefs = {" ": 2, ":": 2, "1": 5, '"': 8}
        last = text[-1:] if text else ""
        if last.isalpha():
            prefs['"'] = 10  # a key of one letter
        elif last == '"' and text[-2:-1] in ("{", " "):
            prefs.update({"a": 10, "b": 9, "c": 8, "d": 7})  # a key's first letter: "a" first
        elif last == "1":
            prefs.update({",": 9, "}": 8} if text.count(":") < self.keys else {",": 8, "}": 9})
        logits = np.full(N_VOCAB, -5.0, dtype=np.float32)
        for ch, score in prefs.items():
            logits[ord(ch)] = score
        return logits


def test_a_key_written_again_is_steered_elsewhere(monkeypatch):
    r = run(SameKey(keys=2), FREE_KEYS)
    assert r.status == "ok", r.error
    assert r.output == {"a": 1, "b": 1}  # it wanted "a" twice
    no_guard(monkeypatch)
    r = run(SameKey(keys=2), FREE_KEYS)
    assert r.output == {"a": 1}  # {"a": 1, "a": 1}: JSON keeps the last, one value silently gone


def no_guard(monkeypatch) -> None:
    """Keys are never compared: the duplicate-key guard off."""
    monkeypatch.setattr(closer_mod.JsonCloser, "_repeats", staticmethod(lambda obj, key: False))


def test_a_key_that_keeps_coming_back_is_a_clear_error_early(monkeypatch):
    r = run(SameKey(keys=10_000), FREE_KEYS)  # it would write "a" for ever: steered 4 times, then stopped
    assert r.status == "error" and r.error.code == "duplicate_key" and r.timings.total_s < 5
    no_guard(monkeypatch)
    r = run(SameKey(keys=10_000), FREE_KEYS)
    assert r.status == "error" and r.error.code == "output_truncated"  # {"a": 1, "a": 1, ... to the end


LETTERS = {"x": 9, "y": 8.9, "z": 8.8, "w": 8.7, "v": 8.6, '"': 2, "}": 1}


def test_an_endless_string_is_bounded():
    r = run(Stubborn(LETTERS), NOTE)  # the default bound: 1000 characters
    assert r.status == "ok" and len(r.output["note"]) == 1000
    assert any("bounded at 1000 characters" in n for n in r.notes)
    r = run(Stubborn(LETTERS), NOTE, max_string_chars=None)
    assert r.status == "error" and r.error.code == "output_truncated"


@pytest.mark.parametrize("out,expected", [
    ([5] * 12, 5), ([1, 2] * 12, 1), ([1, 2, 3] * 8, 1), ([7] * 11, None), ([1, 2] * 11, None),
    (list(range(40)), None),
])
def test_cycle_detection(out, expected):
    assert runner_mod.cycle_token(out) == expected


LIST = {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}}},
        "required": ["ids"], "additionalProperties": False}


class Counting(Stubborn):
    """Writes 1, 2, 3, ... into the array for ever: every item new, so no repetition guard sees a loop."""

    def __init__(self) -> None:
        super().__init__({})

    def _logits(self) -> np.ndarray:
        text = self.detokenize(self._tokens).rsplit("assistant\n", 1)[-1]
        prefs = {'"': 5, "{": 5, ":": 5, " ": 5, "[": 5, "}": 4, "]": 1}
        head, _, current = text.rpartition("[")
        if _ and not current.endswith(","):  # after a comma, the grammar writes the space
            items = current.split(", ")
            want = str(len(items))
            if items[-1] == want:
                prefs[","] = 9  # this item is written: the next
            elif want.startswith(items[-1]):
                prefs[want[len(items[-1])]] = 9
        logits = np.full(N_VOCAB, -5.0, dtype=np.float32)
        for ch, score in prefs.items():
            logits[ord(ch)] = score
        return logits


def test_an_endless_array_is_bounded():
    r = run(Counting(), LIST)  # the default bound: 64 items
    assert r.status == "ok", r.error
    assert r.output["ids"] == list(range(1, 65))
    assert any("bounded at 64 items" in n for n in r.notes)
    r = run(Counting(), LIST, max_array_items=None)
    assert r.status == "error" and r.error.code == "output_truncated"
