"""Untrusted JSON: what a queue entry, an HTTP body or a task holds before anything relies on it.

Python's ``json`` parses text nested thousands deep (until a ``RecursionError``), and keeps lone surrogates
(``"\\ud800"``) that no UTF-8 encoder can write back. Either one, deep inside a library, crashes whoever
touches the value next: a worker claiming it, pydantic serialising it, the validator walking it. So untrusted
JSON is parsed here once, with its nesting depth bounded and its strings checked, and a problem is a
``PayloadError`` (a ``ValueError``) that says what is wrong and where.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Nesting of arrays and objects, counting every level. A task's envelope is 2 levels (envelope, task) above
# its schema, and a JSON Schema takes 2 levels per level of the object it describes (properties, name): the
# deepest of the 2,786 real-world schemas of scripts/schema-corpus (Kubernetes, CloudFormation, SchemaStore)
# is 20 levels (SchemaStore's circle-ci), most are 4 to 8.
MAX_JSON_DEPTH = 64


class PayloadError(ValueError):
    """A payload that cannot be used as it is: not JSON, too deep, or holding text that is not Unicode."""


def _number(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise PayloadError(f"the number {text[:40]} is out of range")
    return value


def _constant(name: str) -> Any:
    raise PayloadError(f"{name} is not JSON")


def loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse untrusted JSON; PayloadError when it is not JSON (NaN and Infinity are not), is nested deeper than
    ``max_depth``, holds a lone surrogate (escaped, or written as bytes), an integer past Python's bound on digits
    (4,300: its parser's own ValueError, answered here in one line) or a number out of range."""
    binary = isinstance(text, (bytes, bytearray))
    text = _decoded(text) if binary else text
    try:
        value = json.loads(text, parse_float=_number, parse_constant=_constant)
    except RecursionError:
        raise PayloadError(f"nested deeper than {max_depth} levels") from None
    except PayloadError:
        raise
    except json.JSONDecodeError as exc:
        raise PayloadError(f"not JSON: {exc}") from None
    except ValueError as exc:  # an integer past the digits Python takes, or whatever else: one line, no traceback
        raise PayloadError(f"cannot be read: {' '.join(str(exc).split())[:200]}") from None
    # what the text itself rules out is not walked: fewer brackets than the depth allowed, no lone surrogate (bytes
    # decoded here strictly hold none, so only a \uD800-\uDFFF escape makes one; a caller's str is checked whole)
    deep = text.count("[") + text.count("{") > max_depth
    escapes = _SURROGATE_ESCAPE.search(text) is not None or not (binary or _unicode(text))
    if deep or escapes:
        check(value, max_depth, strings=escapes)
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _decoded(raw: bytes | bytearray) -> str:
    """The text of a JSON document's bytes, in the encoding ``json`` detects (UTF-8, -16 or -32, a BOM or none),
    decoded strictly. ``json.loads`` decodes bytes with 'surrogatepass', so a lone surrogate written as bytes (CESU-8's
    ``ed a0 80``, an unpaired UTF-16 half, a UTF-32 unit in D800-DFFF) would pass into a str that nothing can encode
    again: here it is a PayloadError, and bytes that are no text at all are "not JSON"."""
    encoding = json.detect_encoding(raw)
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        if _surrogates_only(raw, encoding):
            raise PayloadError(f"the {encoding} bytes hold a lone surrogate at byte {exc.start} (half of a UTF-16 "
                               "pair, encoded alone): it is not Unicode text; encode each character whole") from None
        raise PayloadError(f"not JSON: the bytes are not {encoding} text ({exc.reason} at byte {exc.start})") from None


def _surrogates_only(raw: bytes | bytearray, encoding: str) -> bool:
    """Whether the only fault of ``raw`` as ``encoding`` is lone surrogates (only ever asked of bytes a strict decode
    refused)."""
    try:
        raw.decode(encoding, "surrogatepass")
    except UnicodeDecodeError:
        return False
    return True


def _unicode(text: str) -> bool:
    """Whether ``text`` is Unicode text (no lone surrogate in it): ASCII at once, else encoded in C."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check(value: Any, max_depth: int = MAX_JSON_DEPTH, strings: bool = True) -> None:
    """PayloadError when ``value`` (parsed JSON, or anything made of dicts, lists and scalars) is nested deeper
    than ``max_depth`` or (``strings``) holds a string that is not valid Unicode. Iterative: no depth can overflow
    it; a node's path is spelled out only for the error (a walk of two million items costs no string for each)."""
    if isinstance(value, str):
        if strings:
            _text(value, None)
        return
    stack: list[tuple[Any, int, Any]] = [(value, 1, None)]
    while stack:
        node, depth, where = stack.pop()
        if depth > max_depth:
            raise PayloadError(f"nested deeper than {max_depth} levels (at {_where(where)})")
        pairs = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in pairs:
            if strings and type(key) is str and not key.isascii():
                _text(key, where)
            kind = type(child)
            if kind is str:
                if strings and not child.isascii():
                    _text(child, (where, key))
            elif kind is dict or kind is list or isinstance(child, (dict, list)):
                stack.append((child, depth + 1, (where, key)))


def _text(s: str, where: Any) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadError(f"a string holds a lone surrogate ({s[exc.start]!r} at {_where(where)}, character "
                           f"{exc.start}): it is not Unicode text") from None


def _where(where: Any) -> str:
    """A node's path (``(parent, key)`` pairs) spelled as /a/0/b, its end kept when long."""
    keys: list[str] = []
    while where is not None:
        where, key = where
        keys.append(str(key))
    path = "/" + "/".join(reversed(keys)) if keys else "/"
    return path if len(path) <= 80 else "..." + path[-60:]


def printable(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with anything UTF-8 cannot hold escaped: safe to store and show."""
    return text[:limit].encode("utf-8", "backslashreplace").decode("utf-8")


def depth(value: Any) -> int:
    """The nesting depth of arrays and objects (a scalar is 0)."""
    best = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            best = max(best, d)
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            best = max(best, d)
            stack.extend((v, d + 1) for v in node)
    return best
