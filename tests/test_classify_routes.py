"""A classify task naming no model, on a node holding an embedding model and a generator, goes by the route its
examples measured best (nodeagent/classify_routes.py): the choice itself on scripted routes (the other side of the
boundary: what each route answers), then through `serve` on all-MiniLM-L6-v2 and SmolLM2 with a topic set and a
sentiment set."""

from __future__ import annotations

import random
import re
import threading
import time

import httpx
import numpy as np
import pytest
from test_server import Served

from nodeagent.classify_routes import RouteChooser, fit_temperature, folds_of, measurable, tempered
from nodeagent.tasks.contracts import ClassifyOutput, ClassifyTask, Result

LABELS = ["a", "b", "c"]


def task_with(per_label: int, **fields) -> ClassifyTask:
    return ClassifyTask(input="x", labels=LABELS, examples=[{"text": f"{lb}{i}", "label": lb} for lb in LABELS
                                                            for i in range(per_label)], **fields)


def scripted(right: dict[str, set[str]], sure: float = 0.8):
    """A ``run`` whose route ``r`` answers the example texts in ``right[r]`` rightly (its label at ``sure``), the
    others wrongly (the next label at ``sure``); counting its calls."""
    calls: list[str] = []

    def run(task: ClassifyTask, route: str) -> Result:
        calls.append(route)
        truth = task.input[0]
        said = truth if task.input in right[route] else LABELS[(LABELS.index(truth) + 1) % 3]
        probs = {lb: sure if lb == said else (1 - sure) / 2 for lb in LABELS}
        return Result(task_id=task.id, type=task.type, status="ok", output=ClassifyOutput(label=said,
                                                                                          probabilities=probs))
    return run, calls


def test_the_route_right_most_often_on_held_out_examples_answers():
    task = task_with(4)
    texts = {ex.text for ex in task.examples}
    run, calls = scripted({"emb": {t for t in texts if not t.endswith("0")}, "gen": {t for t in texts if
                                                                                      t.endswith("0")}})
    choice = RouteChooser().choose(task, ["emb", "gen"], run)
    assert choice.best.route != "gen" and choice.best.accuracy == 0.75 and choice.examples == 12
    assert {s.route: s.accuracy for s in choice.scores if s.route != "emb + gen"} == {"emb": 0.75, "gen": 0.25}
    assert len(calls) == 24  # each example once per route, held out of its own fold's examples
    assert choice.folds == 4 and sorted(i for f in folds_of(task) for i in f) == list(range(12))
    for fold in folds_of(task):  # each fold holds every label
        assert {task.examples[i].label for i in fold} == set(LABELS)


def test_the_combination_answers_where_it_measures_better_and_a_tie_goes_to_the_lower_log_loss():
    task = task_with(2)
    texts = sorted(ex.text for ex in task.examples)
    # each route right on half, and unsure where it is wrong: the average is right wherever one of them is sure
    run, _ = scripted({"emb": set(texts[:3]), "gen": set(texts[3:])}, sure=0.8)

    def hedged(t: ClassifyTask, route: str) -> Result:
        result = run(t, route)
        if result.output.label != t.input[0]:  # wrong, but barely: the right label close behind
            probs = {lb: 0.4 if lb == result.output.label else 0.35 if lb == t.input[0] else 0.25 for lb in LABELS}
            result = result.model_copy(update={"output": ClassifyOutput(label=result.output.label,
                                                                        probabilities=probs)})
        return result

    choice = RouteChooser().choose(task, ["emb", "gen"], hedged)
    assert choice.best.route == "emb + gen" and choice.best.accuracy == 1.0
    assert choice.route_for(task_with(2, multi_label=True)).route in ("emb", "gen")  # multi-label: one route's own
    same, _ = scripted({"emb": set(texts), "gen": set(texts)}, sure=0.9)
    assert RouteChooser().choose(task, ["emb", "gen"], same).best.route == "emb"  # a tie: the cheaper route


def test_a_slower_route_must_be_better_by_more_than_the_noise_of_the_examples():
    """The one-standard-error rule: the cheapest route within one SE of the most accurate answers."""
    task = task_with(4)
    texts = sorted(ex.text for ex in task.examples)
    close, _ = scripted({"emb": set(texts[:9]), "gen": set(texts[:10])})  # 9 and 10 of 12: within its SE
    choice = RouteChooser().choose(task, ["emb", "gen"], close)
    assert {s.route: s.accuracy for s in choice.scores if " + " not in s.route} == {"emb": 0.75, "gen": 10 / 12}
    assert choice.best.route == "emb"
    far, _ = scripted({"emb": set(texts[:6]), "gen": set(texts)})  # 6 and 12 of 12: past it
    assert RouteChooser().choose(task, ["emb", "gen"], far).best.route == "gen"


def test_a_measurement_is_kept_per_label_set_and_made_once_however_many_ask():
    task = task_with(2)
    run, calls = scripted({"emb": {ex.text for ex in task.examples}, "gen": set()})
    chooser = RouteChooser()
    threads = [threading.Thread(target=chooser.choose, args=(task.model_copy(update={"input": f"t{i}"}),
                                                             ["emb", "gen"], run)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 12  # one measurement: 6 examples x 2 routes
    chooser.choose(task_with(2, instructions="Be brief."), ["emb", "gen"], run)
    assert len(calls) == 24  # another prompt: measured again


def test_nothing_to_measure_on_is_said():
    assert not measurable(task_with(1)) and not measurable(ClassifyTask(input="x", labels=LABELS))
    choice = RouteChooser().choose(task_with(1), ["emb", "gen"], lambda t, r: pytest.fail("ran"))
    assert choice.best is None


def test_the_temperature_fitted_makes_overconfident_answers_honest():
    rng = np.random.default_rng(0)
    truth = rng.integers(0, 3, 400)
    right = rng.random(400) < 0.6  # right 60 % of the time, and always 99 % sure
    said = np.where(right, truth, (truth + 1) % 3)
    probs = np.full((400, 3), 0.005)
    probs[np.arange(400), said] = 0.99
    t = fit_temperature(probs, truth)
    assert t > 2 and abs(tempered(probs, t).max(axis=1).mean() - 0.6) < 0.08


def examples_of(items: list[dict], labels: list[str], per_label: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    shown = [it for lb in labels for it in rng.sample([x for x in items if x["label"] == lb], per_label)]
    rest = [it for it in items if it not in shown]
    return [{"text": it["text"], "label": it["label"]} for it in shown], rng.sample(rest, 4)


@pytest.mark.real_model
def test_serve_answers_a_classify_naming_no_model_by_the_route_measured_on_its_examples(minilm_path, smollm2_path,
                                                                                       tmp_path):
    """`serve` holding all-MiniLM-L6-v2 and SmolLM2: on a topic set (BBC News, 5 labels) and a sentiment set
    (Rotten Tomatoes, 2), a classify request naming no model is answered by the route its examples measured best
    (said in the notes with each route's held-out accuracy, the Result naming its model), its probabilities
    calibrated; the next request of the label set is not measured again; without examples the embedding model
    answers, said; a request naming a model gets that model's own answer."""
    from benchmarks.task_inputs import labelled_sets

    server = Served(str(minilm_path), {"NODEAGENT_HOME": str(tmp_path / "home")}, "--model", str(smollm2_path))
    try:
        for st in labelled_sets(["bbc_news", "rotten_tomatoes"])[1:]:
            [(name, spec)] = st["tasks"].items()
            labels = [{"name": lb, "description": spec["descriptions"][lb]} for lb in spec["labels"]]
            examples, asked = examples_of(st["items"], spec["labels"], 2, seed=4)
            answers = [httpx.post(server.url + "/v1/classify", json={"input": it["text"], "labels": labels,
                                                                     "examples": examples}, timeout=600).json()
                       for it in asked]
            for r in answers:
                assert r["status"] == "ok", r
                [said] = [n for n in r["notes"] if n.startswith("route measured")]
                assert said == [n for n in answers[0]["notes"] if n.startswith("route measured")][0]  # measured once
                chosen = said.split("): ", 1)[1].split(" answered, accuracy ")
                pairs = [tuple(map(float, re.findall(r"([0-9.]+) ± ([0-9.]+)", x)[0])) for x in said.split("; ")
                         if " ± " in x]
                assert len(pairs) == 3, said  # each route and the combination
                top = max(pairs)
                assert pairs[0][0] >= top[0] - top[1], said  # within one SE of the most accurate
                assert r["model"] == chosen[0], (r["model"], said)
                assert abs(sum(r["output"]["probabilities"].values()) - 1) < 1e-6 and "temperature" in said
            print(name, said)
            bare = httpx.post(server.url + "/v1/classify", json={"input": asked[0]["text"], "labels": labels},
                              timeout=600).json()
            assert bare["model"] == minilm_path.name and any("by default (no examples" in n for n in bare["notes"])
            named = httpx.post(server.url + "/v1/classify", json={"input": asked[0]["text"], "labels": labels,
                                                                  "examples": examples, "model": smollm2_path.stem},
                               timeout=600).json()
            assert named["model"] == smollm2_path.name and not any(n.startswith("route") for n in named["notes"])
    finally:
        server.stop()


@pytest.mark.real_model
def test_the_gateway_measures_the_routes_of_a_fleet_whose_kinds_sit_on_different_nodes(minilm_path, smollm2_path,
                                                                                       tmp_path):
    """An embedding worker and a generator worker behind a gateway on a real Redis: a classify request naming no
    model is measured through the queue (each route's tasks bound to its model) and answered by the route measured
    best, once per label set; without examples, by the embedding model, said."""
    from test_gateway import on_redis

    from benchmarks.task_inputs import labelled_sets

    with on_redis(tmp_path, {"emb": ["--model", str(minilm_path), "--types", "classify"],
                             "gen": ["--model", str(smollm2_path), "--types", "classify"]}) as fleet:
        [st] = labelled_sets(["bbc_news"])[1:]
        spec = st["tasks"]["bbc_news"]
        labels = [{"name": lb, "description": spec["descriptions"][lb]} for lb in spec["labels"]]
        examples, asked = examples_of(st["items"], spec["labels"], 2, seed=6)
        answers = [httpx.post(fleet.base + "/v1/classify", json={"input": it["text"], "labels": labels,
                                                                 "examples": examples}, timeout=600).json()
                   for it in asked[:2]]
        notes = []
        for r in answers:
            assert r["status"] == "ok", r
            [said] = [n for n in r["notes"] if n.startswith("route measured")]
            notes.append(said)
            chosen = said.split("): ", 1)[1].split(" answered, accuracy ")[0]
            assert r["model"] == chosen and "SmolLM2" in said and "MiniLM" in said, said
        assert notes[0] == notes[1]  # measured once
        bare = httpx.post(fleet.base + "/v1/classify", json={"input": asked[0]["text"], "labels": labels},
                          timeout=600).json()
        assert bare["model"] == minilm_path.name and any("by default (no examples" in n for n in bare["notes"])


@pytest.mark.real_model
def test_a_labelled_set_registered_once_is_read_by_the_gateway_and_by_every_node(minilm_path, smollm2_path,
                                                                                 tmp_path):
    """A worker holding all-MiniLM-L6-v2 and SmolLM2 in one set, and a gateway, on a real Redis. A labelled set
    registered once (over HTTP, at the gateway) is what a classify task without examples is measured on: by the
    node, for a task queued with no model (Client.submit), and by the gateway, for a request naming none; it is read
    back, refused when its labels do not fit, replaced and deleted."""
    from test_gateway import on_redis
    from test_server import json_error

    from nodeagent.fleet.client import Client

    with on_redis(tmp_path, {"both": ["--model", str(minilm_path), "--model", str(smollm2_path), "--types",
                                      "classify"]}, env={"NODEAGENT_LABELLED_SET_REFRESH_S": "1"}) as fleet:
        labels = [{"name": "sports", "description": "games, players and matches"},
                  {"name": "business", "description": "companies, markets and money"}]
        items = [{"text": t, "label": "sports"} for t in (
            "The striker scored twice in the final minutes.", "The home side won the cup after extra time.",
            "She broke the world record in the 400 metres.", "The coach was sacked after five defeats.")] + \
            [{"text": t, "label": "business"} for t in (
                "Shares fell after the bank cut its forecast.", "The retailer's profits rose by a tenth.",
                "The merger creates the country's largest airline.", "Oil prices climbed on supply fears.")]
        for bad in ({"labels": labels, "items": [{"text": "x", "label": "weather"}, {"text": "y", "label": "sports"}]},
                    {"labels": labels, "items": [{"text": "x", "label": "sports"}] * 1001},
                    {"labels": ["a", "A"], "items": [{"text": "x", "label": "a"}] * 2},
                    {"labels": labels, "items": [{"text": "x", "label": "sports", "score": 1}] * 2},
                    {"labels": ["a"], "items": [{"text": "x", "label": "a"}] * 2}):
            refused = httpx.post(fleet.base + "/v1/classify/sets", json=bad, timeout=30)
            assert "\n" not in json_error(refused, 400)["message"], bad
        made = httpx.post(fleet.base + "/v1/classify/sets", json={"labels": labels, "items": items}, timeout=30)
        assert made.status_code == 200 and made.json()["items"] == 8, made.text
        set_id = made.json()["id"]
        assert httpx.get(f"{fleet.base}/v1/classify/sets/{set_id}", timeout=30).json()["items"][0] == items[0]
        client = Client(fleet.broker)
        task = ClassifyTask(input="The goalkeeper saved a penalty in the last minute.", labels=labels)
        by_node = client.wait(client.submit(task), timeout=300)
        assert by_node.status == "ok", by_node.error
        assert any(n.startswith("route measured on the label set's registered set (8 texts") for n in by_node.notes), \
            by_node.notes
        by_gateway = httpx.post(fleet.base + "/v1/classify", json={"input": "Markets rallied on the rate cut.",
                                                                   "labels": labels}, timeout=300).json()
        assert by_gateway["status"] == "ok", by_gateway
        assert any(n.startswith("route measured on the label set's registered set (8 texts") for n in
                   by_gateway["notes"]), by_gateway["notes"]
        # replaced by a later set for the same labels; deleted, the embedding model answers again, said
        assert client.register_labelled_set(labels, items[:2] + items[4:6]) == set_id
        assert len(httpx.get(f"{fleet.base}/v1/classify/sets/{set_id}", timeout=30).json()["items"]) == 4
        assert httpx.delete(f"{fleet.base}/v1/classify/sets/{set_id}", timeout=30).json()["deleted"] is True
        assert httpx.get(f"{fleet.base}/v1/classify/sets/{set_id}", timeout=30).status_code == 404
        time.sleep(1.2)  # the gateway reads the label set's registration again (NODEAGENT_LABELLED_SET_REFRESH_S)
        gone = httpx.post(fleet.base + "/v1/classify", json={"input": "A late goal.", "labels": labels},
                          timeout=300).json()
        assert any("by default (no examples, and no labelled set" in n for n in gone["notes"]), gone["notes"]


def test_a_route_that_cannot_classify_an_example_is_left_out_and_said():
    """A route whose task fails for good on an example (its prompt past the context with the examples) is left
    out of the measurement, said; a route failing for another attempt to try ends the measurement."""
    task = task_with(2)
    run, _ = scripted({"emb": {ex.text for ex in task.examples}, "gen": set()})

    def long_prompts(t: ClassifyTask, route: str) -> Result:
        if route == "gen":
            return Result(task_id=t.id, type=t.type, status="error", error={
                "code": "input_too_long", "message": "the prompt is 5000 tokens", "retryable": False})
        return run(t, route)

    choice = RouteChooser().choose(task, ["emb", "gen"], long_prompts)
    assert choice.best.route == "emb" and [s.route for s in choice.scores] == ["emb"]
    assert choice.left_out == ("gen left out (input_too_long on an example)",)

    def busy(t: ClassifyTask, route: str) -> Result:
        return Result(task_id=t.id, type=t.type, status="error", error={
            "code": "backend_error", "message": "the model failed", "retryable": True})

    from nodeagent.errors import TaskFailed

    with pytest.raises(TaskFailed) as failed:
        RouteChooser().choose(task, ["emb", "gen"], busy)
    assert failed.value.code == "backend_error" and failed.value.retryable
