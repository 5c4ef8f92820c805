"""The shortest way to end a JSON answer from where its text stands, under its schema.

A decoder that must stop at ``max_tokens`` and still hand back a valid object keeps room, at every token, for
the text that would close what is open: the string being written, the required keys not yet written, the
array's missing items, the closing brackets. ``JsonCloser`` follows the answer's bytes as the decoder writes them
(the project's compact JSON style: ``", "`` between items, ``": "`` after keys, properties in the schema's order,
as llguidance enforces them) and answers ``closing()``: that text, or None when nothing valid can follow (an
array already at the items it may hold).

The text is a minimal *instance*: a string's missing characters (its ``minLength``, the rest of a ``const`` or
``enum`` value it began, the shortest string of a simple ``pattern`` or a known ``format``), a number's missing
digit, the required keys with their schemas' smallest values, ``minItems`` items. Where the schema says more than
this reading follows (a pattern a string has begun, ``allOf``), it is an estimate, which the decoder checks
against the grammar before it relies on it. Pure: no I/O, no model.
"""

from __future__ import annotations

import json
import re
from typing import Any

ANY: dict[str, Any] = {}
_NUMBER = re.compile(rb"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NUMBER_BYTES = frozenset(b"0123456789.eE+-")
_FORMATS = {"date": "2000-01-01", "date-time": "2000-01-01T00:00:00Z", "time": "00:00:00Z", "email": "a@a.aa",
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
        return _shortest(self.minimal(s, depth + 1) for s in schemas)

    def _minimal(self, s: dict[str, Any], depth: int) -> str | None:
        if "const" in s:
            return dumps(s["const"])
        if isinstance(s.get("enum"), list):
            return _shortest(dumps(v) for v in s["enum"])
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


def _shortest(texts: Any) -> str | None:
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
    if s.get("format") in _FORMATS:
        return _FORMATS[s["format"]]
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
            best = _shortest(options)
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


# -- following the text ---------------------------------------------------------------------------------------
class _Frame:
    __slots__ = ("kind", "alts", "state", "start", "key", "keys", "buf", "count", "consts", "items", "sep")

    def __init__(self, kind: str, alts: list[dict[str, Any]], start: int) -> None:
        self.kind = kind  # object | array | string | key | number | literal | root
        self.alts = alts
        self.state = "start"
        self.start = start  # offset of the value's first byte
        self.key: str | None = None  # object: the key being written or just written
        self.keys: list[str] = []  # object: the keys written
        self.buf = bytearray()  # string, key, number, literal: the bytes so far (a string's raw, escapes as written)
        self.count = 0  # array: items complete
        self.consts: list[bytes] = []  # string/number/literal: the whole texts a const or enum value could be
        self.items: list[bytes] | None = None  # array: the complete items' texts, when watched
        self.sep = 0  # bytes of a separator written (", " or ": ")

    def copy(self) -> "_Frame":
        f = _Frame(self.kind, self.alts, self.start)
        f.state, f.key, f.keys, f.buf, f.count = self.state, self.key, list(self.keys), bytearray(self.buf), self.count
        f.consts, f.items, f.sep = self.consts, (list(self.items) if self.items is not None else None), self.sep
        return f


class JsonCloser:
    """Follows one JSON value's bytes (``feed``) and says the shortest text that completes it (``closing``).

    ``watch``: a schema node (by identity) whose arrays' complete items are kept, for a caller that must know them
    (the calls of a tool answer); ``cap``: how many items such an array may still come to hold."""

    def __init__(self, schema: Any, watch: Any = None, schemas: Schemas | None = None) -> None:
        self.schemas = schemas or Schemas(schema)
        self.watch = watch
        self.cap: int | None = None
        self.data = bytearray()
        self.frames: list[_Frame] = [_Frame("root", self.schemas.alts(schema), 0)]
        self.done = False
        self.broken = False  # bytes this reading cannot follow: closing() is None from then on
        self.items: list[bytes] = []  # the watched array's complete items
        self.repeat_from: int | None = None  # set when an item repeats an earlier one: where it began

    def copy(self) -> "JsonCloser":
        c = JsonCloser.__new__(JsonCloser)
        c.schemas, c.watch, c.cap, c.data = self.schemas, self.watch, self.cap, bytearray(self.data)
        c.frames = [f.copy() for f in self.frames]
        c.done, c.broken = self.done, self.broken
        c.items, c.repeat_from = list(self.items), self.repeat_from
        return c

    # -- reading ------------------------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        for b in data:
            if self.broken:
                return
            self.data.append(b)
            self._byte(b, len(self.data) - 1)

    def _byte(self, b: int, at: int) -> None:
        top = self.frames[-1]
        kind = top.kind
        if kind in ("string", "key"):
            self._string_byte(top, b)
        elif kind == "number":
            if b in _NUMBER_BYTES:
                top.buf.append(b)
            else:
                self._pop_value()
                self._byte(b, at)
        elif kind == "literal":
            top.buf.append(b)
            target = top.consts[0]
            if not target.startswith(bytes(top.buf)):
                self.broken = True
            elif len(top.buf) == len(target):
                self._pop_value()
        elif kind == "object":
            self._object_byte(top, b, at)
        elif kind == "array":
            self._array_byte(top, b, at)
        else:  # root
            if top.state == "start":
                self._begin_value(top.alts, b, at)
                top.state = "in"
            else:
                self.broken = True  # nothing may follow the value

    def _string_byte(self, top: _Frame, b: int) -> None:
        if top.state == "escape":
            top.buf.append(b)
            top.state = "unicode" if b == ord("u") else "start"
            top.sep = 0
            return
        if top.state == "unicode":
            top.buf.append(b)
            top.sep += 1
            if top.sep == 4:
                top.state = "start"
            return
        if b == ord("\\"):
            top.buf.append(b)
            top.state = "escape"
            return
        if b == ord('"'):
            if top.kind == "key":
                key = bytes(top.buf).decode("utf-8", "replace")
                self.frames.pop()
                parent = self.frames[-1]
                parent.key, parent.state, parent.sep = key, "colon", 0
                parent.keys.append(key)
            else:
                self._pop_value()
            return
        top.buf.append(b)

    def _object_byte(self, top: _Frame, b: int, at: int) -> None:
        st = top.state
        if st in ("start", "key_next") and b == ord('"'):
            self.frames.append(_Frame("key", top.alts, at))
            top.state = "key"
        elif st == "start" and b == ord("}"):
            self._pop_value()
        elif st == "colon":
            top.sep += 1
            if top.sep == 2:
                top.state = "value"
        elif st == "value":
            self._begin_value(self._value_alts(top), b, at)
            top.state = "in"
        elif st == "after" and b == ord(","):
            top.state, top.sep = "comma", 1
        elif st == "after" and b == ord("}"):
            self._pop_value()
        elif st == "comma":
            top.state = "key_next"
        else:
            self.broken = True

    def _array_byte(self, top: _Frame, b: int, at: int) -> None:
        st = top.state
        if st == "start" and b == ord("]"):
            self._pop_value()
        elif st in ("start", "value"):
            self._begin_value(self._item_alts(top), b, at)
            top.state = "in"
        elif st == "after" and b == ord(","):
            top.state = "comma"
        elif st == "after" and b == ord("]"):
            self._pop_value()
        elif st == "comma":
            top.state = "value"
        else:
            self.broken = True

    def _begin_value(self, alts: list[dict[str, Any]], b: int, at: int) -> None:
        ch = chr(b)
        consts = [dumps(v).encode() for s in alts for v in _values(s)]
        if ch == "{":
            frame = _Frame("object", [s for s in alts if kind_of(s) in ("object", "any") and not _values(s)], at)
        elif ch == "[":
            frame = _Frame("array", [s for s in alts if kind_of(s) in ("array", "any") and not _values(s)], at)
            if self.watch is not None and any(s is self.watch for s in alts):
                frame.items = []
        elif ch == '"':
            frame = _Frame("string", [s for s in alts if kind_of(s) in ("string", "any") and not _values(s)], at)
            frame.consts = [c for c in consts if c.startswith(b'"')]
        elif ch in "-0123456789":
            frame = _Frame("number", [s for s in alts if kind_of(s) in ("number", "integer", "any")
                                      and not _values(s)], at)
            frame.buf.append(b)
            frame.consts = [c for c in consts if c[:1] in b"-0123456789"]
        elif ch in "tfn":
            frame = _Frame("literal", alts, at)
            frame.consts = [{"t": b"true", "f": b"false", "n": b"null"}[ch]]
            frame.buf.append(b)
        else:
            self.broken = True
            return
        self.frames.append(frame)

    def _pop_value(self) -> None:
        done = self.frames.pop()
        parent = self.frames[-1]
        text = bytes(self.data[done.start:])
        if done.kind == "number":  # the byte that ended it belongs to the parent
            text = text[: len(done.buf)]
        if parent.kind == "object":
            parent.state = "after"
            self._narrow(parent, text)
        elif parent.kind == "array":
            parent.state = "after"
            parent.count += 1
            if parent.items is not None:
                self._item_done(parent, text, done.start)
        else:
            parent.state = "after"
            self.done = True

    def _item_done(self, arr: _Frame, text: bytes, start: int) -> None:
        """A watched item is complete: kept, and noted when it says what an earlier one said."""
        begin = start
        if self.items:  # from its separator on
            begin = self.data.rfind(b",", 0, start)
        try:
            value = json.loads(text)
            repeat = any(json.loads(earlier) == value for earlier in self.items)
        except ValueError:
            repeat = False
        if repeat and self.repeat_from is None:
            self.repeat_from = begin
        arr.items = (arr.items or []) + [text]
        self.items.append(text)

    def _narrow(self, obj: _Frame, text: bytes) -> None:
        """Keep the object's alternatives whose schema for the key admits the scalar just written (a tool's
        ``name`` picks its ``arguments``)."""
        try:
            value = json.loads(text)
        except ValueError:
            return
        if isinstance(value, (dict, list)):
            return
        keep = [s for s in obj.alts if _admits(self.schemas, prop_schema(s, obj.key or ""), value)]
        if keep:
            obj.alts = keep

    def _value_alts(self, obj: _Frame) -> list[dict[str, Any]]:
        return [a for s in obj.alts for a in self.schemas.alts(prop_schema(s, obj.key or ""))]

    def _item_alts(self, arr: _Frame) -> list[dict[str, Any]]:
        return [a for s in arr.alts for a in self.schemas.alts(s.get("items", True))]

    # -- what completes it ---------------------------------------------------------------------------------------
    def closing(self) -> str | None:
        """The shortest text that ends the value validly from here; "" once it is complete; None when nothing
        can (or these bytes left the schema)."""
        if self.broken:
            return None
        if self.done:
            return ""
        out: list[str] = []
        top = len(self.frames) - 1
        if top >= 1 and self.frames[top].kind == "string" and self.frames[top].consts and \
                self.frames[top - 1].kind == "object":
            joint = self._const_in_object(self.frames[top], self.frames[top - 1])
            if joint is not None:  # the value it began and the object's own rest, from one alternative
                out.append(joint)
                top -= 2
        for i in range(top, -1, -1):
            piece = self._rest(self.frames[i], inner=i < len(self.frames) - 1)
            if piece is None:
                return None
            out.append(piece)
        return "".join(out)

    def between_items(self) -> bool:
        """Whether the text stands between two items of the watched array (one complete, the next not begun)."""
        return any(f.items is not None and f.state == "after" for f in self.frames)

    def open_item(self) -> bool:
        """Whether an item of the watched array is begun and not complete."""
        return any(f.items is not None and f.state == "in" for f in self.frames)

    def _const_in_object(self, string: _Frame, obj: _Frame) -> str | None:
        m = self.schemas
        written = bytes(string.buf)
        best = None
        for s in obj.alts:
            after = _after_keys(s, obj.keys, m)
            if after is None:
                continue
            for sub in m.alts(prop_schema(s, obj.key or "")):
                for v in _values(sub):
                    c = dumps(v).encode()
                    if c.startswith(b'"') and c[1:].startswith(written):
                        best = _shortest([best, c[1 + len(written):].decode("utf-8", "replace") + after])
        return best

    def path(self) -> str:
        """Where the text stands, as a JSON path (``tool_calls[0].arguments.city``)."""
        parts = []
        for i, f in enumerate(self.frames):
            if f.kind == "object" and f.state in ("colon", "value", "in"):
                parts.append("." + (f.key or ""))
            elif f.kind == "object" and f.state == "key" and i + 1 < len(self.frames):
                parts.append("." + self.frames[i + 1].buf.decode("utf-8", "replace"))
            elif f.kind == "array" and f.state in ("in", "value", "comma"):
                parts.append(f"[{f.count}]")
        return "".join(parts).lstrip(".") or "$"

    def _rest(self, f: _Frame, inner: bool) -> str | None:
        """What frame ``f`` still needs: after its open child (``inner``) completes, or from its own state."""
        m = self.schemas
        if f.kind == "root":
            if f.state == "start":
                return m.minimal_of(f.alts)
            return ""
        if f.kind == "string":
            return _string_rest(f, m)
        if f.kind == "key":
            return ""  # the object frame above completes its key
        if f.kind == "number":
            return _number_rest(bytes(f.buf), f.alts)
        if f.kind == "literal":
            return f.consts[0][len(f.buf):].decode()
        if f.kind == "object":
            return self._object_rest(f, inner)
        return self._array_rest(f, inner)

    def _object_rest(self, f: _Frame, inner: bool) -> str | None:
        m = self.schemas
        best: str | None = None
        for s in f.alts:
            text: str | None
            if f.state == "key":  # the key frame is above: complete its key
                partial = self.frames[-1].buf.decode("utf-8", "replace") if self.frames[-1].kind == "key" else ""
                text = None
                for name in _next_keys(s, f.keys, partial):
                    value = m.minimal_of(m.alts(prop_schema(s, name)))
                    after = _after_keys(s, f.keys + [name], m)
                    if value is not None and after is not None:
                        text = _shortest([text, name[len(partial):] + '": ' + value + after])
            elif f.state == "colon":
                value = m.minimal_of(m.alts(prop_schema(s, f.key or "")))
                after = _after_keys(s, f.keys, m)
                text = None if value is None or after is None else ": "[f.sep:] + value + after
            elif f.state == "value":
                value = m.minimal_of(m.alts(prop_schema(s, f.key or "")))
                after = _after_keys(s, f.keys, m)
                text = None if value is None or after is None else value + after
            elif f.state in ("in", "after"):
                text = _after_keys(s, f.keys, m)
            elif f.state == "start":
                text = _after_keys(s, [], m, first=True)
            else:  # comma / key_next: a key must follow
                lead = " " if f.state == "comma" else ""
                text = None
                for name in _next_keys(s, f.keys, ""):
                    value = m.minimal_of(m.alts(prop_schema(s, name)))
                    after = _after_keys(s, f.keys + [name], m)
                    if value is not None and after is not None:
                        text = _shortest([text, lead + dumps(name) + ": " + value + after])
            best = _shortest([best, text])
        return best

    def _array_rest(self, f: _Frame, inner: bool) -> str | None:
        m = self.schemas
        pending = f.state in ("comma", "value")  # an item must follow: it counts
        count = f.count + (1 if inner or f.state == "in" or pending else 0)
        best: str | None = None
        for s in f.alts:
            limit = s.get("maxItems")
            if f.items is not None and self.cap is not None:
                limit = self.cap if limit is None else min(limit, self.cap)
            if limit is not None and count > limit:
                continue
            need = max(int(s.get("minItems", 0) or 0) - count, 0)
            item = m.minimal_of(m.alts(s.get("items", True))) if need or pending else ""
            if item is None:
                continue
            if pending:
                text = (" " if f.state == "comma" else "") + item + (", " + item) * need + "]"
            elif f.state == "start" and not inner:
                text = ", ".join([item] * need) + "]"
            else:
                text = (", " + item) * need + "]"
            best = _shortest([best, text])
        return best


def _values(s: dict[str, Any]) -> list[Any]:
    if "const" in s:
        return [s["const"]]
    if isinstance(s.get("enum"), list):
        return list(s["enum"])
    return []


def _admits(m: Schemas, schema: Any, value: Any) -> bool:
    for s in m.alts(schema):
        vals = _values(s)
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


def _string_rest(f: _Frame, m: Schemas) -> str | None:
    written = bytes(f.buf)
    best: str | None = None
    for c in f.consts:  # the rest of a const or enum value it began (c holds the quotes)
        if c[1:].startswith(written):
            best = _shortest([best, c[1 + len(written):].decode("utf-8", "replace")])
    tail = ""
    if f.state == "escape":
        tail, written = "n", written + b"n"
    elif f.state == "unicode":
        tail = "0" * (4 - f.sep)
    chars = len(written.decode("utf-8", "ignore"))
    for s in f.alts:
        if chars == 0 and (isinstance(s.get("pattern"), str) or s.get("format") in _FORMATS):
            pad = string_example(s)
        elif s.get("format") in _FORMATS:
            pad = _format_rest(s["format"], written.decode("utf-8", "ignore"))
        else:  # a pattern begun: only the grammar knows; an estimate
            pad = "a" * max(int(s.get("minLength", 0) or 0) - chars, 0)
        best = _shortest([best, tail + pad + '"'])
    return best


def _format_rest(fmt: str, written: str) -> str:
    """The rest of a string of a known format begun: an email's missing domain, a date's missing fields."""
    if fmt == "email":
        local, at, domain = written.partition("@")
        if not at:
            return "@a.aa"
        if not domain:
            return "a.aa"
        return "" if "." in domain.strip(".") and not domain.endswith(".") else ("aa" if domain.endswith(".")
                                                                                  else ".aa")
    template = _FORMATS[fmt]
    shape = "".join("0" if c.isdigit() else c for c in template)
    mine = "".join("0" if c.isdigit() else c for c in written)
    return template[len(written):] if shape.startswith(mine) else ""


def _number_rest(written: bytes, alts: list[dict[str, Any]]) -> str:
    """The digits a number begun needs: one where it cannot end yet ("-", "1.", "1e"), more where it is still under
    its minimum ("3" of at least 18: "30"; "0" above 0: "0.5")."""
    for pad in ("", "0", "1", "00", "000", "0000", ".5", ".1", ".01", ".001"):
        text = written + pad.encode()
        if _NUMBER.fullmatch(text) is None:
            continue
        value = float(text)
        if not alts or any(_in_bounds(s, value) for s in alts):
            return pad
    return "0"


def _in_bounds(s: dict[str, Any], value: float) -> bool:
    def num(key: str) -> float | None:
        v = s.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    lo, hi, xlo, xhi = num("minimum"), num("maximum"), num("exclusiveMinimum"), num("exclusiveMaximum")
    return (lo is None or value >= lo) and (hi is None or value <= hi) and (xlo is None or value > xlo) and \
        (xhi is None or value < xhi) and (kind_of(s) != "integer" or value.is_integer())


def _next_keys(s: dict[str, Any], written: list[str], partial: str) -> list[str]:
    """The keys that may come next in object ``s`` (after ``written``, in the properties' order), starting with
    ``partial``; any key where other properties are allowed."""
    props = list((s.get("properties") or {}).keys())
    last = max((props.index(k) for k in written if k in props), default=-1)
    out = [p for p in props[last + 1:] if p not in written and p.startswith(partial)]
    if s.get("additionalProperties", True) is not False and partial not in written and partial not in out:
        out.append(partial)  # any other key: the one begun, as it stands
    return out


def _after_keys(s: dict[str, Any], written: list[str], m: Schemas, first: bool = False) -> str | None:
    """The required keys not yet written, each with its smallest value, then ``}``."""
    parts = []
    for name in required_in_order(s):
        if name in written:
            continue
        value = m.minimal_of(m.alts(prop_schema(s, name)))
        if value is None:
            return None
        parts.append(f"{dumps(name)}: {value}")
    if not parts:
        return "}"
    return ("" if first else ", ") + ", ".join(parts) + "}"
