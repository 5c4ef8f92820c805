"""Classification by the route measured best for its labels: on a node holding models of several kinds that classify
(an embedding model's centroids, a generator's label scoring), a ``classify.v1`` task that names no model is
answered by the route that classified its own worked examples best.

**The measurement.** The task's examples are split into folds by label (``MOST_FOLDS`` at most, each label's
examples dealt round the folds); each held-out example is classified by every route with the other folds' examples
as the task's, so each route is scored on examples it did not see. Routes whose probabilities are averaged (the
combination) are scored from the same answers at no cost. The cheapest route within one standard error of the
most accurate answers (the one-standard-error rule: the routes come cheapest first, the embedding model's, then the
generator's, then the combination, which runs both; a slower route must be right more often than the held-out
examples' noise to be worth its time: on 10 examples a route right twice more is not); its probabilities are then
calibrated by a temperature fitted on the held-out answers (``fit_temperature``: log-loss over a grid, pulled
toward 1), and its accuracy, its standard error and the others' are said in the
Result's notes. A measurement is kept per label set and examples (``MEASURED_SETS``), so a stream of tasks with
the same labels is measured once.

**Without examples**, a task is measured on its label set's registered set where the orchestrator registered one
for the fleet (``fleet/labelled_sets.py``): each of its texts classified by each route as the task would be, with
no examples. **Without either** (or with too few examples: a label with fewer than ``MIN_PER_LABEL``), the
embedding model answers: more accurate on 3 of the 4 labelled sets the project measured and tens of times faster
(benchmarks/results/embed_classify.md; sentiment went to label scoring); the notes say so and how to get a
measured route (examples, or the model named).

Pure: the routes run through ``run(task, route) -> Result`` (the model set's own ``run``), so the measurement is
tested on any backend.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import PurePath
from typing import Callable, Iterable

import numpy as np

from nodeagent.errors import TaskFailed
from nodeagent.model_kinds import ModelKind
from nodeagent.tasks import registry
from nodeagent.tasks.contracts import ClassifyOutput, ClassifyTask, LabeledExample, LabelSpec, Result

log = logging.getLogger(__name__)
CLASSIFY = ClassifyTask.model_fields["type"].default

MOST_FOLDS = 5  # folds of the examples at most (fewer when a label has fewer examples)
MIN_PER_LABEL = 2  # examples every label needs for the routes to be measured
MEASURED_SETS = 64  # measurements kept (per label set and examples)
# the temperatures fitted among (a quarter to eight times the route's own spread), and the pull toward 1 (its own
# probabilities) that a few held-out answers must overcome: (log T)^2 / n beside the mean log-loss, so 15 answers
# all right do not sharpen every later answer to certainty
Registered = tuple[str, "list[LabeledExample] | tuple[LabeledExample, ...]"]  # a registered set: version, texts
TEMPERATURES = tuple(float(t) for t in np.round(np.exp(np.linspace(np.log(0.25), np.log(8.0), 41)), 4))


@dataclass(frozen=True)
class RouteScore:
    route: str  # a model's name, or the names of the models whose probabilities are averaged, joined by " + "
    accuracy: float  # on the held-out examples
    se: float  # its standard error
    log_loss: float  # of its calibrated probabilities on the held-out examples
    temperature: float  # fitted on the held-out answers: each probability raised to 1 / T, normalised again
    ece: float  # expected calibration error of its calibrated top label (10 bins)

    @property
    def routes(self) -> list[str]:
        return self.route.split(" + ")

    @property
    def shown(self) -> str:
        """The route as the notes name it: each model by its file's name."""
        return " + ".join(PurePath(r).name for r in self.routes)

    def said(self) -> str:
        return f"{self.shown} {self.accuracy:.3f} ± {self.se:.3f}"


@dataclass(frozen=True)
class Measurement:
    best: RouteScore | None  # None: not measured (no examples, or too few)
    scores: tuple[RouteScore, ...] = ()
    examples: int = 0
    folds: int = 0  # 0: on a registered set (its texts classified as the task would be)
    seconds: float = 0.0
    left_out: tuple[str, ...] = ()  # the routes that could not classify an example, with why

    @property
    def source(self) -> str:
        """What the routes were measured on, as the notes say it."""
        if self.folds:
            return f"the task's {self.examples} examples ({self.folds} folds, each held out in turn"
        return f"the label set's registered set ({self.examples} texts, classified as the task is"

    def route_for(self, task: ClassifyTask) -> RouteScore | None:
        """The route that answers ``task``: the best, but a single route for multi-label (each route chooses its
        labels by thresholds of its own, which an average of probabilities does not keep)."""
        if self.best is None or not task.multi_label or len(self.best.routes) == 1:
            return self.best
        return min((s for s in self.scores if len(s.routes) == 1), key=lambda s: (-s.accuracy, s.log_loss))


class RouteChooser:
    """The measured route of each label set (``choose``), measured at its first task and kept."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._kept: OrderedDict[str, Measurement] = OrderedDict()
        self._lock = threading.Lock()
        self._measuring: dict[str, threading.Lock] = {}

    def choose(self, task: ClassifyTask, routes: list[str], run: Callable[[ClassifyTask, str], Result],
               registered: Registered | None = None) -> Measurement:
        """The route for ``task`` among ``routes`` (model names, the cheapest first: the embedding model's), measured
        on its examples once per label set and examples, or, without examples, on ``registered`` (the label set's
        registered set: its version and its texts) once per version; ``Measurement(None)`` when there is nothing to
        measure on."""
        if measurable(task):
            key = measurement_key(task, routes)
            made = lambda: measure(task, routes, run, self.clock)  # noqa: E731
        elif not task.examples and registered is not None:
            key = measurement_key(task, routes) + registered[0]
            made = lambda: measure_on(task, list(registered[1]), routes, run, self.clock)  # noqa: E731
        else:
            return Measurement(None)
        return self._kept_or(key, made)

    def _kept_or(self, key: str, made: Callable[[], Measurement]) -> Measurement:
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
            lock = self._measuring.setdefault(key, threading.Lock())
        with lock:  # one measurement of a label set at a time; the others wait for it
            with self._lock:
                if key in self._kept:
                    return self._kept[key]
            choice = made()
            with self._lock:
                self._kept[key] = choice
                self._measuring.pop(key, None)
                while len(self._kept) > MEASURED_SETS:
                    self._kept.popitem(last=False)
        return choice


def measurable(task: ClassifyTask) -> bool:
    """Whether every label has ``MIN_PER_LABEL`` examples or more."""
    counts = {lb.name: 0 for lb in task.labels}
    for ex in task.examples:
        counts[ex.label] += 1
    return min(counts.values()) >= MIN_PER_LABEL


def measurement_key(task: ClassifyTask, routes: list[str]) -> str:
    """What a route's answers depend on besides the input: the routes, the labels, the examples and the prompt's
    fields."""
    fields = task.model_dump_json(include={"labels", "examples", "instructions", "answer", "calibrate",
                                           "length_norm"})
    return hashlib.sha256("\n".join([*routes, fields]).encode()).hexdigest()


def folds_of(task: ClassifyTask) -> list[list[int]]:
    """The examples' indices in folds: each label's examples dealt round the folds in turn, so each fold holds
    every label (``MOST_FOLDS`` at most, and no more than the fewest examples a label has)."""
    by_label: dict[str, list[int]] = {lb.name: [] for lb in task.labels}
    for i, ex in enumerate(task.examples):
        by_label[ex.label].append(i)
    k = max(2, min(MOST_FOLDS, min(map(len, by_label.values()))))
    folds: list[list[int]] = [[] for _ in range(k)]
    turn = 0
    for indices in by_label.values():
        for i in indices:
            folds[turn % k].append(i)
            turn += 1
    return [sorted(f) for f in folds if f]


def measure(task: ClassifyTask, routes: list[str], run: Callable[[ClassifyTask, str], Result],
            clock: Callable[[], float] = time.monotonic) -> Measurement:
    """Every route's answers to the held-out examples of each fold, scored with the combination of them all."""
    started = clock()
    folds = folds_of(task)
    answers: list[tuple[int, ClassifyTask]] = []
    for fold in folds:
        held = set(fold)
        shown = [ex for i, ex in enumerate(task.examples) if i not in held]
        answers += [(i, task.model_copy(update={"input": task.examples[i].text, "examples": shown,
                                                "multi_label": False, "idempotency_key": None})) for i in fold]
    return scored(task, list(task.examples), answers, routes, run, len(folds), started, clock)


def measure_on(task: ClassifyTask, items: list[LabeledExample], routes: list[str],
               run: Callable[[ClassifyTask, str], Result], clock: Callable[[], float] = time.monotonic
               ) -> Measurement:
    """Every route's answers to a registered set's texts, each classified as ``task`` is (its labels, its prompt's
    fields, no examples), scored with the combination of them all."""
    started = clock()
    answers = [(i, task.model_copy(update={"input": it.text, "multi_label": False, "idempotency_key": None}))
               for i, it in enumerate(items)]
    return scored(task, items, answers, routes, run, 0, started, clock)


def scored(task: ClassifyTask, items: list[LabeledExample], answers: list[tuple[int, ClassifyTask]],
           routes: list[str], run: Callable[[ClassifyTask, str], Result], folds: int, started: float,
           clock: Callable[[], float]) -> Measurement:
    """Each route's answers (``answers``: an item's place and the task that classifies it) scored against the
    items' labels, with the routes' probabilities averaged as one more route; the route chosen by the
    one-standard-error rule."""
    names = [lb.name for lb in task.labels]
    truth = np.array([names.index(it.label) for it in items])
    probs = {r: np.zeros((len(items), len(names))) for r in routes}
    left_out: dict[str, str] = {}  # a route that cannot run the task's kind of work (its error on an example)
    for route in routes:
        for i, sub in answers:
            result = run(sub.model_copy(update={"id": uuid.uuid4().hex}), route)  # each run a task of its own
            if result.status != "ok":
                assert result.error is not None
                if result.error.retryable or result.error.code in ("cancelled", "deadline_exceeded", "timeout"):
                    raise_failed(result, route)  # the task's own end, or another attempt's to try
                left_out[route] = f"{result.error.code} on an example"
                break
            out = result.output
            assert isinstance(out, ClassifyOutput)
            probs[route][i] = [out.probabilities[n] for n in names]
    able = [r for r in routes if r not in left_out]
    if not able:
        raise TaskFailed("invalid_task", "no route could classify the examples: " + "; ".join(
            f"{PurePath(r).name}: {why}" for r, why in left_out.items()), False)
    candidates = {r: probs[r] for r in able}
    if len(able) > 1:
        candidates[" + ".join(able)] = np.mean([probs[r] for r in able], axis=0)
    scores = tuple(score(route, p, truth) for route, p in candidates.items())  # (the cheapest first)
    top = min(scores, key=lambda s: (-s.accuracy, s.log_loss))
    best = next(s for s in scores if s.accuracy >= top.accuracy - top.se)  # the one-standard-error rule
    return Measurement(best, scores, len(truth), folds, clock() - started, tuple(
        f"{PurePath(r).name} left out ({why})" for r, why in left_out.items()))


def raise_failed(result: Result, route: str) -> None:
    assert result.error is not None
    raise TaskFailed(result.error.code, f"measuring the routes on the task's examples: {route} failed: "
                                        f"{result.error.message}", result.error.retryable)


def score(route: str, probs: np.ndarray, truth: np.ndarray) -> RouteScore:
    """A route's held-out accuracy and standard error, and its calibration (temperature, log-loss, ECE)."""
    n = len(truth)
    right = probs.argmax(axis=1) == truth
    accuracy = float(right.mean())
    t = fit_temperature(probs, truth)
    calibrated = tempered(probs, t)
    loss = float(-np.log(np.maximum(calibrated[np.arange(n), truth], 1e-12)).mean())
    return RouteScore(route, accuracy, math.sqrt(accuracy * (1 - accuracy) / n), loss, t,
                      ece(calibrated.max(axis=1), right))


def tempered(probs: np.ndarray, temperature: float) -> np.ndarray:
    """Probabilities raised to 1 / ``temperature`` and normalised again (temperature scaling of their logs)."""
    logs = np.log(np.maximum(probs, 1e-12)) / temperature
    logs -= logs.max(axis=-1, keepdims=True)
    e = np.exp(logs)
    return e / e.sum(axis=-1, keepdims=True)


def fit_temperature(probs: np.ndarray, truth: np.ndarray) -> float:
    """The temperature (of ``TEMPERATURES``) whose probabilities give the held-out truth the lowest log-loss, pulled
    toward 1 by (log T)^2 / n."""
    rows = np.arange(len(truth))
    losses = [float(-np.log(np.maximum(tempered(probs, t)[rows, truth], 1e-12)).mean()) + np.log(t) ** 2 / len(truth)
              for t in TEMPERATURES]
    return TEMPERATURES[int(np.argmin(losses))]


def ece(confidence: np.ndarray, right: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error: the mean gap between confidence and accuracy over equal-width bins, weighted by
    their share of the answers."""
    edges = np.minimum((confidence * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        held = edges == b
        if held.any():
            total += held.mean() * abs(float(confidence[held].mean()) - float(right[held].mean()))
    return total


def routes_of(models: Iterable[tuple[ModelKind | None, str]]) -> list[str]:
    """The routes a classify task naming no model is measured on: of ``models`` (each its kind and name, the
    preferred first), the first of each kind that classifies, the embedding model's first (the cheapest)."""
    kinds: dict[ModelKind, str] = {}
    for kind, name in models:
        if kind is not None and registry.runs(CLASSIFY, kind):
            kinds.setdefault(kind, name)
    return [kinds[k] for k in sorted(kinds, key=lambda k: not k.embeds)]


@dataclass(frozen=True)
class Routed:
    """How a task naming no model is answered: what was measured, the route chosen (None: the embedding model's,
    by default), and the tasks that answer it, each with the model it runs on."""

    measurement: Measurement
    route: RouteScore | None
    runs: list[tuple[ClassifyTask, str]]


def routed(task: ClassifyTask, routes: list[str], chooser: RouteChooser, run: Callable[[ClassifyTask, str], Result],
           lookup: Callable[[list[LabelSpec]], object] | None = None) -> Routed:
    """The route for ``task`` among ``routes`` (``routes_of``), measured through ``run`` on its examples or, without
    them, on its label set's registered set (``lookup``: the fleet's, or None; one that cannot be read counts as
    none); TaskFailed when the measurement fails for another attempt to try. The combination's tasks are tasks of
    their own (an id each, the request's key made each route's own)."""
    found = None
    if lookup is not None and not task.examples:
        try:
            found = lookup(task.labels)
        except Exception as exc:  # noqa: BLE001  (a broker that does not answer: measured as if none)
            log.warning("the labelled set of a label set could not be read: %s", exc)
    registered = None if found is None else (found.version, found.items)  # type: ignore[attr-defined]
    measurement = chooser.choose(task, routes, run, registered)
    route = measurement.route_for(task)
    if route is None:
        runs = [(task, routes[0])]
    elif len(route.routes) == 1:
        runs = [(task, route.route)]
    else:
        key = task.idempotency_key
        runs = [(task.model_copy(update={"id": uuid.uuid4().hex, "idempotency_key": key and f"{key}/{r}"}), r)
                for r in route.routes]
    return Routed(measurement, route, runs)


def answered(task: ClassifyTask, routes: list[str], plan: Routed, results: list[Result]) -> Result:
    """The task's Result from its plan's runs (``results``, in their order): the embedding model's, said, where
    nothing was measured; the chosen route's otherwise (``answer``)."""
    if plan.route is None:
        return results[0].model_copy(update={"notes": [*results[0].notes, by_default(task, routes)]})
    return answer(task, plan.measurement, plan.route, results)


def by_default(task: ClassifyTask, routes: list[str]) -> str:
    """The note of a task answered by the embedding model (``routes[0]``) for want of examples to measure on."""
    why = ("no examples, and no labelled set registered for its labels," if not task.examples else
           f"fewer than {MIN_PER_LABEL} examples of a label")
    others = ", ".join(PurePath(r).name for r in routes[1:])
    return (f"route: {PurePath(routes[0]).name}, the embedding model, by default ({why} to measure the routes on; "
            f"{others} classifies too): give {MIN_PER_LABEL} or more examples a label, or register a labelled set "
            "for the labels, to have the routes measured, or name the model")


def answer(task: ClassifyTask, choice: Measurement, route: RouteScore, results: list[Result]) -> Result:
    """The task's Result by ``route``: its model's Result (the combination's: the probabilities averaged),
    single-label probabilities calibrated by the route's temperature, and the notes saying which route answered and
    what each measured."""
    failed = next((r for r in results if r.status != "ok"), None)
    if failed is not None:
        return failed
    first = results[0]
    names = [lb.name for lb in task.labels]
    others = [*(s.said() for s in choice.scores if s is not route), *choice.left_out]
    said = (f"route measured on {choice.source}, {choice.seconds:.1f} s): {route.shown} answered, accuracy "
            f"{route.accuracy:.3f} ± {route.se:.3f}; " + "; ".join(others))
    update: dict = {"notes": [*dict.fromkeys(n for r in results for n in r.notes), said]}
    if not task.multi_label:  # (multi-label: one route's own, its labels by its own thresholds)
        outputs = [r.output for r in results]
        probs = np.mean([[o.probabilities[n] for n in names] for o in outputs  # type: ignore[union-attr]
                         ], axis=0)
        calibrated = tempered(probs[None, :], route.temperature)[0]
        update["output"] = ClassifyOutput(label=names[int(np.argmax(calibrated))],
                                          probabilities=dict(zip(names, map(float, calibrated))))
        update["notes"][-1] += (f"; its probabilities calibrated on them (temperature {route.temperature:g}; ECE "
                                f"{route.ece:.3f} on the answers it was fitted to)")
    if len(results) > 1:
        update["model"] = " + ".join(str(r.model) for r in results)
        update["timings"] = first.timings.model_copy(update={"total_s": sum(r.timings.total_s for r in results)})
    update["task_id"] = task.id  # (the combination's runs are tasks of their own)
    return first.model_copy(update=update)
