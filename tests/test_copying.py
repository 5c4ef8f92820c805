"""Values copied from the input (``tasks/copying.py``): which fields copy under each mode and mark, and, on both
engines (llama.cpp with the real SmolLM2, MLX with a tiny model of random weights, which writes anything it is
allowed to), a copied value is always a span of the input or null, and the output stays schema-valid."""

from __future__ import annotations

import pytest
from mlxgen import make_tiny_mlx_model

from nodeagent.config import resolve
from nodeagent.node import Node
from nodeagent.tasks import copying
from nodeagent.tasks.contracts import ExtractTask
from nodeagent.tasks.schema import validate_output

CONTACT = {"type": "object", "additionalProperties": False,
           "required": ["name", "email", "phone", "city", "role", "age", "joined"],
           "properties": {"name": {"type": "string", "maxLength": 40},
                          "email": {"type": "string", "format": "email"},
                          "phone": {"type": ["string", "null"]},
                          "city": {"type": "string"},
                          "role": {"type": "string", "enum": ["sales", "engineer", "support"]},
                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                          "joined": {"type": "string", "format": "date"}}}
TEXTS = ["Met Ana Lima (31) in Porto; she works in sales, joined 2024-03-02. Write to ana.lima@example.org.",
         "Kemal Okafor, engineer from Nairobi, age 45, started on 2019-11-20; kemal@okafor.io, +254 700 123 456.",
         "Zoë «quoted» \"text\" 王芳 lives in Zürich\nand answers tickets since 2021-01-05, 28 years old."]


def test_auto_copies_spans_never_enums_numbers_or_normalised_values():
    assert copying.choose(CONTACT, "auto").fields == ("name", "email", "phone", "city")
    assert copying.choose(CONTACT, "all").fields == ("name", "email", "phone", "city")  # plain strings only
    assert copying.choose(CONTACT, "none").fields == ()
    marked = {**CONTACT, "properties": {**CONTACT["properties"],
                                        "city": {"type": "string", "x-nodeagent": {"copy": False}},
                                        "role": {"type": "string", "x-nodeagent": {"copy": True}}}}
    assert copying.choose(marked, "none").fields == ("role",)
    assert copying.choose(marked, "auto").fields == ("name", "email", "phone", "role")
    optional = {**CONTACT, "required": ["name"]}
    none = copying.choose(optional, "auto")
    assert none.fields == () and "all required" in none.note
    # the default mode (auto, measured) copies where it can, and says nothing where it cannot
    assert copying.DEFAULT == "auto" and copying.choose(optional, copying.DEFAULT, asked=False).note is None


def _check(outputs: list, texts: list[str]) -> None:
    for r, text in zip(outputs, texts):
        assert r.status == "ok", r.error
        assert validate_output(CONTACT, r.output) is None, r.output
        for field in ("name", "email", "phone", "city"):
            value = r.output[field]
            if field == "email" and "@" not in text:  # no span could be one, and the schema wants one: not copied
                assert any("email not copied" in n for n in r.notes), r.notes
                continue
            assert value is None or (value and value in copying.spannable(text)), (field, value, text)


@pytest.mark.real_model
def test_copied_values_are_spans_of_the_input_on_llama_cpp(smollm2_path):
    with Node(str(smollm2_path), config=resolve(env={}), task="extract", ctx_tokens=2048) as node:
        copied = [node.run(ExtractTask(input=t, schema=CONTACT, copy="auto")) for t in TEXTS]
        _check(copied, TEXTS)
        _check([node.run(ExtractTask(input=t, schema=CONTACT)) for t in TEXTS], TEXTS)  # the default copies too
        # a text that holds no e-mail and no phone: the phone may be null, the e-mail is not copied (and says so)
        bare = "Lena Novak, Graz."
        r = node.run(ExtractTask(input=bare, schema=CONTACT, copy="auto"))
        _check([r], [bare])


def test_copied_values_are_spans_of_the_input_on_mlx(tmp_path):
    from nodeagent.backends.mlx import MlxBackend
    from nodeagent.tasks.runner import TaskRunner

    path = make_tiny_mlx_model(tmp_path / "tiny")
    node = Node(str(path), config=resolve(env={}), ctx_tokens=1024)
    with MlxBackend().load(node.plan) as model:
        runner = TaskRunner(model.session(), model="tiny", backend="mlx")
        # random weights write whatever the grammar allows: every copied value is still a span, or null
        _check([runner.run(ExtractTask(input=t, schema=CONTACT, copy="all")) for t in TEXTS], TEXTS)


def test_a_task_that_leaves_them_unset_carries_neither_field_so_an_older_node_reads_it():
    """Contract 1.2 added ``prompt`` and ``copy``: the queue carries them only when set, so a 1.1 worker (whose
    contract forbids unknown fields) still runs every extraction that does not use them."""
    from nodeagent.tasks.contracts import wire

    plain = wire(ExtractTask(input="Ana, Porto.", schema=CONTACT))
    assert "prompt" not in plain and "copy" not in plain and plain["schema"] == CONTACT
    used = wire(ExtractTask(input="Ana, Porto.", schema=CONTACT, prompt="fields", copy="auto"))
    assert used["prompt"] == "fields" and used["copy"] == "auto"
    assert ExtractTask.model_validate(used).copy_mode == "auto"
