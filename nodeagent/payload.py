"""Untrusted JSON: what a queue entry, an HTTP body or a task holds before anything relies on it.

Python's ``json`` parses text nested thousands deep (until a ``RecursionError``), and keeps lone surrogates
(``"\\ud800"``) that no UTF-8 encoder can write back. Either one, deep inside a library, crashes whoever
touches the value next: a worker claiming it, pydantic serialising it, the validator walking it. So untrusted
JSON is parsed here once, with its nesting depth bounded and its strings checked, and a problem is a
``PayloadError`` (a ``ValueError``) that says what is wrong and where.
"""

from __future__ import annotations

import json
from typing import Any

# Nesting of arrays and objects, counting every level. A task's envelope is 2 levels (envelope, task) above
# its schema, and a JSON Schema takes 2 levels per level of the object it describes (properties, name): the
# deepest of the 2,786 real-world schemas of scripts/schema-corpus (Kubernetes, CloudFormation, SchemaStore)
# is 20 levels (SchemaStore's circle-ci), most are 4 to 8.
MAX_JSON_DEPTH = 64


class PayloadError(ValueError):
    """A payload that cannot be used as it is: not JSON, too deep, or holding text that is not Unicode."""


def loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse untrusted JSON; PayloadError when it is not JSON, is nested deeper than ``max_depth`` or holds a
    lone surrogate."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise PayloadError(f"nested deeper than {max_depth} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PayloadError(f"not JSON: {exc}") from None
    check(value, max_depth)
    return value


def check(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """PayloadError when ``value`` (parsed JSON, or anything made of dicts, lists and scalars) is nested deeper
    than ``max_depth`` or holds a string that is not valid Unicode. Iterative: no depth can overflow it."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            _text(node, path)
        elif isinstance(node, (dict, list)):
            if depth > max_depth:
                raise PayloadError(f"nested deeper than {max_depth} levels (at {_where(path)})")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                if isinstance(key, str):
                    _text(key, path)
                stack.append((child, depth + 1, f"{path}/{key}"))


def _text(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadError(f"a string holds a lone surrogate ({s[exc.start]!r} at {_where(path)}, character "
                           f"{exc.start}): it is not Unicode text") from None


def _where(path: str) -> str:
    return (path if len(path) <= 80 else "..." + path[-60:]) or "/"


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
