"""Classification's scoring options on made-up logits: contextual calibration, length normalisation, the JSON
answer's prefix and tokens, and examples rendered as turns. The runner is the real one; the session is the
fake backend's byte vocabulary with logits designed per input (the other side of the boundary)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from nodeagent.backends.fake import FakeSession, FakeSpec
from nodeagent.errors import validation_message
from nodeagent.tasks.contracts import ClassifyTask
from nodeagent.tasks.prompts import ANSWER_PREFIX, NEUTRAL_INPUTS, classify_messages, render_prompt
from nodeagent.tasks.runner import TaskRunner, calibrated

END = "<|im_end|>"


class Designed(FakeSession):
    """Logits designed per user input: where the answer starts, ``first[input]`` gives each label's first
    character its log-probability (the rest of the vocabulary gets none); after a label's first character the
    next characters of that label (or the JSON string's closing quote) are certain."""

    def __init__(self, first: dict[str, dict[str, float]], labels: list[str]) -> None:
        super().__init__(FakeSpec.parse("fake"), 4096)
        self.first, self.labels = first, labels
        self.prompts: list[str] = []

    def prefill(self, tokens: list[int]) -> np.ndarray:
        self.prompts.append(self.detokenize(tokens))
        return super().prefill(tokens)

    def _logits(self) -> np.ndarray:
        text = self.detokenize(self._tokens)
        user = text.rsplit("<|im_start|>user\n", 1)[1].split(END, 1)[0]
        answer = text.rsplit("<|im_start|>assistant\n", 1)[1]
        if answer.startswith(ANSWER_PREFIX):
            answer = answer[len(ANSWER_PREFIX):]
        out = np.full(self.n_vocab, -1e4, dtype=np.float32)
        if not answer:
            for label, logp in self.first[user].items():
                out[ord(label[0])] = logp
            return out
        label = next(lb for lb in self.labels if (lb + '"').startswith(answer))
        rest = (label + '"')[len(answer):] or END
        out[self.tokenize(rest)[0]] = 0.0
        return out


def runner_for(first: dict[str, dict[str, float]], labels: list[str]) -> tuple[TaskRunner, Designed]:
    session = Designed(first, labels)
    return TaskRunner(session), session


LABELS = ["alpha", "beta", "gamma"]
TEXT = "the text"
# the prompt favours alpha whatever the input: a content-free input gets alpha 0.6, beta 0.3, gamma 0.1
BIAS = dict(zip(LABELS, np.log([0.6, 0.3, 0.1])))
SCORES = {TEXT: dict(zip(LABELS, np.log([0.5, 0.3, 0.2]))), **{n: BIAS for n in NEUTRAL_INPUTS}}


@pytest.mark.parametrize("answer", ["label", "json"])
def test_calibration_divides_by_the_content_free_probabilities(answer):
    runner, session = runner_for(SCORES, LABELS)
    plain = runner.run(ClassifyTask(input=TEXT, labels=LABELS, answer=answer, calibrate=False)).output
    assert plain.label == "alpha"
    assert plain.probabilities == pytest.approx(dict(zip(LABELS, [0.5, 0.3, 0.2])), abs=1e-6)
    fixed = runner.run(ClassifyTask(input=TEXT, labels=LABELS, answer=answer, calibrate=True)).output
    # p(l | text) / p(l | neutral), renormalised: 0.5/0.6, 0.3/0.3, 0.2/0.1 -> 0.833, 1, 2 over 3.833
    ratio = np.array([0.5 / 0.6, 1.0, 2.0])
    assert fixed.probabilities == pytest.approx(dict(zip(LABELS, ratio / ratio.sum())), abs=1e-6)
    assert fixed.label == "gamma"  # the favoured label lost exactly its favour
    # the neutral inputs went through the same prompt: every one of them, once (then cached)
    neutral_prompts = [p for p in session.prompts if TEXT not in p]
    assert sorted(p.rsplit("<|im_start|>user\n", 1)[1].split(END)[0] for p in neutral_prompts) == \
        sorted(NEUTRAL_INPUTS)
    runner.run(ClassifyTask(input=TEXT, labels=LABELS, answer=answer, calibrate=True))
    assert len([p for p in session.prompts if TEXT not in p]) == len(NEUTRAL_INPUTS)


def test_calibration_averages_the_neutral_inputs():
    biased = {"N/A": dict(zip(LABELS, np.log([0.7, 0.2, 0.1]))), "": dict(zip(LABELS, np.log([0.5, 0.4, 0.1]))),
              "[MASK]": dict(zip(LABELS, np.log([0.6, 0.3, 0.1])))}
    runner, _ = runner_for({TEXT: SCORES[TEXT], **biased}, LABELS)
    out = runner.run(ClassifyTask(input=TEXT, labels=LABELS, calibrate=True)).output
    neutral = np.mean([[0.7, 0.2, 0.1], [0.5, 0.4, 0.1], [0.6, 0.3, 0.1]], axis=0)
    assert list(out.probabilities.values()) == pytest.approx(list(calibrated(np.array([0.5, 0.3, 0.2]), neutral)))


def test_calibrated_formula_on_its_own():
    probs, neutral = np.array([0.2, 0.8]), np.array([0.1, 0.9])
    assert calibrated(probs, neutral) == pytest.approx(np.array([2.0, 8 / 9]) / (2.0 + 8 / 9))
    assert calibrated(probs, np.array([0.5, 0.5])) == pytest.approx(probs)  # an unbiased prompt: unchanged


def test_multi_label_chooses_every_label_at_the_threshold_from_single_labels_probabilities():
    runner, _ = runner_for(SCORES, LABELS)
    ratio = np.array([0.5 / 0.6, 1.0, 2.0])  # calibrated as single-label: 0.217, 0.261, 0.522
    cal = runner.run(ClassifyTask(input=TEXT, labels=LABELS, multi_label=True, calibrate=True,
                                  threshold=0.25)).output
    assert cal.probabilities == pytest.approx(dict(zip(LABELS, ratio / ratio.sum())), abs=1e-6)
    assert cal.labels == ["beta", "gamma"] and cal.label == "gamma"
    # auto: 1 / K = 1/3, the share each label gets when the prompt favours none
    auto = runner.run(ClassifyTask(input=TEXT, labels=LABELS, multi_label=True)).output
    assert auto.probabilities == cal.probabilities and auto.labels == ["gamma"]
    raw = runner.run(ClassifyTask(input=TEXT, labels=LABELS, multi_label=True, calibrate=False)).output
    assert raw.probabilities == pytest.approx(dict(zip(LABELS, [0.5, 0.3, 0.2])), abs=1e-6)
    assert raw.labels == ["alpha"] and raw.label == "alpha"  # 0.3 is under 1/3
    assert runner.run(ClassifyTask(input=TEXT, labels=LABELS, multi_label=True, calibrate=False,
                                   threshold=0.15)).output.labels == LABELS


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.1, "often", None, [0.5]])
def test_a_threshold_out_of_range_gets_one_message(value):
    with pytest.raises(ValidationError) as info:
        ClassifyTask(input=TEXT, labels=LABELS, multi_label=True, threshold=value)
    message = validation_message(info.value)
    assert 'threshold must be a probability above 0 and below 1, or "auto"' in message and repr(value) in message
    assert ClassifyTask(input=TEXT, labels=LABELS, threshold="0.3").threshold == 0.3  # as the CLI passes it


def test_length_normalisation_scores_the_mean_per_token():
    """'ab' is two tokens (its second certain after the first), 'c' one; under a bare answer the sum gives them
    what their first tokens give, the mean halves the longer label's log-probability."""
    labels = ["ab", "c"]
    scores = {TEXT: {"ab": np.log(0.4), "c": np.log(0.6)}}
    runner, _ = runner_for(scores, labels)
    total = runner.run(ClassifyTask(input=TEXT, labels=labels, answer="label", calibrate=False)).output
    # the label 'ab' ends after 'b' (its continuation, the end of the answer, is certain): log 0.4 + 0
    assert total.probabilities["ab"] == pytest.approx(0.4, abs=1e-6)
    mean = runner.run(ClassifyTask(input=TEXT, labels=labels, answer="label", calibrate=False,
                                   length_norm=True)).output
    a, c = np.exp(np.log(0.4) / 2), 0.6  # mean log-probability over 2 tokens against 1
    assert mean.probabilities["ab"] == pytest.approx(a / (a + c), abs=1e-6)


def test_json_answer_scores_the_label_after_the_json_routes_prefix():
    runner, session = runner_for(SCORES, LABELS)
    task = ClassifyTask(input=TEXT, labels=LABELS, answer="json", calibrate=False)
    runner.run(task)
    prompt = session.prompts[0]
    rendered = render_prompt(session, classify_messages(task)).text
    assert prompt == rendered + '{"label": "'  # the generation prompt, then the answer's own prefix
    # the system prompt is the JSON route's own (the labels listed), the same as the bare answer's
    bare = ClassifyTask(input=TEXT, labels=LABELS, answer="label")
    assert classify_messages(task)[0] == classify_messages(bare)[0]
    assert all(f"- {lb}" in classify_messages(task)[0]["content"] for lb in LABELS)
    # each label is scored as the JSON string's content, no closing quote: the same tree of label tokens as the
    # bare answer's (so no deeper), and the same probabilities on these logits
    trees: dict[str, list[list[int]]] = {}
    for answer in ("json", "label"):
        r, sess = runner_for(SCORES, LABELS)
        real = sess.eval_tree
        sess.eval_tree = lambda parents, tokens, real=real, answer=answer: (
            trees.setdefault(answer, []).append(list(tokens)) or real(parents, tokens))
        out = r.run(task.model_copy(update={"answer": answer})).output
        assert out.probabilities == pytest.approx(dict(zip(LABELS, [0.5, 0.3, 0.2])), abs=1e-6)
    assert trees["json"] == trees["label"]
    assert sorted(trees["json"][0]) == sorted(map(ord, "alphbetgamm"))  # every label's inner nodes, no quote
    assert render_prompt(session, classify_messages(bare)).text.endswith("<|im_start|>assistant\n")


def test_json_answer_escapes_a_label_as_json_does():
    """A label with a quote is scored as the JSON route would write it: escaped as JSON string content."""
    runner, _ = runner_for({}, [])
    seqs = []
    real = runner.session.tokenize_continuation
    runner.session.tokenize_continuation = lambda text: seqs.append(text) or real(text)
    runner.session.first = {TEXT: {'s': 0.0, "p": -1.0}}
    runner.session.labels = ['say \\"hi\\"', "plain"]
    out = runner.run(ClassifyTask(input=TEXT, labels=['say "hi"', "plain"], calibrate=False))
    assert out.status == "ok", out.error
    assert 'say \\"hi\\"' in seqs and "plain" in seqs


def test_examples_are_rendered_as_turns_in_the_answers_form():
    examples = [{"text": "first example", "label": "beta"}, {"text": "second example", "label": "alpha"}]
    task = ClassifyTask(input=TEXT, labels=LABELS, examples=examples)
    messages = classify_messages(task)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages[1:]] == ["first example", '{"label": "beta"}', "second example",
                                                   '{"label": "alpha"}', TEXT]
    bare = classify_messages(task.model_copy(update={"answer": "label"}))
    assert [m["content"] for m in bare[1:]] == ["first example", "beta", "second example", "alpha", TEXT]
    # and they reach the model: the prompt the runner scores holds them, before the input
    runner, session = runner_for(SCORES, LABELS)
    runner.run(task.model_copy(update={"calibrate": False}))
    prompt = session.prompts[0]
    assert prompt.index("first example") < prompt.index('{"label": "beta"}') < prompt.index(TEXT)


def test_descriptions_are_listed_with_the_labels():
    task = ClassifyTask(input=TEXT, labels=[{"name": "alpha", "description": "the first"}, "beta"])
    system = classify_messages(task)[0]["content"]
    assert "- alpha: the first" in system and "- beta" in system


def test_an_example_must_name_a_label_of_the_task():
    with pytest.raises(ValidationError, match="names no label"):
        ClassifyTask(input=TEXT, labels=LABELS, examples=[{"text": "x", "label": "delta"}])
    with pytest.raises(ValidationError) as bad:
        ClassifyTask(input=TEXT, labels=LABELS, calibrate="sometimes")
    # one message that names every accepted value (not only the boolean branch of bool | "auto")
    assert validation_message(bad.value) == 'calibrate must be true, false or "auto", not \'sometimes\' (calibrate)'
    assert ClassifyTask(input=TEXT, labels=LABELS, calibrate="false").calibrate is False


def test_auto_calibrates_as_measured():
    from nodeagent.tasks.runner import calibrates

    assert calibrates(ClassifyTask(input=TEXT, labels=["a", "b", "c"]))
    assert calibrates(ClassifyTask(input=TEXT, labels=["a", "b"]))
    assert calibrates(ClassifyTask(input=TEXT, labels=["a", "b"], multi_label=True))
    assert not calibrates(ClassifyTask(input=TEXT, labels=["a", "b"], calibrate=False))
    assert calibrates(ClassifyTask(input=TEXT, labels=["a", "b"], calibrate=True))
    assert not calibrates(ClassifyTask(input=TEXT, labels=["a", "b", "c"], calibrate=False))
    runner, _ = runner_for(SCORES, LABELS)  # auto is the calibrated answer
    auto = runner.run(ClassifyTask(input=TEXT, labels=LABELS)).output
    assert auto == runner.run(ClassifyTask(input=TEXT, labels=LABELS, calibrate=True)).output


def test_a_classification_plan_cites_what_was_measured_on_the_model(gemma3_path):
    """The committed measurement (models/facts/classification.json, written by benchmarks/tasks.py) reaches the
    plan's reasons for classification, through the real CLI; other tasks' plans do not carry it."""
    import subprocess
    import sys

    from nodeagent.tasks.measured_defaults import measured

    facts = measured(gemma3_path.name)
    assert facts is not None and facts["sets"]

    def reasons(task):
        proc = subprocess.run([sys.executable, "-m", "nodeagent", "plan", str(gemma3_path), "--task", task,
                               "--json"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return [r for r in json.loads(proc.stdout)["reasons"] if r.startswith("classification measured")]

    said = reasons("classify")
    assert len(said) == 1 and f"on {len(facts['sets'])} labelled sets" in said[0]
    short = [s["set"] for s in facts["sets"] if not (s["accurate_enough"] and s["fast_enough"])]
    assert all(name in said[0] for name in short)
    assert ("falls short" in said[0]) == bool(short)
    assert reasons("extract") == []


def test_an_extraction_plan_cites_what_was_measured_on_the_model(smollm2_path):
    """models/facts/extraction.json (benchmarks/extract_quality.py) reaches the plan's reasons for extraction,
    through the real CLI, with the default it measured and where it fell short of a target, if anywhere."""
    import subprocess
    import sys

    from nodeagent.tasks.measured_defaults import measured

    facts = measured(smollm2_path.name, "extract")
    assert facts is not None and facts["sets"]
    proc = subprocess.run([sys.executable, "-m", "nodeagent", "plan", str(smollm2_path), "--task", "extract",
                           "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    said = [r for r in json.loads(proc.stdout)["reasons"] if r.startswith("extraction measured")]
    assert len(said) == 1 and f"the default ({facts['default']})" in said[0]
    short = [s["set"] for s in facts["sets"]
             if not (s["accurate_enough"] and s["fast_enough"] and s["all_valid"])]
    assert ("falls short" in said[0]) == bool(short) and all(name in said[0] for name in short)


def test_the_benchmarks_measures_on_hand_worked_cases():
    from benchmarks.stats import accuracy_se, expected_calibration_error, macro_f1

    assert accuracy_se(3, 4) == (0.75, pytest.approx((0.75 * 0.25 / 4) ** 0.5))
    # two bins: confidence 0.9 with 1 of 2 right (gap 0.4), confidence 0.6 with 2 of 2 right (gap 0.4)
    assert expected_calibration_error([0.9, 0.9, 0.6, 0.6], [True, False, True, True]) == pytest.approx(0.4)
    assert expected_calibration_error([0.8] * 5, [True] * 4 + [False]) == pytest.approx(0.0)
    # a: tp 1, fp 1, fn 1 -> F1 0.5; b: the same; c: tp 0 -> 0
    assert macro_f1(["a", "a", "b", "b", "c"], ["a", "b", "b", "a", None]) == pytest.approx((0.5 + 0.5 + 0) / 3)


def test_the_benchmarks_figures_come_from_the_raw_record_as_the_runner_computes_them():
    """benchmarks/tasks.py keeps every item's label probabilities and the content-free inputs' and computes its
    figures from them (so --from-raw can compute them again): calibration as the runner's, multi-label's
    per-label probabilities as the runner's, on a record worked by hand."""
    from benchmarks.stats import expected_calibration_error
    from benchmarks.task_classify import summarise, summarise_multi

    names = ["alpha", "beta", "gamma"]
    neutral = [0.6, 0.3, 0.1]
    record = {"latency_s": [1.0, 1.0], "rerun_diff": 0.0, "sum": [[0.5, 0.3, 0.2], [0.2, 0.7, 0.1]],
              "mean": [[0.5, 0.3, 0.2], [0.2, 0.7, 0.1]], "neutral_sum": [neutral] * 2, "neutral_mean": [neutral] * 2}
    raw = {"meta": {"what": "hand-worked"}, "gold": ["gamma", "beta"], "labels": [names, names],
           "json_route": {"latency_s": [4.0, 4.0], "pred": ["alpha", "beta"], "invalid": 0},
           "variants": {"json": record}}
    e = summarise(raw)
    assert e["json_route"]["accuracy"] == 0.5 and e["variants"]["json"]["speedup_vs_json_route"] == 4.0
    configs = e["variants"]["json"]["configs"]
    # uncalibrated: alpha (wrong), beta (right); calibrated: 0.5/0.6 : 0.3/0.3 : 0.2/0.1 -> gamma (right), and
    # 0.2/0.6 : 0.7/0.3 : 0.1/0.1 -> beta (right)
    assert configs["sum"]["accuracy"] == 0.5 and configs["sum+calibrated"]["accuracy"] == 1.0
    top = max(calibrated(np.array([0.5, 0.3, 0.2]), np.array(neutral)))
    second = max(calibrated(np.array([0.2, 0.7, 0.1]), np.array(neutral)))
    assert configs["sum+calibrated"]["ece"] == pytest.approx(1 - (top + second) / 2, abs=1e-4)

    # multi-label: text 1 carries alpha and beta, text 2 gamma; threshold 0.3
    shares = [[0.5, 0.45, 0.05], [0.3, 0.1, 0.6]]
    multi = summarise_multi({"labels": names, "gold": [["alpha", "beta"], ["gamma"]], "neutral": neutral,
                             "probs": shares, "chosen": [["alpha", "beta"], ["gamma"]], "latency_s": [0.5, 0.5],
                             "threshold": 0.3, "threshold_setting": 0.3, "calibrate": "auto"})
    truth = [True, True, False, False, False, True]
    # calibrated as single-label: 0.5/0.6 : 0.45/0.3 : 0.05/0.1 -> 0.294, 0.529, 0.176 -> beta only;
    # 0.3/0.6 : 0.1/0.3 : 0.6/0.1 -> 0.073, 0.049, 0.878 -> gamma only
    cal = [x for row in shares for x in calibrated(np.array(row), np.array(neutral))]
    assert cal[:3] == pytest.approx(np.array([5 / 6, 1.5, 0.5]) / (17 / 6))
    assert multi["calibrated"] == {"ece_per_label": pytest.approx(expected_calibration_error(cal, truth), abs=1e-4),
                                   "exact_match": 0.5, "both_found": 0.0, "precision": 1.0,
                                   "recall": pytest.approx(2 / 3, abs=1e-4)}
    assert multi["calibrated_by_threshold"]["0.2"]["both_found"] == 1.0  # alpha 0.294 and beta 0.529
    # uncalibrated, the shares: alpha and beta; alpha (0.3) and gamma -> 3 of 4 chosen right, every label found
    assert multi["uncalibrated"]["exact_match"] == 0.5 and multi["uncalibrated"]["precision"] == 0.75
    # the per-label forms on the same scores: a / (a + 2 b): 0.5/1.7, 0.45/1.05, 0.05/0.25; 0.2, 0.143, 0.75
    assert multi["share_ratio"]["ece_per_label"] == pytest.approx(
        expected_calibration_error([0.5 / 1.7, 0.45 / 1.05, 0.05 / 0.25, 0.3 / 1.5, 0.1 / 0.7, 0.6 / 0.8], truth),
        abs=1e-4)
    assert multi["share_ratio"]["exact_match"] == 0.5 and multi["share_ratio"]["both_found"] == 0.0
    # the odds ratio, a (1 - b) / (a (1 - b) + 2 b (1 - a)): 0.25, 0.488, 0.191; 0.125, 0.115, 0.871
    assert multi["odds_ratio"]["ece_per_label"] == pytest.approx(expected_calibration_error(
        [0.25, 0.315 / 0.645, 0.045 / 0.235, 0.125, 0.07 / 0.61, 0.54 / 0.62], truth), abs=1e-4)
    # at even odds, a / (a + b): 0.455, 0.6, 0.333 -> all three; 0.333, 0.25, 0.857 -> alpha and gamma
    assert multi["even_odds"]["exact_match"] == 0.0 and multi["even_odds"]["both_found"] == 1.0
    assert multi["default_exact_match"] == 1.0 and multi["tasks_per_s"] == 2.0 and multi["two_label_texts"] == 1
