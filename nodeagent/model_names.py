"""The one rule for which model a request means by its ``model`` field: the name exactly, else the same name in
another case (``SmolLM2-135M`` and ``smollm2-135m`` are one model). The node's own names
(``LocalExecutor.answers_to``), a model set's members (``ModelSet.member``) and the gateway's directory of nodes
(``Directory.holding``) all ask it, so a name a node answers to is the name the fleet routes by."""

from __future__ import annotations

from typing import Iterable


def match(wanted: str, names: Iterable[str]) -> str | None:
    """The name among ``names`` that ``wanted`` means (the exact one first), or None."""
    names = list(names)
    if wanted in names:
        return wanted
    low = wanted.lower()
    return next((n for n in names if n.lower() == low), None)
