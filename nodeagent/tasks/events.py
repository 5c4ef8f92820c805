"""A request's events, one type in process and on the queue (as llama.cpp's server-task declares a task's partial
and final results, each serialising itself; and vLLM's ``RequestOutput``).

The sequence a completion request makes, whichever way it runs: ``Queued`` (the broker opened its log: on the queue
only), ``Started`` (a worker took its task: which node;
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
from typing import Any, Callable, Union

from nodeagent.errors import HttpError


@dataclass(frozen=True)
class Queued:
    """The log opened: a gateway waits on it (written by the broker, before the task is queued)."""

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "queued"}


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
    resumed: int | None = None  # a later attempt of a stream: it continues after this many characters sent
    unresumable: str | None = None  # a later attempt of a stream that cannot continue it: why

    @classmethod
    def of(cls, prepared: Any, resumed: int | None = None, unresumable: str | None = None) -> "Prepared":
        """The event for the completion engine's prepared request (``tasks/openai/spec.py``'s PreparedRequest)."""
        return cls(tuple(prepared.notes), prepared.n, len(prepared.prompts) * prepared.n,
                   tuple(prepared.prompt_texts) if prepared.echo else None, resumed, unresumable)

    def to_wire(self) -> dict[str, Any]:
        out = {"kind": "prepared", "notes": list(self.notes), "n": self.n, "choices": self.choices,
               "echo": list(self.echo) if self.echo is not None else None}
        if self.resumed is not None:  # contract 1.4
            out["resumed"] = self.resumed
        if self.unresumable is not None:
            out["unresumable"] = self.unresumable
        return out


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


Event = Union[Queued, Started, Prepared, Piece, Finished, Failed, Ended]


@dataclass(frozen=True)
class Received:
    """An event read from a task's log: the attempt that wrote it and its number in that attempt (a worker's
    events; the broker's own ``Ended`` says its attempt and has no number). ``event`` is None for a kind this
    version does not know (a newer writer's): it still counts in the attempt's numbering."""

    event: Queued | Started | Prepared | Piece | Ended | None
    attempt: Any = None
    seq: int | None = None
    run: str | None = None  # which claim of the attempt wrote it (a claim given back unrun keeps its number)

    @property
    def writer(self) -> Any:
        """What numbers the event: the attempt, and the claim within it where the writer says (contract 1.4)."""
        return self.attempt if self.run is None else (self.attempt, self.run)


def from_wire(data: dict[str, Any]) -> Received:
    """An event of a task's log as read."""
    kind = data.get("kind")
    ev: Queued | Started | Prepared | Piece | Ended | None
    if kind == "queued":
        ev = Queued()
    elif kind == "started":
        ev = Started(data.get("node"))
    elif kind == "prepared":
        ev = Prepared(tuple(data.get("notes") or ()), int(data.get("n") or 1), int(data.get("choices") or 1),
                      tuple(data["echo"]) if data.get("echo") else None,
                      int(data["resumed"]) if data.get("resumed") is not None else None, data.get("unresumable"))
    elif kind == "piece":
        ev = Piece(int(data["index"]), str(data["what"]), data["value"])
    elif kind == "finished":
        ev = Ended(str(data.get("state")), data.get("task"), int(data.get("attempt") or 1), data.get("node"))
    elif kind == "cancelled":
        ev = Ended("cancelled", data.get("task"))
    else:
        ev = None
    return Received(ev, data.get("attempt"), int(data["seq"]) if "seq" in data else None, data.get("run"))


# -- a stream that survives its node ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Resume:
    """What earlier attempts of a streamed request sent its client, for the next attempt to continue from: the
    first choice's content (``why_not``: why it cannot be continued, when it cannot)."""

    content: str
    why_not: str | None = None


@dataclass
class Progress:
    """Where a queued request's progress goes (its task's log, numbered by the worker), and what the attempts
    before it already sent (``resume``; None: nothing was sent, it starts afresh)."""

    publish: Callable[[dict[str, Any]], None]
    resume: Resume | None = None

    def __call__(self, event: dict[str, Any]) -> None:
        self.publish(event)


def node_lost(node: str | None, why: str = "the node running it was lost after the answer began") -> HttpError:
    return HttpError(503, f"{why} (node {node or '?'}): ask again", "server_error", "node_lost")


class Follower:
    """A queued task's log, followed as one request's events: the gateway's reading of a stream, and a worker's
    reading of what the attempts before it sent (``resume``).

    The request relays one attempt at a time: the first whose ``Prepared`` arrives; a later attempt before any
    piece went out is followed instead, quietly. Once pieces went out, a later attempt takes over only where it
    continues from exactly what was sent (its ``Prepared`` says ``resumed``: so many characters): the stream then
    goes on with its pieces, with no second beginning. A later attempt that cannot continue (``unresumable``, or a
    node too old to say), or a gap in the relayed attempt's numbering (a broker failover lost an event), ends the
    stream with ``node_lost`` and the reason. A copy of an event a retried write left is dropped."""

    def __init__(self) -> None:
        self.relayed: Any = None  # the attempt whose pieces are relayed
        self.pieces = False  # a piece went out
        self.node: str | None = None  # the node running it, last heard
        self.begun = False  # a node took the task (the placement's wait is over)
        self.seen: dict[Any, int] = {}  # writer (attempt, or attempt and claim) -> the last event's number read
        self.sent: dict[int, str] = {}  # each choice's content that went out
        self.calls = False  # tool calls went out
        self.choices = 1
        self.resumes = 0  # how many times another attempt took the stream over
        self.broken: str | None = None  # why the stream ended, when it did

    def resume(self) -> Resume | None:
        """What a next attempt must continue from (None: nothing went out, it may start afresh)."""
        if not self.pieces:
            return None
        why = self.broken or ("several choices were streamed" if self.choices > 1 else
                              "its tool calls were sent already" if self.calls else None)
        return Resume(self.sent.get(0, ""), why)

    def take(self, r: Received) -> Prepared | Piece | Failed | Ended | None:
        """What ``r`` means for the request: an event to relay, the end (``Failed``, or the broker's ``Ended``:
        the Result is the answer), or None (nothing to relay)."""
        writer = r.writer
        if r.seq is not None:
            if r.seq <= self.seen.get(writer, 0):
                return None
            gap = r.seq > self.seen.get(writer, 0) + 1
            self.seen[writer] = r.seq
            if gap and self.pieces and writer == self.relayed:
                return self._lost("pieces of the answer were lost in a broker failover")
        ev = r.event
        if ev is None or isinstance(ev, Queued):  # a kind this version does not know; the log's opening
            return None
        if isinstance(ev, Started):
            self.begun, self.node = True, ev.node
            return None
        if isinstance(ev, Prepared):
            return self._prepared(ev, writer)
        if isinstance(ev, Piece):
            if writer != self.relayed:
                return None
            self.pieces = True
            if ev.what == "content":
                self.sent[ev.index] = self.sent.get(ev.index, "") + str(ev.value)
            elif ev.what == "tool_calls":
                self.calls = True
            return ev
        self.begun, self.node = True, ev.node or self.node
        if ev.state == "delayed":  # a retry comes after its backoff: it continues what was sent, or says why not
            return None
        return ev

    def _prepared(self, ev: Prepared, attempt: Any) -> Prepared | Failed | None:
        self.begun = True
        if self.relayed is None:
            self.relayed, self.choices = attempt, ev.choices
            return ev
        if attempt == self.relayed:
            return None
        if not self.pieces:
            self.relayed = attempt  # a new attempt before any piece went out: followed quietly
            return None
        if ev.resumed is not None and ev.resumed == len(self.sent.get(0, "")) and ev.unresumable is None:
            self.relayed = attempt  # it continues from exactly what went out
            self.resumes += 1
            return None
        return self._lost(f"the next node could not continue the answer: {ev.unresumable}" if ev.unresumable else
                          "the next node started the answer again rather than continue it (its version predates "
                          "resuming)" if ev.resumed is None else
                          f"the next node continued from {ev.resumed} characters, not the "
                          f"{len(self.sent.get(0, ''))} sent")

    def _lost(self, why: str) -> Failed:
        self.broken = why
        return Failed(node_lost(self.node, why))
