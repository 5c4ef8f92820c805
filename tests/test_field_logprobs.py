"""An extraction's confidence per field (``Result.field_logprobs``, ``tasks/field_logprobs.py``): each top-level
value's mean log-probability over the tokens the model chose for it. On the real SmolLM2 an e-mail the model
invents is less sure than one copied from the text, and a value the grammar writes alone is sure; on MLX it is
there too; on the queue a worker writes it only for a task whose writer's contract knows it."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ConfigDict

from nodeagent.config import resolve
from nodeagent.node import Node
from nodeagent.tasks.contracts import ExtractTask, Result
from nodeagent.tasks.field_logprobs import per_field, value_spans

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "email", "kind"],
          "properties": {"name": {"type": "string"}, "email": {"type": ["string", "null"]},
                         "kind": {"type": "string", "enum": ["contact"]}}}


def test_each_top_level_value_gets_the_mean_of_the_tokens_the_model_chose_for_it():
    text = '{"name": "Ana Lima", "tags": ["a", {"b": 1}], "n": 3}'
    spans = value_spans(text)
    assert {k: text[a:b] for k, (a, b) in spans.items()} == {"name": '"Ana Lima"', "tags": '["a", {"b": 1}]',
                                                             "n": "3"}
    assert value_spans("[1, 2]") == {} and value_spans('{"a": ') == {}
    # tokens: '{"' 'name' '": "' 'Ana' ' Lima' '",' ' "' 'tags' ... ; None: forced or drafted, left out
    pieces = [b'{"', b"name", b'": "', b"Ana", b" Lima", b'", "', b"tags", b'": ["a", {"b": 1}], "', b"n",
              b'": ', b"3", b"}"]
    lps = [None, -0.5, None, -1.0, -0.2, None, -0.3, None, None, None, None, None]
    got = per_field(pieces, lps)
    # ": " straddles into "Ana Lima"'s opening quote but was forced; "Ana" and " Lima" were chosen
    assert got["name"] == pytest.approx(-0.6)
    assert got["tags"] == 0.0 and got["n"] == 0.0  # the grammar wrote them (here: no token chosen inside)
    pieces = [b'{"e": "', b"\xc3", b"\xa9", b'"}']  # a character split over two tokens: spans in bytes
    assert per_field(pieces, [None, -2.0, -1.0, None]) == {"e": -1.5}


@pytest.mark.real_model
def test_an_invented_value_is_less_sure_than_a_copied_one_on_llama_cpp(smollm2_path):
    with Node(str(smollm2_path), config=resolve(env={"NODEAGENT_DETERMINISTIC": "1"}), task="extract",
              ctx_tokens=2048) as node:
        stated = node.run(ExtractTask(input="Ana Lima can be reached at ana.lima@example.org.", schema=SCHEMA,
                                      copy="auto"))
        absent = node.run(ExtractTask(input="Ana Lima lives in Porto and likes tea.", schema=SCHEMA, copy="none"))
    for r in (stated, absent):
        assert r.status == "ok", r.error
        assert set(r.field_logprobs) == set(r.output)
        assert all(v <= 0 and math.isfinite(v) for v in r.field_logprobs.values())
        assert r.field_logprobs["kind"] == 0.0  # one way to write it: the grammar wrote it
    assert stated.output["email"] == "ana.lima@example.org"
    invented = absent.output["email"]
    assert invented is None or invented not in absent.output.get("name", "") + "Ana Lima lives in Porto and likes tea."
    assert absent.field_logprobs["email"] < stated.field_logprobs["email"], (absent, stated)
    # JSON as an orchestrator reads it
    assert json.loads(stated.model_dump_json())["field_logprobs"]["kind"] == 0.0


def test_every_field_has_one_on_mlx(tmp_path):
    from mlxgen import make_tiny_mlx_model

    from nodeagent.backends.mlx import MlxBackend
    from nodeagent.tasks.runner import TaskRunner

    path = make_tiny_mlx_model(tmp_path / "tiny")
    node = Node(str(path), config=resolve(env={}), ctx_tokens=1024)
    with MlxBackend().load(node.plan) as model:
        bounded = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string", "maxLength": 12},
                                            "email": {"type": ["string", "null"], "maxLength": 12}}}
        r = TaskRunner(model.session(), model="tiny", backend="mlx").run(  # random weights: strings bounded
            ExtractTask(input="Ana Lima, ana@example.org", schema=bounded))
    assert r.status == "ok", r.error
    assert set(r.field_logprobs) == set(r.output) and r.field_logprobs["kind"] == 0.0
    assert all(v <= 0 for v in r.field_logprobs.values())


class _Reader12(Result):
    """A result as a contract 1.2 reader parses it: unknown fields are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    SINCE = {}


def test_a_worker_writes_it_only_for_a_task_whose_writer_knows_it(broker):
    """Contract 1.3 added ``field_logprobs``. A 1.2 orchestrator's envelope gets a result its strict reader
    reads; one of 1.3 (or a hand-written envelope without a contract) gets the field."""
    from test_worker import worker

    from nodeagent.broker.base import CONTRACT, Envelope

    task = {"type": "extract.v1", "input": "Ana Lima, ana@example.org", "schema": SCHEMA}
    old, new, plain = (Envelope(id=i, queue="extract.v1", task={**task, "id": i}, **({"contract": c} if c else {}))
                       for i, c in (("old", "1.2"), ("new", CONTRACT), ("plain", None)))
    for e in (old, new, plain):
        broker.enqueue(e)
    worker(broker, queues=["extract.v1"]).run()
    results = {i: broker.result(i) for i in ("old", "new", "plain")}
    assert all(r is not None and r.status == "ok" for r in results.values()), results
    assert results["old"].field_logprobs is None
    assert "field_logprobs" not in json.loads(results["old"].model_dump_json())
    _Reader12.model_validate_json(results["old"].model_dump_json())  # the 1.2 reader reads it
    assert set(results["new"].field_logprobs) == set(results["new"].output)
    assert results["plain"].field_logprobs is not None
    # and a reader of this contract ignores a field a later minor adds
    later = {**json.loads(results["new"].model_dump_json()), "a_field_of_1_9": [1]}
    assert Result.model_validate(later).output == results["new"].output
