"""What closes a JSON answer from wherever its text stands (``tasks/decoding/closer.py``), and the tool answer read back
however generation stopped (``tasks/openai/tools.py``): pure, on hand-written schemas and documents, then against
llguidance's own grammar on SmolLM2's tokenizer (every ending the closer proposes is one the decoder accepts)."""

from __future__ import annotations

import json

import pytest

from nodeagent.tasks.decoding.closer import JsonCloser
from nodeagent.tasks.decoding.instances import number_example, pattern_example
from nodeagent.tasks.openai import tools as toolsmod
from nodeagent.tasks.schema import validate_output

PERSON = {"type": "object", "required": ["name", "age"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "minLength": 2}, "age": {"type": "integer", "minimum": 18, "maximum": 130},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "minItems": 2, "items": {"type": "string", "enum": ["a", "bee"]}},
    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    "ok": {"type": "boolean"}, "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5},
    "kind": {"anyOf": [{"type": "null"}, {"type": "object", "required": ["id"], "properties": {"id": {"const": "x"}}}]}}}
DOCS = [
    {"name": "Ann", "age": 34},
    {"name": "Bob \"the\" \\ builder \u00e9\u4e2d", "age": 40, "email": "b@c.de", "tags": ["a", "bee", "a"],
     "code": "ABC-12", "ok": False, "ratio": 0.25, "kind": {"id": "x"}},
    {"name": "Cy", "age": 99, "ratio": 1e-3, "kind": None},
]


@pytest.mark.parametrize("doc", DOCS)
def test_every_prefix_closes_to_a_valid_document(doc):
    text = json.dumps(doc, ensure_ascii=False).encode()
    for i in range(len(text) + 1):
        closer = JsonCloser(PERSON)
        closer.feed(text[:i])
        ending = closer.closing()
        assert ending is not None, text[:i]
        try:
            whole = json.loads(text[:i] + ending.encode())
        except ValueError:  # a character cut in half: the next byte completes it
            assert text[:i].decode("utf-8", "replace").endswith("\ufffd")
            continue
        problem = validate_output(PERSON, whole)
        # a pattern begun is the one place this reading estimates (the decoder checks the grammar's own answer)
        assert problem is None or (problem.startswith("code:") and closer.path() == "code"), (text[:i], ending)
    assert closer.closing() == "" and closer.done


def test_the_ending_is_the_shortest_this_reading_knows():
    c = JsonCloser(PERSON)
    assert c.closing() == '{"name": "aa", "age": 18}'
    c.feed(b'{"name": "A')
    assert c.closing() == 'a", "age": 18}' and c.path() == "name"
    c.feed(b'nn", "age": 3')
    assert c.closing() == "0}"  # 3 is under the minimum: a digit more
    c.feed(b"4")
    assert c.closing() == "}"
    c.feed(b', "ta')
    assert c.closing() == 'gs": ["a", "a"]}' and c.path() == "ta"  # the key as written so far
    c = JsonCloser(PERSON)
    c.feed(b'{"name": "Ann", "age": 34, "ratio": 1e')
    assert c.closing() == "0}"


def test_minimal_values_within_bounds_and_patterns():
    assert number_example({"minimum": 18}, "integer") == "18"
    assert number_example({"exclusiveMinimum": 0}, "number") == "1"
    assert number_example({"exclusiveMinimum": 0, "maximum": 0.5}, "number") == "0.25"
    assert number_example({"maximum": -3.5}, "integer") == "-4"
    assert pattern_example("^[A-Z]{3}-[0-9]{2}$") == "AAA-00"
    assert pattern_example(r"^(foo|ab)\d+$") == "ab0"
    assert pattern_example("^(?!x)") is None  # a lookahead: no example


def generic_plan(parallel=True, choice="required"):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
        {"type": "function", "function": {"name": "send_email", "parameters": {
            "type": "object", "required": ["to"], "properties": {"to": {"type": "string", "format": "email"}}}}}]
    return toolsmod.plan_tools(tools, choice, parallel, None, 100, 8)


CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'


def test_a_repeated_call_is_seen_where_it_begins_and_a_cap_allows_no_further_one():
    make = toolsmod.closers(generic_plan())
    c = make()
    c.feed(('{"tool_calls": [' + CALL + ", " + CALL).encode())
    assert c.repeat_from == len('{"tool_calls": [' + CALL)  # at its separator
    c = make()
    c.cap = 1
    c.feed(('{"tool_calls": [' + CALL).encode())
    assert c.closing() == "]}" and c.between_items()
    c.feed(b", ")
    assert c.closing() is None  # a second call cannot be ended validly: it may not be begun


def test_one_call_unless_parallel_is_asked_for():
    assert not generic_plan(parallel=None).parallel
    assert not generic_plan(parallel=False).parallel
    assert generic_plan(parallel=True).parallel
    named = toolsmod.plan_tools(generic_plan().listed, {"type": "function", "function": {"name": "send_email"}},
                                None, None, 100, 8)
    assert not named.parallel and [f.name for f in named.functions] == ["send_email"]


@pytest.mark.parametrize("text,content,calls,dropped", [
    ('{"tool_calls": [' + CALL + "]}", None, 1, 0),
    ('{"tool_calls": [' + CALL + ', {"name": "get_weather", "arguments": {"ci', None, 1, 1),
    ('{"tool_calls": [{"name": "get_weather", "argu', None, 0, 1),
    ('{"response": "Paris, France, is a city', "Paris, France, is a city", 0, 0),
    ('{"response": "Quote \\"this\\" \\u00e9 \\u00', 'Quote "this" \u00e9 ', 0, 0),
    ('{"response": "line\\', "line", 0, 0),
    ('{"respo', "", 0, 0),
])
def test_the_answer_read_back_wherever_it_stopped(text, content, calls, dropped):
    plan = generic_plan(choice="auto")
    parsed = toolsmod.parse(text, plan)
    assert parsed.content == content and len(parsed.calls) == calls and parsed.dropped == dropped
    assert "{" not in (parsed.content or "")


def test_hermes_answers_read_back_and_close():
    tools = generic_plan().listed
    plan = toolsmod.plan_tools(list(tools), "required", True, "{{ '<tool_call>' }}", 100, 8)
    assert plan.format == "hermes"
    make = toolsmod.closers(plan)
    call = "<tool_call>\n" + CALL + "\n</tool_call>"
    whole = call + "\n" + call.replace("Paris", "Lyon")
    for i in range(len(whole) + 1):
        c = make()
        c.feed(whole[:i].encode())
        ending = c.closing()
        parsed = toolsmod.parse(whole[:i] + ending, plan)
        assert parsed.calls and not parsed.dropped and parsed.content is None, (whole[:i], ending)
    parsed = toolsmod.parse(whole[:-20], plan)
    assert len(parsed.calls) == 1 and parsed.dropped == 1
    c = make()
    c.feed((call + "\n" + call).encode())
    assert c.repeat_from == len(call)
    auto = toolsmod.plan_tools(list(tools), "auto", None, "{{ '<tool_call>' }}", 100, 8)
    parsed = toolsmod.parse("Let me look. <tool_c", auto)
    assert parsed.calls == [] and parsed.content == "Let me look. <tool_c"
    parsed = toolsmod.parse("Let me look. " + call[:30], auto)
    assert parsed.content == "Let me look." and parsed.dropped == 1


@pytest.mark.real_model
def test_every_ending_is_one_the_decoder_accepts(smollm2_path):
    """On llguidance's grammar for the same answers: at every token of a valid answer, the closer's ending,
    tokenized, is accepted and leaves the grammar complete."""
    import llguidance

    from nodeagent.node import Node

    node = Node(str(smollm2_path), ctx_tokens=512)
    s = node.runner().session
    answers = ['{"tool_calls": [' + CALL + ', {"name": "send_email", "arguments": {"to": "x@y.org"}}]}',
               '{"response": "It is \\"sunny\\" in Paris \u00e9"}']
    plan = generic_plan(choice="auto")
    for answer in answers:
        tokens = s.tokenize_continuation(answer)
        for k in range(len(tokens) + 1):
            m = llguidance.LLMatcher(s.lltokenizer(), toolsmod.grammar(plan))
            assert m.consume_tokens(tokens[:k])
            c = toolsmod.closers(plan)()
            c.feed(b"".join(s.token_bytes(t) for t in tokens[:k]))
            ending = c.closing()
            assert ending is not None
            rest = s.tokenize_continuation(ending) if ending else []
            if m.validate_tokens(rest) != len(rest):  # a character cut in half: the bytes differ from the text
                assert s.detokenize(tokens[:k]).endswith("\ufffd"), (s.detokenize(tokens[:k]), ending)
                continue
            assert m.consume_tokens(rest) and m.is_accepting(), (s.detokenize(tokens[:k]), ending)
    node.close()
