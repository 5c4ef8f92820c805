"""Drafts from the input: a string value's continuation guessed from the input, verified by the model in one step
(``SlotSession.eval_draft``: the longest prefix greedy decoding would have chosen, the rest of the cells removed),
through the same guards as a chosen token; the draft length that pays, chosen from `nodeagent bench`'s
measurements and said in the plan.

On a fake model that copies its input (its preferences depend on the context, so the two modes must write the same
text) and on real SmolLM2, alone and across slots."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from nodeagent.backends.fake import EOS, N_VOCAB, FakeSession, FakeSpec
from nodeagent.config import resolve
from nodeagent.node import Node
from nodeagent.planner.drafts import choose_draft, gain_at, step_cost
from nodeagent.tasks.contracts import ChatTask, ExtractTask
from nodeagent.tasks.decoding import guards as decode_mod
from nodeagent.tasks.decoding.decoder import DecodeSpec
from nodeagent.tasks.decoding.drafts import InputDrafts
from nodeagent.tasks.decoding.reading import any_json
from nodeagent.tasks.runner import TaskRunner
from nodeagent.tasks.schema import validate_output

NOTE = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"],
        "additionalProperties": False}
CONTACT = {"type": "object", "additionalProperties": False, "required": ["name", "email", "city"],
           "properties": {"name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "maxLength": 60},
                          "city": {"type": "string", "maxLength": 30}}}
CARDS = ["Met Ana Lima at the Porto fair; write to ana.lima@example.org about the Lisbon office.",
         "Kemal Okafor (Nairobi) asked for a call: kemal.okafor@example.net, any weekday.",
         "From: Greta Berg <greta.berg@example.com>, Tromsø. Re: the invoice for March.",
         "Hiro Tanaka from Osaka wrote in; his address is hiro.tanaka@example.org.",
         "Please add Lena Novak, Graz, lena.novak@example.com, to the list.",
         "Contact Jonas Silva in Leeds at jonas.silva@example.net for the samples."]


class CopyCat(FakeSession):
    """A model that writes ``{"note": "<value>"}``: the next character of that text while what it wrote so far is
    its beginning, else its fixed preferences. Verifies drafts as greedy decoding would, one position at a time
    (the fake's steps cost nothing; ``steps`` counts the evaluations a decode asked for)."""

    def __init__(self, value: str, prefs: dict[str, float] | None = None) -> None:
        super().__init__(FakeSpec(), 4096)
        self.target = '{"note": "' + value + '"}'
        self.prefs = np.full(N_VOCAB, -5.0, dtype=np.float32)
        for ch, score in (prefs or {}).items():
            self.prefs[ord(ch)] = score
        self.prefs[EOS] = 0.0
        self.steps = 0
        self.drafted: list[tuple[int, int]] = []

    def _logits(self) -> np.ndarray:
        text = self.detokenize(self._tokens).rsplit("assistant\n", 1)[-1]
        logits = self.prefs.copy()
        if self.target.startswith(text) and len(text) < len(self.target):
            logits[ord(self.target[len(text)])] = 20.0
        return logits

    def eval(self, tokens: list[int]) -> np.ndarray:
        self.steps += 1
        return super().eval(tokens)

    def eval_draft(self, tokens: list[int], draft: list[int]) -> tuple[int, np.ndarray]:
        self.steps += 1
        logits = super().eval(tokens)
        kept = 0
        for t in draft:
            if int(np.argmax(logits)) != t:
                break
            logits = super().eval([t])
            kept += 1
        self.drafted.append((len(draft), kept))
        return kept, logits


def extract(session, text: str, drafts: int, schema: dict = NOTE, **kw):
    return TaskRunner(session, decoding=DecodeSpec(draft_tokens=drafts), **kw).run(ExtractTask(input=text, schema=schema))


def test_a_value_copied_from_the_input_takes_far_fewer_steps_and_writes_the_same():
    value = "the quarterly report is due on the ninth of March at noon"
    text = f"Reminder: {value}. Thanks!"
    plain, drafting = CopyCat(value), CopyCat(value)
    off, on = extract(plain, text, 0), extract(drafting, text, 8)
    assert off.status == on.status == "ok" and on.output == off.output == {"note": value}
    assert sum(k for _, k in drafting.drafted) > 0.7 * len(value)  # nearly all of the value came as drafts
    assert all(n <= 8 for n, _ in drafting.drafted)
    assert drafting.steps < 0.5 * plain.steps, (drafting.steps, plain.steps)


def test_a_guard_refuses_a_drafted_token_as_it_would_a_chosen_one(monkeypatch):
    """The input holds a run of 40 "a": the model would copy it all; the repetition guard ends it at 12, drafted
    or not, and the text is the same either way."""
    run = "a" * 40
    prefs = {"b": 3, '"': 2}
    off = extract(CopyCat(run, prefs), f"x {run} y", 0)
    on = extract(CopyCat(run, prefs), f"x {run} y", 8)
    assert off.status == on.status == "ok" and on.output == off.output
    assert on.output["note"].startswith("a" * 12) and not on.output["note"].startswith("a" * 13)
    refused = []
    real = decode_mod.cycle_token
    monkeypatch.setattr(decode_mod, "cycle_token", lambda out: refused.append(1) or real(out))
    again = CopyCat(run, prefs)
    assert extract(again, f"x {run} y", 8).output == on.output
    assert any(n > 0 for n, _ in again.drafted) and refused


def test_drafts_stay_within_max_string_chars_and_the_schema():
    value = "0123456789" * 8
    on = extract(CopyCat(value), f"id {value}", 16, max_string_chars=25)
    assert on.status == "ok" and on.output["note"] == value[:25]


def test_no_drafts_with_sampling_or_log_probabilities():
    from nodeagent.tasks.decoding.decoder import DecodeSpec, decode
    from nodeagent.tasks.decoding.sampling import Sampling

    value = "the quarterly report is due on the ninth of March"
    for sampling in (Sampling(temperature=0.7, seed=3), Sampling(top_logprobs=2), Sampling(logit_bias={65: 1.0})):
        session = CopyCat(value)
        runner = TaskRunner(session)
        import llguidance

        matcher = runner.matcher(llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(NOTE), defaults={"whitespace_flexible": False}))
        prompt = session.tokenize(f"copy: {value}\n<|im_start|>assistant\n")
        d = decode(session, prompt, matcher, DecodeSpec(200, sampling, fast_forward=True, draft_tokens=8), {},
                   lambda n: None, runner.clock)
        assert d.drafted == 0 and not session.drafted


def test_input_drafts_continue_the_longest_tail_found():
    class Chars:
        def tokenize_continuation(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    d = InputDrafts(Chars(), "Ana Lima wrote. Then: Ana Costa, ana.costa@example.org, Porto.")
    as_text = lambda tokens: "".join(map(chr, tokens))  # noqa: E731
    assert as_text(d.propose("Ana", 6)) == " Costa"  # the last "Ana": the input comes after the instructions
    assert as_text(d.propose("Ana L", 5)) == "ima w"  # the longest tail found decides
    assert as_text(d.propose("ana.costa@ex", 8)) == "ample.or"
    assert d.propose("An", 5) == [] and d.propose("zzz", 5) == [] and d.propose("Ana", 0) == []


def test_the_follower_follows_the_string_value_being_written():
    tail = any_json()
    tail.feed(b'{"name": "Ana Li')
    assert tail.string_value() == "Ana Li" and tail.key_being_written() is None
    tail.feed(b'ma", "ci')
    assert tail.string_value() is None and tail.key_being_written() == "ci"
    tail.feed(b'ty": ["Por')
    assert tail.string_value() == "Por"


def test_the_draft_length_that_pays_is_chosen_from_the_measurements():
    flat = {1: 0.010, 2: 0.0102, 3: 0.0104, 5: 0.0108, 9: 0.0116, 17: 0.0135}  # a GPU: a few tokens cost one's
    linear = {1: 0.010, 2: 0.019, 3: 0.027, 5: 0.043, 9: 0.075, 17: 0.14}  # a small CPU: nearly in proportion
    copies = [(16, 16)] * 10 + [(16, 6)] * 10 + [(16, 0)] * 10  # what the model kept of drafts of 16
    on = choose_draft(flat, copies, 16)
    assert on.draft_tokens >= 8 and on.gain > 2 and "tokens a step" in on.reason
    off = choose_draft(linear, copies, 16)
    assert off.draft_tokens == 0 and off.gain == 1.0 and "do not pay" in off.reason
    assert choose_draft(flat, [], 16).draft_tokens == 0
    # the node's own time a step dilutes llama.cpp's: what does not pay on the model's cost alone may with it
    assert gain_at(2, linear, copies, overhead_s=0.05) > gain_at(2, linear, copies)
    assert step_cost(linear, 4) == pytest.approx(0.035) and step_cost(linear, 20) > 0.14


# -- real SmolLM2 ---------------------------------------------------------------------------------------------------

def test_eval_draft_keeps_what_greedy_decoding_would_and_removes_the_rest(smollm2_path):
    with Node(str(smollm2_path), config=resolve(env={}), task="extract", ctx_tokens=1024) as node:
        s = node.runner().session
        prompt = s.tokenize("The capital of France is Paris. The capital of Italy is")
        s.truncate(0)
        logits = s.prefill(prompt)
        greedy = []
        for _ in range(6):  # the model's own continuation, one step a token
            greedy.append(int(np.argmax(logits)))
            logits = s.eval(greedy[-1:])
        s.truncate(len(prompt) - 1)
        wrong = (greedy[5] + 1) % s.n_vocab
        kept, after = s.eval_draft(prompt[-1:], greedy[:5] + [wrong])  # all but the last as the model would
        assert kept == 5 and s.n_tokens == len(prompt) + 5
        assert int(np.argmax(after)) == greedy[5]  # the logits after what was kept
        s.truncate(len(prompt))
        kept, after = s.eval_draft(greedy[:1], [0, 1, 2])  # nothing the model would write
        assert kept == 0 and s.n_tokens == len(prompt) + 1 and int(np.argmax(after)) == greedy[1]
        assert int(np.argmax(s.eval(greedy[1:2]))) == greedy[2]  # the removed cells are gone: decoding goes on


def _node(path: Path, **kw) -> Node:
    # the thread count held: a governor that gives a thread up while the shared cores are busy sums in another
    # order, which is a difference these comparisons are not about
    env = {"NODEAGENT_DRAFT_TOKENS": "8", "NODEAGENT_THREADS_ADAPT": "0"}
    return Node(str(path), config=resolve(env=env), task="extract", ctx_tokens=1024, **kw)


def test_smollm2_with_drafts_same_twice_valid_and_fewer_steps(smollm2_path):
    with _node(smollm2_path, deterministic=True) as node:
        runner = node.runner()
        assert runner.decoding.draft_tokens == 8 and node.plan.draft_tokens == 8

        def outputs(drafts: int) -> tuple[list, int, int]:
            runner.decoding = replace(runner.decoding, draft_tokens=drafts)
            steps, kept, out = runner.steps, sum(k for _, k in runner.drafts), []
            for t in CARDS:
                r = node.extract(t, CONTACT)
                assert r.status == "ok" and validate_output(CONTACT, r.output) is None, r.error
                out.append(r.output)
            return out, runner.steps - steps, sum(k for _, k in runner.drafts) - kept

        on, on_steps, kept = outputs(8)
        again, _, _ = outputs(8)
        assert again == on  # deterministic: the same request, the same answer, drafts and all
        off, off_steps, none = outputs(0)
        assert kept > 20 and none == 0
        assert on_steps < 0.85 * off_steps, (on_steps, off_steps)
        same = sum(a == b for a, b in zip(on, off))
        assert same >= len(CARDS) // 2, (same, on, off)  # a batch of k tokens sums in another order: near


def test_drafts_and_forced_runs_in_slots_decode_as_each_slot_alone(smollm2_path):
    with _node(smollm2_path, slots=4) as node:
        node.extract(CARDS[0], CONTACT)
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda t: node.extract(t, CONTACT), CARDS))
        assert sum(k for r in node._ensure_runners() for _, k in r.drafts) > 10
    with _node(smollm2_path, slots=1) as node:
        alone = [node.extract(t, CONTACT) for t in CARDS]
    assert all(r.status == "ok" and validate_output(CONTACT, r.output) is None for r in together + alone)
    same = sum(a.output == b.output for a, b in zip(together, alone))
    assert same >= len(CARDS) // 2, same


SAVE = {"type": "function", "function": {"name": "save_contact", "description": "Save a contact",
                                         "parameters": CONTACT}}


def chat(node: Node, card: str = CARDS[0], **request) -> dict:
    r = node.run(ChatTask(request={"model": "smollm2", "messages": [
        {"role": "user", "content": f"Who is this, and where? {card} Reply in JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "contact", "schema": CONTACT}},
        **request}))
    assert r.status == "ok", r.error
    return r.output


def test_tool_calls_with_drafts_survive_the_max_tokens_people_set(smollm2_path):
    with _node(smollm2_path) as node:
        runner = node.runner()
        for card in CARDS[:3]:
            for budget in (40, 60, 90, 120):  # the call keeps room to close, drafted tokens and all
                r = node.run(ChatTask(request={
                    "model": "smollm2", "max_tokens": budget, "tools": [SAVE], "tool_choice": "required",
                    "messages": [{"role": "user", "content": f"Save this contact: {card}"}]}))
                assert r.status == "ok", r.error
                out = r.output
                calls = out["choices"][0]["message"]["tool_calls"]
                assert out["usage"]["completion_tokens"] <= budget and len(calls) == 1
                args = json.loads(calls[0]["function"]["arguments"])
                assert validate_output(CONTACT, args) is None, (budget, args)
        assert sum(k for _, k in runner.drafts) > 0


def test_chat_with_a_schema_with_drafts_and_with_log_probabilities(smollm2_path):
    with _node(smollm2_path) as node:
        runner = node.runner()
        whole = chat(node)
        drafted = len(runner.drafts)
        out = chat(node, logprobs=True, top_logprobs=2)  # every token its own step and log-probability
        assert len(runner.drafts) == drafted
        content = out["choices"][0]["logprobs"]["content"]
        assert len(content) == out["usage"]["completion_tokens"] and all(c["logprob"] <= 0 for c in content)
        assert "".join(c["token"] for c in content) == out["choices"][0]["message"]["content"]
        assert validate_output(CONTACT, json.loads(whole["choices"][0]["message"]["content"])) is None


# -- the plan ---------------------------------------------------------------------------------------------------

def test_the_plan_takes_the_measured_draft_length_and_says_why(smollm2_path, tmp_path):
    from nodeagent.store.measured import record_path

    env = {"NODEAGENT_HOME": str(tmp_path)}

    def plan(task: str = "extract", **extra: str):
        return Node(str(smollm2_path), config=resolve(env={**env, **extra}), task=task, ctx_tokens=1024).plan

    p = plan()
    assert p.draft_tokens == 0 and any("off until `nodeagent bench` measures" in r for r in p.reasons)
    record = record_path(tmp_path, smollm2_path.name)
    record.parent.mkdir(parents=True)
    reason = "drafts from the input: up to 6 tokens a step (a step of 7 tokens costs x1.10 one of 1)"
    record.write_text(json.dumps({"model_file": smollm2_path.name, "tasks_per_s": 1.0, "created": "2026-12-03T10:00:00Z",
                                  "drafts": {"draft_tokens": 6, "gain": 1.8, "reason": reason}}))
    p = plan()
    assert p.draft_tokens == 6 and any(r.startswith(reason) and "nodeagent bench on 2026-12-03" in r
                                       for r in p.reasons)
    assert p.settings.n_outputs_max >= 7 * p.settings.slots  # a logits row for each token of a drafting step
    assert plan(NODEAGENT_DRAFT_TOKENS="0").draft_tokens == 0  # the setting wins
    assert plan(NODEAGENT_DRAFT_TOKENS="3").draft_tokens == 3
    assert not any("drafts" in r for r in plan("classify").reasons)
    with Node(str(smollm2_path), config=resolve(env=env), task="extract", ctx_tokens=1024) as node:
        assert node.runner().decoding.draft_tokens == 6
