"""Forced tokens in the sampled token's step (``fast_forward``): the grammar's forced tokens are taken without a
model step of their own and evaluated with the sampled token, through the same guards. On the fake backend (a
session whose preferences do not depend on the context: the two modes must then write the same text) and on
real SmolLM2, alone and across slots."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import llguidance
import pytest
from test_runaway import ESCAPES, FREE_KEYS, NOTE, SameKey, Stubborn

from nodeagent.bench.workload import TICKET_SCHEMA, tickets
from nodeagent.config import resolve
from nodeagent.node import Node
from nodeagent.tasks.contracts import ChatTask, ExtractTask
from nodeagent.tasks.decoding.decoder import DecodeSpec
from nodeagent.tasks.runner import TaskRunner
from nodeagent.tasks.schema import validate_output

PERSON = {"type": "object", "additionalProperties": False, "required": ["first_name", "age", "home_city"],
          "properties": {"first_name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 130},
                         "home_city": {"type": "string", "maxLength": 12}}}


class Counted(Stubborn):
    """Counts the model steps (evaluations) after the prompt and the tokens they carried."""

    def __init__(self, prefs: dict[str, float]) -> None:
        super().__init__(prefs)
        self.steps: list[int] = []

    def eval(self, tokens: list[int]):
        self.steps.append(len(tokens))
        return super().eval(tokens)


def extract(session, schema: dict, fast_forward: bool, **kw):
    """Under the schema's own grammar (copy none): with copying, "anything" would be the only span a name could
    take, and the grammar would write it alone (tests/test_copying.py covers that grammar)."""
    return TaskRunner(session, decoding=DecodeSpec(fast_forward=fast_forward), **kw).run(ExtractTask(input="anything", schema=schema,
                                                                                copy="none"))


def test_forced_tokens_ride_in_the_sampled_token_s_step_and_write_the_same_text():
    prefs = {"a": 3, "1": 2, '"': 1}
    plain, fast = Counted(prefs), Counted(prefs)
    off, on = extract(plain, PERSON, False), extract(fast, PERSON, True)
    assert off.status == on.status == "ok" and validate_output(PERSON, on.output) is None
    assert on.output == off.output and on.tokens.generated == off.tokens.generated
    decode_off, decode_on = plain.steps[1:], fast.steps[1:]  # the prompt's own evaluation first
    assert all(n == 1 for n in decode_off)  # a step per token
    assert len(decode_on) < 0.6 * len(decode_off)  # the keys' rest, quotes, colons, commas, the closing brace
    assert max(decode_on) > 5  # a forced run in one step
    # the same tokens evaluated (less the answer's last forced ones, after which nothing is asked of the model)
    assert sum(decode_off) - 3 <= sum(decode_on) <= sum(decode_off)


def test_the_guards_hold_with_forced_tokens():
    r = extract(SameKey(keys=2), FREE_KEYS, True)  # wants "a" twice: rolled back and steered to "b"
    assert r.status == "ok" and r.output == {"a": 1, "b": 1}
    r = extract(SameKey(keys=10_000), FREE_KEYS, True)
    assert r.status == "error" and r.error.code == "duplicate_key"
    r = extract(Stubborn(ESCAPES), NOTE, True, max_string_chars=None)  # an escape loop, broken
    assert r.status == "ok" and validate_output(NOTE, r.output) is None and r.tokens.generated < 200


def test_log_probabilities_cover_every_token_so_nothing_is_forced():
    from nodeagent.tasks.decoding.decoder import DecodeSpec, decode
    from nodeagent.tasks.decoding.sampling import Sampling

    session = Counted({"a": 3, "1": 2, '"': 1})
    runner = TaskRunner(session, decoding=DecodeSpec(fast_forward=True))
    matcher = runner.matcher(llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(PERSON), defaults={"whitespace_flexible": False}))
    prompt = session.tokenize("write it: ")
    d = decode(session, prompt, matcher, DecodeSpec(200, Sampling(top_logprobs=2), fast_forward=True, draft_tokens=8),
               {}, lambda n: None, runner.clock)
    assert d.forced == 0 and d.drafted == 0 and len(d.logprobs) == len(d.tokens) > 10
    assert all(n == 1 for n in session.steps[1:])


def chat(node: Node, **request) -> dict:
    r = node.run(ChatTask(request={"model": "smollm2", "messages": [
        {"role": "user", "content": "Ana is 31 and lives in Porto. Reply in JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}, **request}))
    assert r.status == "ok", r.error
    return r.output


def test_chat_with_a_schema_under_max_tokens_and_with_log_probabilities(smollm2_path):
    with Node(str(smollm2_path), config=resolve(env={}), task="extract", ctx_tokens=1024) as node:
        assert node.runner().decoding.fast_forward
        for budget in (1, 2, 3):  # the keys, quotes and colons are forced, so free: cut within the values
            out = chat(node, max_tokens=budget)
            assert out["usage"]["completion_tokens"] <= budget and out["choices"][0]["finish_reason"] == "length"
            assert out["choices"][0]["message"]["content"].startswith('{"first_name": "')  # forced: free
        whole = chat(node)
        assert validate_output(PERSON, json.loads(whole["choices"][0]["message"]["content"])) is None
        # asked for log-probabilities, every token of the answer carries its own: none is taken forced
        out = chat(node, logprobs=True, top_logprobs=2)
        content = out["choices"][0]["logprobs"]["content"]
        assert len(content) == out["usage"]["completion_tokens"] and all(c["logprob"] <= 0 for c in content)
        assert "".join(c["token"] for c in content) == out["choices"][0]["message"]["content"]
        assert out["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"]


def test_smollm2_with_forced_tokens_same_twice_valid_and_fewer_steps(smollm2_path):
    texts = tickets(6)
    with Node(str(smollm2_path), config=resolve(env={}), task="extract", ctx_tokens=1024,
              deterministic=True) as node:
        runner = node.runner()
        engine = node.load()._engine

        def outputs(fast: bool) -> tuple[list, int, int]:
            runner.decoding = replace(runner.decoding, fast_forward=fast)
            steps, generated, out = engine.steps, 0, []
            for t in texts:
                r = node.extract(t, TICKET_SCHEMA)
                assert r.status == "ok" and validate_output(TICKET_SCHEMA, r.output) is None, r.error
                out.append(r.output)
                generated += r.tokens.generated
            return out, engine.steps - steps, generated

        on, on_steps, on_generated = outputs(True)
        again, _, _ = outputs(True)
        assert again == on  # deterministic: the same request, the same answer
        off, off_steps, off_generated = outputs(False)
        # each step reads every weight: with the forced tokens riding along there are far fewer of them
        assert on_steps < 0.85 * off_steps, (on_steps, off_steps)
        same = sum(a == b for a, b in zip(on, off))
        assert same >= len(texts) // 2, (same, on, off)  # a batch of k tokens sums in another order: near, not equal


def test_forced_runs_in_slots_decode_as_each_slot_alone(smollm2_path):
    """Four tasks at once, their forced runs in steps beside the other slots' single tokens (that the steps are
    shared, and every output valid, is tests/test_slots.py's, which runs with forced tokens on by default)."""
    texts = tickets(7)
    with Node(str(smollm2_path), config=resolve(env={}), slots=4, ctx_tokens=1024, task="extract") as node:
        node.extract(texts[0], TICKET_SCHEMA)  # the prompt's prefix in a slot's cells, for the others to borrow
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda t: node.extract(t, TICKET_SCHEMA), texts))
    with Node(str(smollm2_path), config=resolve(env={}), slots=1, ctx_tokens=1024, task="extract") as node:
        alone = [node.extract(t, TICKET_SCHEMA) for t in texts]
    assert all(r.status == "ok" and validate_output(TICKET_SCHEMA, r.output) is None for r in together + alone)
    same = sum(a.output == b.output for a, b in zip(together, alone))
    assert same >= len(texts) // 2, same  # as each would alone, but for the batch's floating-point sums


@pytest.mark.parametrize("fast", [True, False])
def test_the_setting_reaches_the_runner(fast, smollm2_path):
    env = {"NODEAGENT_FAST_FORWARD": "1" if fast else "0"}
    with Node(str(smollm2_path), config=resolve(env=env), task="extract", ctx_tokens=1024) as node:
        assert node.runner().decoding.fast_forward is fast
