"""Labelled sets registered for the whole fleet: texts with their labels, for one label set, kept in the broker (a
document of kind ``labelled_set``, keyed by the label set: its names and descriptions), until deleted.

A classify task that names no model and brings no examples of its own is measured on its label set's registered
set, where there is one (``classify_routes.measure_on``): each text classified by each route as the task would
be, the route right most often answering, its probabilities calibrated on them. The gateway and every node that
holds models of several kinds read it (``LabelledSets.lookup``, kept NODEAGENT_LABELLED_SET_REFRESH_S between broker
reads), so the
orchestrator registers a set once (``Client.register_labelled_set``, ``POST /v1/classify/sets``) and the whole
fleet measures by it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Any, Callable

from pydantic import Field, model_validator

from nodeagent.config import default_of
from nodeagent.tasks.contracts import LabeledExample, LabelSpec
from nodeagent.values import Strict

KIND = "labelled_set"
MOST_ITEMS = 1000  # texts in one set


class LabelledSet(Strict):
    """A label set (as a task gives it: names, with descriptions) and texts labelled with it."""

    labels: list[LabelSpec] = Field(min_length=2, max_length=200)
    items: list[LabeledExample] = Field(min_length=2, max_length=MOST_ITEMS)

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("labels"), list):
            data = {**data, "labels": [{"name": x} if isinstance(x, str) else x for x in data["labels"]]}
        return data

    @model_validator(mode="after")
    def _labelled(self) -> "LabelledSet":
        names = [lb.name for lb in self.labels]
        if len({n.casefold() for n in names}) != len(names):
            raise ValueError("the labels hold a name twice")
        for i, it in enumerate(self.items):
            if it.label not in names:
                raise ValueError(f"item {i} is labelled {it.label!r}, which names no label of the set")
        return self

    @property
    def key(self) -> str:
        return label_set_key(self.labels)

    @property
    def version(self) -> str:
        """What the set holds, as a hash: a measurement on it is kept while it is the same."""
        return hashlib.sha256(self.model_dump_json(include={"items"}).encode()).hexdigest()[:16]


def label_set_key(labels: list[LabelSpec]) -> str:
    """A label set's key: its names and descriptions, in its order."""
    return hashlib.sha256(json.dumps([[lb.name, lb.description] for lb in labels]).encode()).hexdigest()[:32]


def register(broker: Any, labelled: LabelledSet) -> str:
    """Keep ``labelled`` for its label set (one set a label set: a later one replaces it); its key."""
    data = {**labelled.model_dump(mode="json"), "registered_at": broker.now(), "version": labelled.version}
    while True:  # a new document, or over the version read (another writer's meanwhile: read again)
        found = broker.doc_get(KIND, labelled.key)
        if broker.doc_put(KIND, labelled.key, data, version=None if found is None else found[1]):
            return labelled.key


def read(broker: Any, key: str) -> LabelledSet | None:
    found = broker.doc_get(KIND, key)
    return None if found is None else LabelledSet.model_validate({k: found[0][k] for k in ("labels", "items")})


def delete(broker: Any, key: str) -> bool:
    return bool(broker.doc_delete(KIND, key))


class LabelledSets:
    """A node's reader of the fleet's labelled sets: a label set's registration, read from the broker at most once
    every ``refresh_s`` (NODEAGENT_LABELLED_SET_REFRESH_S: a registration reaches every node within that long)."""

    def __init__(self, broker: Any, refresh_s: float = default_of("labelled_set_refresh_s"),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.broker, self.refresh_s, self.clock = broker, refresh_s, clock
        self._kept: dict[str, tuple[float, LabelledSet | None]] = {}
        self._lock = threading.Lock()

    def lookup(self, labels: list[LabelSpec]) -> LabelledSet | None:
        """The set registered for ``labels``, or None."""
        key = label_set_key(labels)
        with self._lock:
            kept = self._kept.get(key)
        if kept is not None and self.clock() - kept[0] < self.refresh_s:
            return kept[1]
        found = read(self.broker, key)
        with self._lock:
            self._kept[key] = (self.clock(), found)
            if len(self._kept) > 256:
                self._kept.pop(next(iter(self._kept)))
        return found
