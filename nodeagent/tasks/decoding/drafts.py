"""Drafts from the input: what an extraction copies from its text, guessed before the model writes it.

An extraction's string values are mostly spans of its input ("Ana Lima", "ana.lima@example.org"). Once a value's
last few characters are found in the prompt, the text that follows them there is a likely continuation: its
tokens are a draft that the model checks in one step (``SlotSession.eval_draft``), keeping the longest prefix
it would have written anyway (prompt-lookup decoding). The decoder cuts the draft where the grammar rejects it
before it is evaluated.
"""

from __future__ import annotations

from typing import Any

MIN_MATCH_CHARS = 3  # a value's tail shorter than this says too little about where in the input it is
MAX_MATCH_CHARS = 48  # the longest tail looked for
LOOKAHEAD_CHARS = 96  # the input's text after the match that is tokenized for the draft


class InputDrafts:
    """Drafts for one decode: the prompt's text, searched for the end of the string value being written."""

    def __init__(self, session: Any, prompt_text: str) -> None:
        self.session, self.text = session, prompt_text

    def propose(self, value: str, k: int) -> list[int]:
        """Up to ``k`` tokens that follow the longest tail of ``value`` found in the prompt (its last occurrence:
        the input comes after the instructions); none when no tail of MIN_MATCH_CHARS is found."""
        if k <= 0 or len(value) < MIN_MATCH_CHARS:
            return []
        for n in range(min(len(value), MAX_MATCH_CHARS), MIN_MATCH_CHARS - 1, -1):
            at = self.text.rfind(value[-n:])
            if at >= 0:
                break
        else:
            return []
        start = at + n
        ahead = self.text[start:start + LOOKAHEAD_CHARS]
        if not ahead:
            return []
        tokens = self.session.tokenize_continuation(ahead)
        if start + LOOKAHEAD_CHARS < len(self.text):  # the text was cut: its last token may be a word's start
            tokens = tokens[:-1]
        return tokens[:k]
