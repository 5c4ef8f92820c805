"""An extraction's confidence per field: the mean log-probability of the tokens the model chose for each
top-level value of the object, from the distribution it chose them from (the model's, over the tokens the
grammar allowed there).

Tokens the model did not choose carry none and are left out of the mean: those the grammar forced (a key, a
quote, the only value an enum leaves) and those kept from a draft of the input (each the model's best there,
its probability not read). A value with no chosen token at all (the grammar left one way to write it) has 0.0,
a probability of 1 under the grammar. A token that straddles a value's edge (``": "J``) counts for the value.

``exp(mean)`` is the geometric mean of the chosen tokens' probabilities; benchmarks/results/extract_quality.md
measures how well it predicts a right field (reliability by bins, ECE) on the labelled sets.
"""

from __future__ import annotations

import json

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


def value_spans(text: str) -> dict[str, tuple[int, int]]:
    """Each top-level key of the JSON object ``text`` and its value's span (characters), or {} when ``text`` is
    not an object. A key written twice keeps its last value, as ``json.loads`` does."""
    spans: dict[str, tuple[int, int]] = {}
    i = _skip(text, 0)
    if not text.startswith("{", i):
        return {}
    i = _skip(text, i + 1)
    try:
        while i < len(text) and text[i] != "}":
            key, i = _DECODER.raw_decode(text, i)
            i = _skip(text, i)
            if not text.startswith(":", i):
                return {}
            start = _skip(text, i + 1)
            _, end = _DECODER.raw_decode(text, start)
            spans[str(key)] = (start, end)
            i = _skip(text, end)
            if text.startswith(",", i):
                i = _skip(text, i + 1)
    except json.JSONDecodeError:
        return {}
    return spans


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def per_field(pieces: list[bytes], logprobs: list[float | None]) -> dict[str, float]:
    """Each top-level field's mean chosen-token log-probability (``pieces``: the output's tokens as bytes,
    ``logprobs``: each one's as chosen, None where the model did not choose it)."""
    data = b"".join(pieces)
    text = data.decode("utf-8", "replace")
    spans = value_spans(text)
    if not spans:
        return {}
    ends, at = [], 0
    for p in pieces:
        at += len(p)
        ends.append(at)
    out: dict[str, float] = {}
    for key, (start, end) in spans.items():
        lo, hi = len(text[:start].encode()), len(text[:end].encode())  # the span in bytes
        chosen = [lp for i, lp in enumerate(logprobs)
                  if lp is not None and ends[i] > lo and ends[i] - len(pieces[i]) < hi]
        out[key] = round(sum(chosen) / len(chosen), 6) if chosen else 0.0
    return out
