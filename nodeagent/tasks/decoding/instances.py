"""The smallest instances of a JSON Schema, as the decoder writes them: what closes an answer is made of them.

``Schemas`` resolves a schema's alternatives (``$ref``, ``anyOf``/``oneOf``, ``allOf`` merged where simple) and
answers the shortest valid text of each (``minimal``): a string's ``minLength`` of "a", the shortest of a simple
``pattern`` or a known ``format``, a number within its bounds, the required keys with their smallest values,
``minItems`` items. Where the schema says more than this reading follows, it is an estimate, which the decoder
checks against the grammar before it relies on it. Pure: no I/O, no model.
"""

from __future__ import annotations

import json
import re
from typing import Any

ANY: dict[str, Any] = {}
NUMBER_TEXT = re.compile(rb"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
NUMBER_BYTES = frozenset(b"0123456789.eE+-")
FORMATS = {"date": "2000-01-01", "date-time": "2000-01-01T00:00:00Z", "time": "00:00:00Z", "email": "a@a.aa",
           "uuid": "00000000-0000-0000-0000-000000000000", "ipv4": "0.0.0.0", "ipv6": "::", "uri": "a:",
           "hostname": "a", "duration": "P0D"}
_MAX_DEPTH = 24


def dumps(value: Any) -> str:
    """A value as the decoder writes it (compact style, UTF-8 as is)."""
    return json.dumps(value, ensure_ascii=False)


class Schemas:
    """A schema's alternatives and smallest instances, ``$ref`` resolved against its root (memoised)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._min: dict[int, tuple[Any, str | None]] = {}  # id -> (the schema, kept alive; its text)

    def resolve(self, ref: str) -> Any:
        node = self.root
        for part in ref.lstrip("#").strip("/").split("/") if ref not in ("#", "") else []:
            node = node[part.replace("~1", "/").replace("~0", "~")]
        return node

    def alts(self, schema: Any, depth: int = 0) -> list[dict[str, Any]]:
        """The schemas a value may satisfy, one per alternative (``anyOf``/``oneOf`` flattened, type lists split)."""
        if schema is True or schema is None:
            return [ANY]
        if schema is False or not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return [] if schema is False else [ANY]
        if "$ref" in schema:
            return self.alts(self.resolve(schema["$ref"]), depth + 1)
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                return [a for option in schema[key] for a in self.alts(option, depth + 1)]
        if isinstance(schema.get("type"), list):
            return [{**schema, "type": t} for t in schema["type"]]
        return [schema]

    def minimal(self, schema: dict[str, Any], depth: int = 0) -> str | None:
        """The shortest instance's text, or None when the schema admits none this reading can tell."""
        known = self._min.get(id(schema))
        if known is None or known[0] is not schema:
            known = (schema, None if depth > _MAX_DEPTH else self._minimal(schema, depth))
            self._min[id(schema)] = known
        return known[1]

    def minimal_of(self, schemas: list[dict[str, Any]], depth: int = 0) -> str | None:
        return shortest(self.minimal(s, depth + 1) for s in schemas)

    def _minimal(self, s: dict[str, Any], depth: int) -> str | None:
        if "const" in s:
            return dumps(s["const"])
        if isinstance(s.get("enum"), list):
            return shortest(dumps(v) for v in s["enum"])
        kind = kind_of(s)
        if kind == "object":
            parts = []
            for name in required_in_order(s):
                value = self.minimal_of(self.alts(prop_schema(s, name)), depth)
                if value is None:
                    return None
                parts.append(f"{dumps(name)}: {value}")
            return "{" + ", ".join(parts) + "}"
        if kind == "array":
            n = int(s.get("minItems", 0) or 0)
            if not n:
                return "[]"
            item = self.minimal_of(self.alts(s.get("items", True)), depth)
            return None if item is None else "[" + ", ".join([item] * n) + "]"
        if kind == "string":
            return dumps(string_example(s))
        if kind in ("integer", "number"):
            return number_example(s, kind)
        if kind == "boolean":
            return "true"
        if kind == "null":
            return "null"
        return "0"  # any value: the shortest JSON there is


def shortest(texts: Any) -> str | None:
    best = None
    for t in texts:
        if t is not None and (best is None or len(t.encode()) < len(best.encode())):
            best = t
    return best


def kind_of(s: dict[str, Any]) -> str:
    kind = s.get("type")
    if isinstance(kind, str):
        return kind
    if "properties" in s or "required" in s or "additionalProperties" in s:
        return "object"
    if "items" in s or "prefixItems" in s:
        return "array"
    return "any"


def prop_schema(s: dict[str, Any], name: str) -> Any:
    props = s.get("properties") or {}
    if name in props:
        return props[name]
    extra = s.get("additionalProperties", True)
    return extra if extra is not False else False


def required_in_order(s: dict[str, Any]) -> list[str]:
    props = list((s.get("properties") or {}).keys())
    required = [r for r in s.get("required", []) if isinstance(r, str)]
    return [p for p in props if p in required] + [r for r in required if r not in props]


def string_example(s: dict[str, Any]) -> str:
    """A short string the schema admits: its format's, its simple pattern's, else ``minLength`` letters."""
    if s.get("format") in FORMATS:
        return FORMATS[s["format"]]
    if isinstance(s.get("pattern"), str):
        example = pattern_example(s["pattern"])
        if example is not None:
            return example
    return "a" * int(s.get("minLength", 0) or 0)


def number_example(s: dict[str, Any], kind: str) -> str:
    """The number nearest 0 within the bounds (an exclusive bound stepped over by 1, or halfway to the other)."""
    import math

    lo, hi = s.get("minimum"), s.get("maximum")
    xlo, xhi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    if isinstance(xlo, (int, float)) and not isinstance(xlo, bool) and (lo is None or xlo >= lo):
        lo = xlo + 1 if hi is None or xlo + 1 <= hi else (xlo + hi) / 2
    if isinstance(xhi, (int, float)) and not isinstance(xhi, bool) and (hi is None or xhi <= hi):
        hi = xhi - 1 if lo is None or xhi - 1 >= lo else (xhi + lo) / 2
    value: float = 0
    if isinstance(lo, (int, float)) and value < lo:
        value = math.ceil(lo) if kind == "integer" else lo
    if isinstance(hi, (int, float)) and value > hi:
        value = math.floor(hi) if kind == "integer" else hi
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def pattern_example(pattern: str) -> str | None:
    """The shortest string a simple regular expression matches (literals, classes, fixed repeats,
    alternations, anchors), or None for anything else."""
    try:
        import re._parser as sre  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover (Python before 3.11)
        import sre_parse as sre  # type: ignore[no-redef]
    try:
        parsed = sre.parse(pattern)
    except Exception:  # noqa: BLE001  (a pattern Python cannot read: no example)
        return None
    return _example(parsed, sre)


def _example(items: Any, sre: Any) -> str | None:
    out = []
    for op, arg in items:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(arg))
        elif name == "ANY":
            out.append("a")
        elif name == "IN":
            ch = _class_member(arg)
            if ch is None:
                return None
            out.append(ch)
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, _high, sub = arg
            piece = _example(sub, sre)
            if piece is None:
                return None
            out.append(piece * low)
        elif name == "SUBPATTERN":
            piece = _example(arg[-1], sre)
            if piece is None:
                return None
            out.append(piece)
        elif name == "BRANCH":
            options = [_example(b, sre) for b in arg[1]]
            best = shortest(options)
            if best is None:
                return None
            out.append(best)
        elif name == "AT":
            continue
        else:
            return None
    return "".join(out)


def _class_member(items: Any) -> str | None:
    for op, arg in items:
        name = str(op)
        if name == "NEGATE":
            return None
        if name == "LITERAL":
            return chr(arg)
        if name == "RANGE":
            return chr(arg[0])
        if name == "CATEGORY":
            return {"CATEGORY_DIGIT": "0", "CATEGORY_WORD": "a", "CATEGORY_SPACE": " "}.get(str(arg))
    return None


def schema_values(s: dict[str, Any]) -> list[Any]:
    if "const" in s:
        return [s["const"]]
    if isinstance(s.get("enum"), list):
        return list(s["enum"])
    return []


def admits(m: Schemas, schema: Any, value: Any) -> bool:
    for s in m.alts(schema):
        vals = schema_values(s)
        if vals:
            if value in vals:
                return True
            continue
        kind = kind_of(s)
        if kind == "any" or (kind == "string" and isinstance(value, str)) or \
                (kind in ("number", "integer") and isinstance(value, (int, float)) and not isinstance(value, bool)) or \
                (kind == "boolean" and isinstance(value, bool)) or (kind == "null" and value is None):
            return True
    return False
