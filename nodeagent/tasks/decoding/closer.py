"""The answer's one JSON follower: where its text stands, and the shortest way to end it under its schema.

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
against the grammar before it relies on it.

The same reading serves the guards (``decoding/guards.py``): whether the text stands inside a string, how long the
number being written is, the string value being written (what drafts from the input continue), and a key its
object already has (``duplicate``, with ``duplicate_at``, the byte where that key's text began). A schema-less
follower (``JsonCloser(True)``) reads any JSON in that style. Pure: no I/O, no model.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from nodeagent.tasks.decoding.instances import (
    FORMATS,
    NUMBER_BYTES,
    NUMBER_TEXT,
    Schemas,
    admits,
    dumps,
    kind_of,
    prop_schema,
    required_in_order,
    schema_values,
    shortest,
    string_example,
)


@runtime_checkable
class Closer(Protocol):
    """What follows an answer's bytes for the decoder's budget (``decoding/budget.py``): ``JsonCloser`` for a JSON
    value, ``tools.HermesCloser`` for text and tool calls. ``closing()`` is the shortest text that ends the answer
    validly from here (None: nothing can); ``items`` are the complete watched items (the calls), ``cap`` how many
    may still come, ``repeat_from`` the byte where an item that repeats an earlier one began."""

    cap: int | None
    items: list[bytes]
    repeat_from: int | None
    duplicate: str | None  # a key written again in the object that has it
    duplicate_at: int | None  # the byte where that key's text began

    def copy(self) -> "Closer": ...

    def feed(self, data: bytes) -> None: ...

    def closing(self) -> str | None: ...

    def between_items(self) -> bool: ...

    def path(self) -> str: ...

    def number_chars(self) -> int: ...

    def string_value(self) -> str | None: ...


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
        self.duplicate: str | None = None  # a key its object already had
        self.duplicate_at: int | None = None

    def copy(self) -> "JsonCloser":
        c = JsonCloser.__new__(JsonCloser)
        c.schemas, c.watch, c.cap, c.data = self.schemas, self.watch, self.cap, bytearray(self.data)
        c.frames = [f.copy() for f in self.frames]
        c.done, c.broken = self.done, self.broken
        c.items, c.repeat_from = list(self.items), self.repeat_from
        c.duplicate, c.duplicate_at = self.duplicate, self.duplicate_at
        return c

    # -- where the text stands (the guards' reading) ------------------------------------------------------------
    def number_chars(self) -> int:
        """The characters of the number being written (0: none is, as inside a string)."""
        top = self.frames[-1]
        return len(top.buf) if not self.broken and top.kind == "number" else 0

    def string_value(self) -> str | None:
        """The string value being written, escapes as written (None: the text is not inside one)."""
        top = self.frames[-1]
        return top.buf.decode("utf-8", "ignore") if not self.broken and top.kind == "string" else None

    def key_being_written(self) -> str | None:
        top = self.frames[-1]
        return top.buf.decode("utf-8", "ignore") if not self.broken and top.kind == "key" else None

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
            if b in NUMBER_BYTES:
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
                if self._repeats(parent, key) and self.duplicate is None:
                    self.duplicate, self.duplicate_at = key, top.start + 1
                parent.key, parent.state, parent.sep = key, "colon", 0
                parent.keys.append(key)
            else:
                self._pop_value()
            return
        top.buf.append(b)

    @staticmethod
    def _repeats(obj: _Frame, key: str) -> bool:
        return key in obj.keys

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
        consts = [dumps(v).encode() for s in alts for v in schema_values(s)]
        if ch == "{":
            frame = _Frame("object", [s for s in alts if kind_of(s) in ("object", "any") and not schema_values(s)], at)
        elif ch == "[":
            frame = _Frame("array", [s for s in alts if kind_of(s) in ("array", "any") and not schema_values(s)], at)
            if self.watch is not None and any(s is self.watch for s in alts):
                frame.items = []
        elif ch == '"':
            frame = _Frame("string", [s for s in alts if kind_of(s) in ("string", "any") and not schema_values(s)], at)
            frame.consts = [c for c in consts if c.startswith(b'"')]
        elif ch in "-0123456789":
            frame = _Frame("number", [s for s in alts if kind_of(s) in ("number", "integer", "any")
                                      and not schema_values(s)], at)
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
        keep = [s for s in obj.alts if admits(self.schemas, prop_schema(s, obj.key or ""), value)]
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
                for v in schema_values(sub):
                    c = dumps(v).encode()
                    if c.startswith(b'"') and c[1:].startswith(written):
                        best = shortest([best, c[1 + len(written):].decode("utf-8", "replace") + after])
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
                        text = shortest([text, name[len(partial):] + '": ' + value + after])
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
                        text = shortest([text, lead + dumps(name) + ": " + value + after])
            best = shortest([best, text])
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
            best = shortest([best, text])
        return best


def _string_rest(f: _Frame, m: Schemas) -> str | None:
    written = bytes(f.buf)
    best: str | None = None
    for c in f.consts:  # the rest of a const or enum value it began (c holds the quotes)
        if c[1:].startswith(written):
            best = shortest([best, c[1 + len(written):].decode("utf-8", "replace")])
    tail = ""
    if f.state == "escape":
        tail, written = "n", written + b"n"
    elif f.state == "unicode":
        tail = "0" * (4 - f.sep)
    chars = len(written.decode("utf-8", "ignore"))
    for s in f.alts:
        if chars == 0 and (isinstance(s.get("pattern"), str) or s.get("format") in FORMATS):
            pad = string_example(s)
        elif s.get("format") in FORMATS:
            pad = _format_rest(s["format"], written.decode("utf-8", "ignore"))
        else:  # a pattern begun: only the grammar knows; an estimate
            pad = "a" * max(int(s.get("minLength", 0) or 0) - chars, 0)
        best = shortest([best, tail + pad + '"'])
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
    template = FORMATS[fmt]
    shape = "".join("0" if c.isdigit() else c for c in template)
    mine = "".join("0" if c.isdigit() else c for c in written)
    return template[len(written):] if shape.startswith(mine) else ""


def _number_rest(written: bytes, alts: list[dict[str, Any]]) -> str:
    """The digits a number begun needs: one where it cannot end yet ("-", "1.", "1e"), more where it is still under
    its minimum ("3" of at least 18: "30"; "0" above 0: "0.5")."""
    for pad in ("", "0", "1", "00", "000", "0000", ".5", ".1", ".01", ".001"):
        text = written + pad.encode()
        if NUMBER_TEXT.fullmatch(text) is None:
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
