"""Task contracts: validated at creation, published as JSON Schema."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from nodeagent.tasks.contracts import (
    ClassifyOutput,
    ClassifyTask,
    ErrorInfo,
    ExtractTask,
    Result,
    Task,
    result_json_schema,
    task_json_schema,
)
from nodeagent.tasks.schema import validate_output

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name"]}
SCHEMAS = Path(__file__).parent.parent / "schemas"


def test_extract_task_roundtrip_by_alias():
    t = ExtractTask(input="x", schema=PERSON)
    data = json.loads(t.model_dump_json(by_alias=True))
    assert data["type"] == "extract.v1" and data["schema"] == PERSON
    again = TypeAdapter(Task).validate_python(data)
    assert isinstance(again, ExtractTask) and again.id == t.id


@pytest.mark.parametrize("schema,needle", [
    ({"type": "object", "properties": {"a": {"type": "strng"}}}, "invalid JSON Schema"),
    ({"type": "array", "items": {"type": "string"}}, "must describe an object"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "cannot express"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "cannot express"),
    ("not a dict", "valid dictionary"),
])
def test_bad_schemas_rejected_at_creation(schema, needle):
    with pytest.raises(ValidationError, match=needle):
        ExtractTask(input="x", schema=schema)


@pytest.mark.parametrize("labels,needle", [
    ([], "at least 2"), (["only"], "at least 2"), (["a", "A"], "duplicate label"), (["a", "  "], "blank"),
])
def test_bad_labels(labels, needle):
    with pytest.raises(ValidationError, match=needle):
        ClassifyTask(input="x", labels=labels)


def test_labels_with_descriptions():
    t = ClassifyTask(input="x", labels=["spam", {"name": "ham", "description": "a normal message"}])
    assert [lb.name for lb in t.labels] == ["spam", "ham"] and t.labels[1].description


def test_result_cannot_be_partial():
    err = ErrorInfo(code="invalid_output", message="m", retryable=True)
    with pytest.raises(ValidationError, match="no partial result"):
        Result(task_id="t", type="extract.v1", status="error", output={"a": 1}, error=err)
    with pytest.raises(ValidationError, match="has an output"):
        Result(task_id="t", type="extract.v1", status="ok")
    ok = Result(task_id="t", type="classify.v1", status="ok",
                output=ClassifyOutput(label="a", probabilities={"a": 0.9, "b": 0.1}))
    assert json.loads(ok.model_dump_json())["output"]["label"] == "a"


def test_published_schemas_are_current():
    """schemas/*.json are what orchestrators in other languages use: they must match the code."""
    assert json.loads((SCHEMAS / "task.schema.json").read_text()) == task_json_schema()
    assert json.loads((SCHEMAS / "result.schema.json").read_text()) == result_json_schema()
    from nodeagent.broker.base import envelope_json_schema

    assert json.loads((SCHEMAS / "envelope.schema.json").read_text()) == envelope_json_schema()


def test_published_task_schema_validates_a_task():
    import jsonschema

    t = ClassifyTask(input="x", labels=["a", "b"], deadline=datetime(2030, 1, 1, tzinfo=timezone.utc))
    jsonschema.validate(json.loads(t.model_dump_json(by_alias=True)), task_json_schema())


def test_validate_output_reports_path():
    assert validate_output(PERSON, {"name": "a", "age": -1}) == "age: -1 is less than the minimum of 0"
    assert validate_output(PERSON, {"name": "a"}) is None


def test_a_classify_result_read_back_from_json_keeps_its_type():
    from nodeagent.tasks.contracts import ClassifyOutput, Result

    r = Result(task_id="t", type="classify.v1", status="ok",
               output=ClassifyOutput(label="a", probabilities={"a": 0.7, "b": 0.3}))
    again = Result.model_validate_json(r.model_dump_json())
    assert isinstance(again.output, ClassifyOutput) and again == r
    extract = Result(task_id="t", type="extract.v1", status="ok", output={"label": "not a classify output"})
    assert Result.model_validate_json(extract.model_dump_json()).output == {"label": "not a classify output"}
