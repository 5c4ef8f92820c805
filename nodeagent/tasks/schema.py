"""JSON Schemas for extraction: what the decoder enforces token by token, and what the validator checks after.

A task's schema is checked when the task is created. The constrained decoder (llguidance's JSON compiler)
gets a *prepared copy* of it:

- an object that lists its properties and says nothing of others admits no others (``closed``);
- a root that allows objects but does not say ``"type": "object"`` (a root with ``properties``, a root
  ``$ref``, an ``allOf`` of objects) is constrained to an object;
- keywords the decoder cannot enforce are left out of its copy, and the final validation (jsonschema, with
  its format checker) enforces them: ``oneOf`` is decoded as ``anyOf`` (the validator insists on exactly
  one), ``minProperties``/``maxProperties``, ``not``, ``uniqueItems``, ``if``/``then``/``else``,
  ``dependencies``, ... and formats the decoder does not know (an unknown format is an annotation in JSON
  Schema 2019-09 and later).

Every such relaxation is stated (``PreparedSchema.relaxations``, which the runner puts in the Result's notes), and
an output that fails the final validation is an error result (``invalid_output``), never an ok. A schema is
refused only when neither the decoder nor the validator can honour it (an invalid schema, a reference that
cannot be resolved, a root that cannot be an object); the refusal names the keyword and the path to it.
"""

from __future__ import annotations

import copy
import json
import re
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator

# Compact JSON with single spaces: flexible whitespace lets a small model loop on newlines forever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# keywords whose value maps names to subschemas, and those whose value is a list of subschemas
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_OBJECT_HINTS = ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                 "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas")
MAX_RELAXATION_ROUNDS = 20
# a string or array the schema leaves unbounded gets bounds in the decoder's copy (NODEAGENT_MAX_STRING_CHARS,
# NODEAGENT_MAX_ARRAY_ITEMS, passed to prepare): small models otherwise write descriptions that never end, or
# lists that go on with ever new items (which no repetition guard catches)


@dataclass(frozen=True)
class PreparedSchema:
    decoder_schema: dict[str, Any]
    relaxations: tuple[str, ...]
    # the decoder's copy with the strings that have a pattern left without the default length bound, for when
    # llguidance cannot intersect a pattern with that bound ("Unable to determine if regex is empty", seen on
    # real AWS ARN patterns); None when no such string was bounded
    loose_schema: dict[str, Any] | None = None
    loose_note: str | None = None

    def grammar(self) -> str:
        """The llguidance grammar for the decoder's copy."""
        return _grammar(self.decoder_schema)

    def loose_grammar(self) -> str | None:
        return _grammar(self.loose_schema) if self.loose_schema is not None else None


def _grammar(schema: dict[str, Any]) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)


def _compile_error(schema: dict[str, Any]) -> str | None:
    """None when the decoder compiles the schema; else its reason."""
    import llguidance

    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(_grammar(schema))
    except Exception as exc:  # noqa: BLE001  (the compiler's own exception types are not public)
        return str(exc)
    return "; ".join(messages) if is_error else None


def subschemas(schema: Any, path: str = "") -> Iterator[tuple[dict[str, Any], str]]:
    """Every schema object inside ``schema`` with its JSON pointer, property names never taken for keywords."""
    if not isinstance(schema, dict):
        return
    yield schema, path or "/"
    for key, value in schema.items():
        if key in _NAME_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from subschemas(sub, f"{path}/{key}/{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from subschemas(sub, f"{path}/{key}/{i}")
        elif key in _SCHEMA_VALUES:
            if isinstance(value, list):
                for i, sub in enumerate(value):
                    yield from subschemas(sub, f"{path}/{key}/{i}")
            else:
                yield from subschemas(value, f"{path}/{key}")


def _drop(schema: dict[str, Any], keys: set[str], why: str, notes: list[str],
          format_name: str | None = None) -> bool:
    """Leave ``keys`` (or one ``format``) out of every subschema of the decoder's copy; note where."""
    places: dict[str, list[str]] = {}
    for sub, path in subschemas(schema):
        for key in list(sub):
            if key not in keys or (format_name is not None and sub.get("format") != format_name):
                continue
            if key == "oneOf":
                alternatives = sub.pop("oneOf")
                if "anyOf" in sub:  # both: the decoder takes their intersection
                    sub["allOf"] = [*sub.get("allOf", []), {"anyOf": alternatives}]
                else:
                    sub["anyOf"] = alternatives
            else:
                del sub[key]
            label = f"format {format_name!r}" if format_name else key
            places.setdefault(label, []).append(path)
    for label, paths in places.items():
        where = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        notes.append(f"{label} {why} ({where})")
    return bool(places)


def _root_object(schema: dict[str, Any], notes: list[str]) -> None:
    """Constrain a root that allows objects to an object; refuse one that cannot be one."""
    kind = schema.get("type")
    if kind == "object":
        return
    if isinstance(kind, list):
        if "object" not in kind:
            raise ValueError(f"the schema's root must allow an object; its type is {kind} (type at /)")
        schema["type"] = "object"
        notes.append(f"the root allows {kind}: constrained to an object")
        return
    if kind is not None:
        raise ValueError(f"the schema's root must allow an object; its type is {kind!r} (type at /)")
    if any(k in schema for k in _OBJECT_HINTS) or any(k in schema for k in ("$ref", "allOf", "anyOf", "oneOf")):
        schema["type"] = "object"
        notes.append("the root does not say \"type\": \"object\": constrained to an object")
        return
    raise ValueError("the schema's root says nothing of an object (no type, properties or $ref at /)")


def _decoder_regex_ok(pattern: str) -> bool:
    return _compile_error({"type": "string", "pattern": pattern}) is None


def _python_regex_ok(pattern: str) -> bool:
    """Whether the validator's engine (the ``regex`` module, which bounded validation matches with) parses it."""
    import regex

    try:
        regex.compile(pattern)
        return True
    except (regex.error, TypeError, ValueError):
        return False


def _relax_patterns(decoder: dict[str, Any], notes: list[str]) -> bool:
    """Patterns the decoder's regex engine cannot parse (lookarounds, ...) are left to the validator, when
    Python's can; one that neither parses is refused with its path."""
    dropped: list[str] = []
    for sub, path in subschemas(decoder):
        pattern = sub.get("pattern")
        if isinstance(pattern, str) and not _decoder_regex_ok(pattern):
            if not _python_regex_ok(pattern):
                raise ValueError(f"neither the decoder nor the validator can parse the pattern {pattern!r} "
                                 f"(pattern at {path})")
            del sub["pattern"]
            dropped.append(f"{path}/pattern")
        names = sub.get("patternProperties")
        if isinstance(names, dict):
            for key in [k for k in names if not _decoder_regex_ok(k)]:
                if not _python_regex_ok(key):
                    raise ValueError(f"neither the decoder nor the validator can parse the pattern {key!r} "
                                     f"(patternProperties at {path})")
                del names[key]
                dropped.append(f"{path}/patternProperties/{key}")
    if dropped:
        where = ", ".join(dropped[:3]) + (f" and {len(dropped) - 3} more" if len(dropped) > 3 else "")
        notes.append(f"pattern beyond the decoder's regular expressions is enforced by the final validation ({where})")
    return bool(dropped)


def _relax(decoder: dict[str, Any], error: str, notes: list[str]) -> bool:
    """One relaxation for the decoder's error; False when the error is not one a relaxation can lift."""
    if any(k in error for k in ("regex parse error", "lookarounds not supported", "Unable to determine if regex")):
        return _relax_patterns(decoder, notes)
    if "patternProperty regexes" in error:  # overlapping name patterns: the validator applies every match
        return _drop(decoder, {"patternProperties"}, "(overlapping) is enforced by the final validation", notes)
    if m := re.search(r"Unknown format: ([^\s;,]+)", error):
        return _drop(decoder, {"format"}, "is not known to the decoder: an annotation, checked by the validator "
                                          "where it knows it", notes, format_name=m.group(1))
    if m := re.search(r"Unimplemented keys: \[([^\]]*)\]", error):
        keys = {k.strip().strip('"') for k in m.group(1).split(",") if k.strip()}
        return _drop(decoder, keys, "is enforced by the final validation, not the decoder", notes)
    if "min/maxProperties" in error:
        return _drop(decoder, {"minProperties", "maxProperties"}, "is enforced by the final validation, not the "
                                                                   "decoder", notes)
    return False


@lru_cache(maxsize=256)
def _prepare_text(text: str, object_root: bool = True) -> PreparedSchema:
    import jsonschema

    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    # the structure only: a pattern may be one the decoder's regex engine parses and Python's does not
    error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "/" + "/".join(str(p) for p in error.absolute_path)
        raise ValueError(f"invalid JSON Schema: {error.message} (at {where})")
    decoder = copy.deepcopy(schema)
    notes: list[str] = []
    if object_root:
        _root_object(decoder, notes)
    _drop(decoder, {"oneOf"}, "is decoded as anyOf; the final validation insists on exactly one", notes)
    for _ in range(MAX_RELAXATION_ROUNDS):
        error = _compile_error(decoder)
        if error is None:
            return PreparedSchema(decoder_schema=decoder, relaxations=tuple(notes))
        if not _relax(decoder, error, notes):
            raise ValueError(f"the constrained decoder cannot use this schema, and the validator alone cannot "
                             f"stand in: {error}")
    raise ValueError(f"the constrained decoder cannot use this schema: {error}")


def prepare(schema: Any, max_string_chars: int | None = None, max_array_items: int | None = None,
            object_root: bool = True) -> PreparedSchema:
    """The decoder's copy of ``schema`` and the relaxations it needed; ValueError with the reason when the
    schema is invalid or neither the decoder nor the validator can honour it. ``max_string_chars`` and
    ``max_array_items``: bound the strings and arrays the schema leaves unbounded (stated in the relaxations).
    ``object_root``: the root is an object (extraction's); else any value (a chat's response format)."""
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object")
    # the schema's own key order: the decoder writes properties in that order, as the schema's author meant
    prepared = _prepare_text(json.dumps(closed(schema)), object_root)
    if not (max_string_chars or max_array_items):
        return prepared
    base = json.dumps(prepared.decoder_schema)
    text, n_strings, n_arrays = _bounded(base, max_string_chars or 0, max_array_items or 0)
    loose, n_loose, _ = _bounded(base, max_string_chars or 0, max_array_items or 0, patterns=False)
    notes = list(prepared.relaxations)
    if n_strings:
        notes.append(f"{_count(n_strings, 'string')} without maxLength bounded at {max_string_chars} characters "
                     "by the decoder (NODEAGENT_MAX_STRING_CHARS)")
    if n_arrays:
        notes.append(f"{_count(n_arrays, 'array')} without maxItems bounded at {max_array_items} items by the "
                     "decoder (NODEAGENT_MAX_ARRAY_ITEMS)")
    if n_loose == n_strings:
        return PreparedSchema(decoder_schema=json.loads(text), relaxations=tuple(notes))
    n = n_strings - n_loose
    return PreparedSchema(decoder_schema=json.loads(text), relaxations=tuple(notes), loose_schema=json.loads(loose),
                    loose_note=f"{_count(n, 'string')} with a pattern left without the length bound: llguidance "
                               "could not intersect the pattern with it")

def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties and says nothing of others admitting no others,
    as llama.cpp's JSON-Schema grammars do. A small model otherwise goes on inventing keys (``id``, ``city``,
    ``country_address_type_id``...) until the duplicate-key guard ends the answer. Left as it is where ``allOf``
    could merge objects. Only the decoder's copy is closed: the final validation reads the original, which
    every closed answer satisfies."""
    if not isinstance(schema, dict):
        return schema
    copy_ = json.loads(json.dumps(schema))
    subs = list(subschemas(copy_))
    if any("allOf" in sub for sub, _ in subs):
        return schema
    for sub, _ in subs:
        if isinstance(sub.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                             "unevaluatedProperties"} & set(sub):
            sub["additionalProperties"] = False
    return copy_


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n > 1 else ''}"


def _is(sub: dict[str, Any], kind: str) -> bool:
    declared = sub.get("type")
    return declared == kind or (isinstance(declared, list) and kind in declared)


# The longest text a string of these formats can be (RFC 5321's path, RFC 1035's name, the textual addresses, a
# UUID): a string of one of them without its own maxLength is bounded there, not at the default bound, so a model
# cannot write a thousand characters of an address that never reaches its ``@``.
FORMAT_CHARS = {"email": 254, "idn-email": 254, "hostname": 253, "idn-hostname": 253, "ipv4": 15, "ipv6": 45,
                "uuid": 36}


@lru_cache(maxsize=256)
def _bounded(text: str, max_chars: int, max_items: int, patterns: bool = True) -> tuple[str, int, int]:
    """The decoder schema with the given bounds where it has none (0: no bound), and how many it set;
    ``patterns`` False: strings with a pattern keep only their pattern."""
    decoder = json.loads(text)
    n_strings = n_arrays = 0
    for sub, _ in subschemas(decoder):
        if {"enum", "const"} & set(sub):
            continue
        if max_chars and _is(sub, "string") and "maxLength" not in sub and sub.get("format") in FORMAT_CHARS:
            sub["maxLength"] = max(FORMAT_CHARS[sub["format"]], sub.get("minLength", 0))  # the format's own
        elif max_chars and _is(sub, "string") and "maxLength" not in sub and (patterns or "pattern" not in sub):
            sub["maxLength"] = max(max_chars, sub.get("minLength", 0))
            n_strings += 1
        if max_items and _is(sub, "array") and "maxItems" not in sub:
            sub["maxItems"] = max(max_items, sub.get("minItems", 0))
            n_arrays += 1
    return json.dumps(decoder), n_strings, n_arrays


def check_schema(schema: Any) -> None:
    """Raise ValueError with the reason when the schema cannot be used for extraction."""
    prepare(schema)


class ValidationTimeout(TimeoutError):
    """Validating an output ran past the time it was given (a pattern that backtracks catastrophically)."""


def validate_output(schema: dict[str, Any], value: Any, timeout_s: float | None = None) -> str | None:
    """None when ``value`` matches ``schema`` (formats included, where the validator knows them); else the
    first error, as text. Every regular expression of the schema is matched by a backtracking engine under
    ``timeout_s`` in all (default ``MAX_VALIDATION_S``), with the GIL released: ValidationTimeout past it."""
    import jsonschema

    cls = _tolerant(jsonschema.validators.validator_for(schema))
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    with bounded_regex(MAX_VALIDATION_S if timeout_s is None else timeout_s):
        error = next(iter(validator.iter_errors(value)), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"{where}: {error.message}"


# validation without a task's own limit (a direct call) is bounded by this
MAX_VALIDATION_S = 10.0
_regex_deadline: ContextVar[float | None] = ContextVar("regex_deadline", default=None)


@contextmanager
def bounded_regex(timeout_s: float) -> Iterator[None]:
    """Inside, jsonschema's regular expressions run under a deadline ``timeout_s`` from now."""
    _install_bounded_re()
    token = _regex_deadline.set(time.monotonic() + max(0.0, timeout_s))
    try:
        yield
    finally:
        _regex_deadline.reset(token)


class _BoundedRe:
    """Stands in for the ``re`` module inside jsonschema, whose keywords ``pattern``, ``patternProperties``,
    ``additionalProperties`` and ``unevaluatedProperties`` all match with ``re.search``. Python's ``re``
    backtracks without a bound and holds the GIL while it does (a 28-character string against a lookahead
    pattern took 18 s, and the lease and heartbeat threads starved). Under ``bounded_regex`` a search goes
    to the ``regex`` module with the time left and the GIL released; elsewhere it is ``re.search``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(re, name)

    def search(self, pattern: Any, string: Any, flags: int = 0) -> Any:
        deadline = _regex_deadline.get()
        if deadline is None:
            return re.search(pattern, string, flags)
        import regex

        left = deadline - time.monotonic()
        if left <= 0:
            raise ValidationTimeout(f"validation ran out of time before matching the pattern {str(pattern)[:80]!r}")
        try:
            return regex.search(pattern, string, flags, timeout=left, concurrent=True)
        except TimeoutError:
            raise ValidationTimeout(f"matching the pattern {str(pattern)[:80]!r} against a {len(string)}-character "
                                    f"string took longer than the {left:.3g} s left") from None


_BOUNDED = _BoundedRe()


@lru_cache(maxsize=1)
def _install_bounded_re() -> None:
    from jsonschema import _keywords, _legacy_keywords, _utils

    for module in (_keywords, _legacy_keywords, _utils):
        if getattr(module, "re", None) not in (re, _BOUNDED):  # jsonschema changed: fail loudly, not unbounded
            raise RuntimeError(f"{module.__name__} no longer matches patterns through re: validation could not "
                               "be bounded; pin jsonschema to a version nodeagent knows")
        module.re = _BOUNDED  # type: ignore[attr-defined]


@lru_cache(maxsize=16)
def _tolerant(cls: Any) -> Any:
    """The validator, except that a pattern Python's regular expressions cannot parse (Unicode classes, ...)
    is left to the decoder, which enforced it: a schema whose pattern neither could parse was refused."""
    import jsonschema

    base_pattern = cls.VALIDATORS["pattern"]
    base_props = cls.VALIDATORS.get("patternProperties")

    def pattern(validator: Any, patrn: Any, instance: Any, schema: Any) -> Any:
        if isinstance(patrn, str) and not _python_regex_ok(patrn):
            return
        yield from base_pattern(validator, patrn, instance, schema)

    def pattern_properties(validator: Any, props: Any, instance: Any, schema: Any) -> Any:
        usable = {k: v for k, v in props.items() if _python_regex_ok(k)} if isinstance(props, dict) else props
        yield from base_props(validator, usable, instance, schema)

    extra = {"pattern": pattern}
    if base_props is not None:
        extra["patternProperties"] = pattern_properties
    return jsonschema.validators.extend(cls, extra)
