"""A fake backend: the other side of the boundary for worker, broker and server tests.

It implements the same protocol as llama.cpp and MLX (``load(plan)`` returns a
model whose ``session()`` is a ``TokenSession``), so tasks run through the real
``TaskRunner``: prompts, constrained decoding under llguidance, validation and
Result building are the real ones; only the logits are made up. They are a
deterministic function of the tokens so far, over a byte vocabulary with two
ChatML turn tokens: the same task always gets the same Result, and different
inputs get different labels.

Configured by the model spec, so a worker in another process can be told:
``fake`` or ``fake:latency_ms=100,fail=[fail],crash=[crash]``.
- ``latency_ms``: each task's prompt takes this long (the model "thinks").
- ``token_ms``: each generated token takes this long (a stream comes piece by piece).
- ``ramble=1``: the end of generation is never the likeliest token (an answer runs to its max_tokens).
- ``fail``: a task whose input contains this text fails with a retryable backend error.
- ``crash``: a task whose input contains this text ends the process at once (exit 70), as a
  killed worker would: for tests of leases and reclaim.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

import numpy as np

from nodeagent.backends.base import ModelHandle
from nodeagent.backends.session import common_prefix, eval_each, eval_tree_sequential
from nodeagent.clock import pause
from nodeagent.errors import BackendError, UsageError
from nodeagent.planner.types import Plan, ctx_per_slot
from nodeagent.values import Frozen

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIALS = (IM_START, IM_END)
N_BYTES = 256
N_VOCAB = N_BYTES + len(SPECIALS)
EOS = N_BYTES + 1  # <|im_end|>
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _preferences() -> np.ndarray:
    """A fixed taste: closing quotes and brackets first (strings and numbers stay short, objects close),
    then lower-case letters, digits, the rest."""
    base = np.full(N_VOCAB, -4.0, dtype=np.float32)
    for ch in "abcdefghijklmnopqrstuvwxyz":
        base[ord(ch)] = 2.0
    for ch in "0123456789":
        base[ord(ch)] = 1.0
    for ch, score in (('"', 8.0), ("}", 7.0), ("]", 6.5), (",", 1.5), (" ", 0.5), (":", 0.5)):
        base[ord(ch)] = score
    base[EOS] = 9.0
    return base


PREFERENCES = _preferences()
# made-up logits: the fixed taste plus one of 1024 fixed noise rows, picked by a hash of the tokens so far
NOISE = np.random.default_rng(0).standard_normal((1024, N_VOCAB)).astype(np.float32)


class FakeSpec(Frozen):
    spec: str = "fake"
    latency_s: float = 0.0
    token_s: float = 0.0
    ramble: bool = False
    fail: str | None = None
    crash: str | None = None
    ctx_per_slot: int = 4096
    mem_bytes: int = 0  # the plan's made-up memory (tests of a node's model set)

    @classmethod
    def parse(cls, spec: str) -> "FakeSpec":
        """``fake`` or ``fake:key=value,...``."""
        name, _, rest = spec.partition(":")
        if name != "fake":
            raise UsageError(f"{spec!r} is not a fake model spec", hint="use fake or fake:latency_ms=100,fail=TEXT")
        values: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                raise UsageError(f"fake model option {item!r} has no value", hint="write key=value")
            if key == "latency_ms":
                values["latency_s"] = float(value) / 1000
            elif key == "token_ms":
                values["token_s"] = float(value) / 1000
            elif key == "ramble":
                values["ramble"] = value not in ("0", "false", "no")
            elif key in ("fail", "crash"):
                values[key] = value
            elif key == "ctx":
                values["ctx_per_slot"] = int(value)
            elif key == "mem_mb":
                values["mem_bytes"] = int(float(value) * (1 << 20))
            else:
                raise UsageError(f"unknown fake model option {key!r}",
                                 hint="known: latency_ms, token_ms, ramble, fail, crash, ctx, mem_mb")
        return cls(spec=spec, **values)


def is_fake(spec: str) -> bool:
    return spec == "fake" or spec.startswith("fake:")


def read_fake(spec: str, config: Any = None, quant: str | None = None) -> tuple["FakeSpec", list[str]]:
    """What the planner needs of a fake model: its spec (the backend registry's ``read`` for the fake)."""
    return FakeSpec.parse(spec), []


class _Tokens:
    """The vocabulary as llguidance's TokenizerWrapper wants it (special tokens marked with 0xFF)."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [bytes([b]) for b in range(N_BYTES)] + [b"\xff" + s.encode() for s in SPECIALS]
    special_token_ids = list(range(N_BYTES, N_VOCAB))

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


class FakeSession:
    """A TokenSession whose logits are a fixed function of the token sequence."""

    n_vocab = N_VOCAB
    bos_text = ""
    eos_text = IM_END
    eog_tokens = frozenset({EOS})

    def __init__(self, spec: FakeSpec, ctx_per_slot: int) -> None:
        self.spec, self.ctx_per_slot = spec, ctx_per_slot
        self.chat_template: str | None = CHATML
        self._tokens: list[int] = []
        self._ll: Any = None

    def tokenize(self, text: str) -> list[int]:
        out: list[int] = []
        i = 0
        while i < len(text):
            special = next((k for k, s in enumerate(SPECIALS) if text.startswith(s, i)), None)
            if special is not None:
                out.append(N_BYTES + special)
                i += len(SPECIALS[special])
                continue
            j = min((p for s in SPECIALS if (p := text.find(s, i)) >= 0), default=len(text))
            out.extend(text[i:j].encode("utf-8"))
            i = j
        return out

    tokenize_continuation = tokenize

    def has_token(self, text: str) -> bool:
        return text in SPECIALS or len(text.encode("utf-8")) == 1

    def detokenize(self, tokens: list[int]) -> str:
        data = b"".join(bytes([t]) if t < N_BYTES else SPECIALS[t - N_BYTES].encode() for t in tokens)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if token < N_BYTES else SPECIALS[token - N_BYTES].encode()

    def eval_all(self, tokens: list[int]) -> list[np.ndarray]:
        return eval_each(self, tokens)

    def reset(self) -> None:
        self._tokens = []

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    def truncate(self, n_tokens: int) -> None:
        del self._tokens[n_tokens:]

    def prefill(self, tokens: list[int]) -> np.ndarray:
        text = self.detokenize(tokens)
        if self.spec.crash and self.spec.crash in text:
            os._exit(70)  # a worker killed mid-task: nothing is written, nothing is cleaned up
        if self.spec.fail and self.spec.fail in text:
            raise BackendError("injected failure (fake backend)")
        if self.spec.latency_s:
            pause(self.spec.latency_s)
        keep = min(common_prefix(self._tokens, tokens), len(tokens) - 1)
        self.truncate(keep)
        return self.eval(tokens[keep:])

    def eval(self, tokens: list[int]) -> np.ndarray:
        if len(self._tokens) + len(tokens) > self.ctx_per_slot:
            raise BackendError(f"the fake context of {self.ctx_per_slot} tokens is full")
        if self.spec.token_s and len(tokens) == 1:  # a decoding step
            pause(self.spec.token_s)
        self._tokens.extend(tokens)
        logits = self._logits()
        if self.spec.ramble:
            logits = logits.copy()
            logits[EOS] = -100.0
        return logits

    def eval_tree(self, parents: list[int], tokens: list[int]) -> list[np.ndarray]:
        return eval_tree_sequential(self, parents, tokens)

    def _logits(self) -> np.ndarray:
        # noise seeded by the prompt's own text (up to the assistant turn), so inputs differ, steps repeat
        digest = hashlib.blake2b(np.asarray(self._tokens, dtype=np.int32).tobytes(), digest_size=8).digest()
        return PREFERENCES + NOISE[int.from_bytes(digest, "little") % len(NOISE)]

    def lltokenizer(self) -> Any:
        if self._ll is None:
            import llguidance

            self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens()))
        return self._ll


class FakeModel(ModelHandle):
    name = "fake"

    def __init__(self, spec: FakeSpec, n_ctx: int, slots: int = 1) -> None:
        # slots: independent sessions of n_ctx / slots tokens each (nothing is shared: it is made up anyway)
        self._slots: list[FakeSession] | None = [FakeSession(spec, ctx_per_slot(n_ctx, slots)) for _ in range(slots)]

    def session(self) -> FakeSession:
        return self.sessions()[0]

    def sessions(self, adapt_threads: bool = False) -> list[FakeSession]:
        if self._slots is None:
            raise BackendError("the model is closed")
        return list(self._slots)

    def close(self) -> None:
        self._slots = None


class FakeBackend:
    name = "fake"

    def available(self) -> bool:
        return True

    def prompt_tokens(self, model_path: str, count: Callable[[Any], int]) -> int | None:
        return None  # it cannot tell without loading the model

    def load(self, plan: Plan) -> FakeModel:
        return FakeModel(FakeSpec.parse(plan.settings.model_path), plan.settings.n_ctx, plan.settings.slots)
