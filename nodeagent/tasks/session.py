"""The token-level view of a loaded model that tasks run on. Each backend provides one."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class TokenSession(Protocol):
    """Prompt once, read logits, extend or cut the sequence. The KV cache is reused across calls."""

    n_ctx: int
    n_vocab: int
    chat_template: str | None
    bos_text: str
    eos_text: str
    end_of_turn: int  # the token that ends an assistant turn (EOT, else EOS)
    eog_tokens: frozenset[int]

    def tokenize(self, text: str) -> list[int]:
        """Tokens of a rendered prompt (special tokens parsed; a BOS added only if the model wants one
        and the text does not start with it)."""

    def tokenize_continuation(self, text: str) -> list[int]:
        """Tokens of text that follows other text (no BOS)."""

    def detokenize(self, tokens: list[int]) -> str: ...

    def reset(self) -> None: ...

    def prefill(self, tokens: list[int]) -> np.ndarray:
        """Make the sequence exactly ``tokens`` and return the logits after the last one, evaluating
        only what differs from the sequence already in the KV cache (a shared system prompt is reused)."""

    def truncate(self, n_tokens: int) -> None:
        """Keep the first n_tokens of the sequence; the next eval continues from there."""

    def eval(self, tokens: list[int]) -> np.ndarray:
        """Append tokens; return the logits (float32, n_vocab) after the last one."""

    def lltokenizer(self) -> Any:
        """The vocabulary as an llguidance tokenizer (cached), for constrained decoding."""


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
