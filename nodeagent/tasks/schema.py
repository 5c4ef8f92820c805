"""JSON Schemas for extraction: checked when a task is created, not when it runs.

The supported subset is what the constrained decoder (llguidance's JSON
compiler) enforces token by token: types, properties/required/
additionalProperties, items/prefixItems/minItems/maxItems, enum/const,
string minLength/maxLength/pattern/format, numeric minimum/maximum/exclusive
bounds/multipleOf, anyOf/oneOf/allOf, local $ref/$defs. Keywords it cannot
enforce (not, if/then/else, uniqueItems, dependentSchemas,
unevaluatedProperties, ...) are refused with the decoder's own reason, so no
result can silently break its schema.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

# Compact JSON with single spaces: flexible whitespace lets a small model loop on newlines forever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar(schema: dict[str, Any]) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)


@lru_cache(maxsize=256)
def _check_text(text: str) -> None:
    import jsonschema

    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"invalid JSON Schema: {exc.message}") from None
    if schema.get("type") != "object":
        raise ValueError("the schema must describe an object (\"type\": \"object\")")
    import llguidance

    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(_grammar(schema))
    except Exception as exc:  # the compiler's own exception types are not public
        raise ValueError(f"the constrained decoder cannot express this schema: {exc}") from None
    if is_error:
        raise ValueError("the constrained decoder cannot express this schema: " + "; ".join(messages))


def check_schema(schema: Any) -> None:
    """Raise ValueError with the reason when the schema is invalid or outside the supported subset."""
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object")
    _check_text(json.dumps(schema, sort_keys=True))


def grammar_for(schema: dict[str, Any]) -> str:
    check_schema(schema)
    return _grammar(schema)


def validate_output(schema: dict[str, Any], value: Any) -> str | None:
    """None when ``value`` matches ``schema``; else the first error, as text."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)(schema)
    error = next(iter(validator.iter_errors(value)), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"{where}: {error.message}"


def grammar_any(schema: dict[str, Any]) -> str:
    """A grammar for any JSON Schema the decoder can compile (a chat's response_format: not only objects)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"invalid JSON Schema: {exc.message}") from None
    return _grammar(schema)
