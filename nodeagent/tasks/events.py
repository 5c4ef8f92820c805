"""A request's events, one type in process and on the queue (as llama.cpp's server-task declares a task's partial
and final results, each serialising itself; and vLLM's ``RequestOutput``).

The sequence a completion request makes, whichever way it runs: ``Started`` (a worker took its task: which node;
on the queue only), ``Prepared`` (the request is known good: its notes, how many choices; nothing is sent before
it, so a request refused before its first token gets a status code), ``Piece`` after ``Piece`` (a choice's text,
or its tool calls), then ``Finished`` (the whole answer, OpenAI's body) or ``Failed`` (an error in OpenAI's shape).
On the queue a task's log ends with ``Ended``: how the broker settled the task (done, dead, delayed for a retry,
cancelled), written in the step that settles it; the answer itself is the task's Result.

``to_wire`` is what a task's event log carries (schemas/redis-contract.md: the same ``kind`` names and fields as
contract 1.1 wrote); ``from_wire`` reads it back, with the attempt and its number (``seq``) a worker adds.
``Finished`` and ``Failed`` do not travel: the Result does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from nodeagent.errors import HttpError


@dataclass(frozen=True)
class Started:
    node: str | None

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "started", "node": self.node}


@dataclass(frozen=True)
class Prepared:
    notes: tuple[str, ...]
    n: int  # choices per prompt
    choices: int  # every choice of every prompt
    echo: tuple[str, ...] | None = None  # text completions with echo: each prompt's text, sent first

    @classmethod
    def of(cls, prepared: Any) -> "Prepared":
        """The event for the completion engine's prepared request (``tasks/completion.py``'s Prepared)."""
        return cls(tuple(prepared.notes), prepared.n, len(prepared.prompts) * prepared.n,
                   tuple(prepared.prompt_texts) if prepared.echo else None)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "prepared", "notes": list(self.notes), "n": self.n, "choices": self.choices,
                "echo": list(self.echo) if self.echo is not None else None}


@dataclass(frozen=True)
class Piece:
    index: int  # the choice
    what: str  # content | tool_calls
    value: Any  # the text, or the calls (OpenAI's, with their ids)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "piece", "index": self.index, "what": self.what, "value": self.value}


@dataclass(frozen=True)
class Finished:
    body: dict[str, Any]  # the whole answer, as the route answers it
    notes: tuple[str, ...] = ()
    logprobs: str | None = None  # which distribution the log-probabilities are from (model | grammar-masked)
    where: dict[str, Any] = field(default_factory=dict)  # task, node, attempts: headers and the access log


@dataclass(frozen=True)
class Failed:
    error: HttpError


@dataclass(frozen=True)
class Ended:
    """How the broker settled a queued task: done, dead, delayed (a retry comes after its backoff), cancelled."""

    state: str
    task: str | None = None
    attempt: int | None = None
    node: str | None = None

    def to_wire(self) -> dict[str, Any]:
        if self.state == "cancelled":
            return {"kind": "cancelled", "task": self.task}
        return {"kind": "finished", "state": self.state, "attempt": self.attempt, "node": self.node,
                "task": self.task}


Event = Union[Started, Prepared, Piece, Finished, Failed, Ended]


@dataclass(frozen=True)
class Received:
    """An event read from a task's log: the attempt that wrote it and its number in that attempt (a worker's
    events; the broker's own ``Ended`` says its attempt and has no number). ``event`` is None for a kind this
    version does not know (a newer writer's): it still counts in the attempt's numbering."""

    event: Started | Prepared | Piece | Ended | None
    attempt: Any = None
    seq: int | None = None


def from_wire(data: dict[str, Any]) -> Received:
    """An event of a task's log as read."""
    kind = data.get("kind")
    ev: Started | Prepared | Piece | Ended | None
    if kind == "started":
        ev = Started(data.get("node"))
    elif kind == "prepared":
        ev = Prepared(tuple(data.get("notes") or ()), int(data.get("n") or 1), int(data.get("choices") or 1),
                      tuple(data["echo"]) if data.get("echo") else None)
    elif kind == "piece":
        ev = Piece(int(data["index"]), str(data["what"]), data["value"])
    elif kind == "finished":
        ev = Ended(str(data.get("state")), data.get("task"), int(data.get("attempt") or 1), data.get("node"))
    elif kind == "cancelled":
        ev = Ended("cancelled", data.get("task"))
    else:
        ev = None
    return Received(ev, data.get("attempt"), int(data["seq"]) if "seq" in data else None)
