"""Values copied from the input: a string field whose value must be a span of the task's text (a name, an e-mail,
a phone number, a place), so a small model cannot invent one. The grammar spells the object's top level in Lark
with each copied field's value as an llguidance substring lexeme over the input (``substring_words``: a run of
whole words of the text, within the field's length bound), and every other field's value as the ``%json`` of its
own schema, in the compact style extraction writes (``schema.JSON_STYLE``).

Which fields copy: a field whose schema says ``"x-nodeagent": {"copy": true}`` (or ``false``, never), and by the
task's ``copy`` mode: ``none``, ``all`` (every plain string field), or ``auto`` (plain string fields whose name or
format says they are a span: names, e-mails, phones, places, companies). A field with an ``enum``, a ``const``, a
``pattern`` or a ``format`` other than ``email`` is never copied (its value is normalised, not quoted). A copied
field whose schema allows null can still be null, so a value the text lacks stays expressible. A span never holds
a quote, a backslash or a line break (they become spaces in the text spans are taken from).

Where the top level is not an object of properties all required (the order and presence a Lark sequence spells),
nothing is copied, and a note says why where the task asked for copying (a mode, or a field marked).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from nodeagent.tasks.schema import JSON_STYLE

KEYWORD = "x-nodeagent"
# the copy mode of a task that names none. Measured (benchmarks/results/extract_quality.md): copying the span fields
# made contact extraction more accurate and faster, and changed nothing measurable on orders
DEFAULT = "auto"
SPAN_NAMES = re.compile(r"(^|_)(name|names|first|last|surname|person|contact|customer|client|company|employer|org"
                        r"|organi[sz]ation|email|e_?mail|mail|phone|tel|telephone|mobile|city|town|country|place"
                        r"|location|address|street|region|state|venue|title|product|item)($|_)", re.I)
NOT_COPIED = ("enum", "const", "pattern")


@dataclass(frozen=True)
class Copies:
    fields: tuple[str, ...]  # the top-level properties whose values are spans of the input
    note: str | None = None  # why nothing was copied where something was asked for


def _plain_string(schema: Any) -> bool:
    if not isinstance(schema, dict) or any(k in schema for k in NOT_COPIED):
        return False
    if schema.get("format") not in (None, "email"):
        return False
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    return "string" in kinds and set(kinds) <= {"string", "null"}


def choose(schema: dict[str, Any], mode: str, asked: bool = True) -> Copies:
    """The fields a task's ``copy`` mode (and the schema's own ``x-nodeagent`` marks) copy from the input.
    ``asked``: the task named its mode (or a field is marked), so a schema that cannot copy gets a note; under the
    default mode it copies where it can, silently."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return Copies(())
    picked = []
    for name, sub in props.items():
        mark = sub.get(KEYWORD, {}).get("copy") if isinstance(sub, dict) and isinstance(sub.get(KEYWORD), dict) \
            else None
        if mark is False or not _plain_string(sub):
            continue
        if mark is True or mode == "all" or (mode == "auto" and (SPAN_NAMES.search(name) or
                                                                  sub.get("format") == "email")):
            picked.append(name)
            asked = asked or mark is True
    if not picked:
        return Copies(())
    required = set(schema.get("required") or [])
    if set(props) != required or schema.get("additionalProperties", False) not in (False, None) or \
            any(k in schema for k in ("patternProperties", "anyOf", "oneOf", "allOf", "$ref")):
        return Copies((), f"copy: {', '.join(picked)} not copied from the input (copying needs a top-level object "
                          "whose properties are all required and no others)" if asked else None)
    return Copies(tuple(picked))


EMAIL = r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(\.[A-Za-z0-9\-]+)+"  # what a copied e-mail must also look like
# a span starts at a letter, a digit, "+" or "(" and ends at a letter, a digit or ")": no stray punctuation or space
WORDY = r"/[\p{L}\p{N}+(]((.|\n)*[\p{L}\p{N})])?/"


def _bounds(schema: dict[str, Any], longest_span: int) -> str:
    """What a copied value must also match: its length bounds (those a span of the text could break), its
    e-mail format."""
    out = " & " + WORDY
    low, high = schema.get("minLength"), schema.get("maxLength")
    low = low if isinstance(low, int) and low > 1 else None
    high = high if isinstance(high, int) and high < longest_span else None
    if low is not None or high is not None:
        out += f" & /(.|\\n){{{low or 1},{high if high is not None else ''}}}/"
    if schema.get("format") == "email":
        out += f" & /{EMAIL}/"
    return out


def spannable(text: str) -> str:
    """The text spans are taken from: what a JSON string holds as it is (quotes, backslashes and control
    characters, which it would escape, become spaces, so no span can end inside an escape)."""
    return re.sub(r'["\\\x00-\x1f\x7f]', " ", text)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def grammar(decoder_schema: dict[str, Any], copies: Copies, text: str) -> tuple[str, list[str]]:
    """The llguidance grammar (Lark) for the decoder's schema with ``copies``' fields spans of ``text``, and notes
    for the fields that could not be (an e-mail the text does not hold, where the schema wants one)."""
    props = decoder_schema["properties"]
    source = spannable(text)
    rules, parts, notes = [], [], []
    for i, (name, sub) in enumerate(props.items()):
        key = _lit(("{" if i == 0 else ", ") + _lit(name) + ": ")
        parts.append(f"{key} v{i}")
        kinds = sub.get("type") if isinstance(sub, dict) else None
        nullable = "null" in ([kinds] if isinstance(kinds, str) else list(kinds or []))
        copied = name in copies.fields
        if copied and sub.get("format") == "email" and not nullable and not re.search(EMAIL, source):
            copied = False
            notes.append(f"copy: {name} not copied (the text holds no e-mail address, and the schema wants one)")
        if copied:
            bound = _bounds(sub, len(source))
            rules.append(f"S{i}: %regex {json.dumps({'substring_words': source}, ensure_ascii=False)}{bound}")
            empty = not nullable and not sub.get("format") and not (isinstance(sub.get("minLength"), int)
                                                                      and sub["minLength"] > 0)
            rules.append(f"v{i}: \"\\\"\" S{i} \"\\\"\"" + (' | "null"' if nullable else "")
                         + (' | "\\\"\\\""' if empty else ""))
        else:
            own = {k: v for k, v in sub.items() if k != KEYWORD} if isinstance(sub, dict) else sub
            if isinstance(own, dict):
                own = {**own, "x-guidance": JSON_STYLE}
            rules.append(f"v{i}: %json {json.dumps(own, ensure_ascii=False)}")
    start = "start: " + " ".join(parts) + ' "}"' if parts else 'start: "{}"'
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark("\n".join([start, *rules]) + "\n"), notes
