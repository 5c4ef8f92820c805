"""A completion request's events (``tasks/events.py``: one type in process and on the queue), whichever way it
runs (a node held by this process, or the fleet's queue through a gateway), answered whole as JSON or streamed.

A stream is one driver (``stream``) over a ``Renderer``: chat and text completions' chunks (``Chunks``, here) and
the Responses API's events (``server/response_events.py``) are each a renderer of the same four moments, the
beginning (``Prepared``), each ``Piece``, the end (``Finished``) or a failure. A stream's closing events (finish
reasons, log-probabilities, usage, the final response) are read off the same whole answer as a whole one's, so a
streamed answer and a whole one cannot diverge. A ``Failed`` before the first byte is a status code; after it, an
error event. An answer that came whole before anything was streamed (a retried request's key answered at once)
is streamed as its pieces, read off its body.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Protocol

from nodeagent.errors import HttpError
from nodeagent.tasks.events import Event, Failed, Finished, Piece, Prepared


def headers(notes: tuple[str, ...], finished: Finished | None = None) -> dict[str, str]:
    out = {"x-nodeagent-notes": json.dumps(list(notes))} if notes else {}
    if finished is not None:
        if finished.logprobs:
            out["x-nodeagent-logprobs"] = finished.logprobs
        where = finished.where
        if where.get("task"):
            out["x-nodeagent-task"] = str(where["task"])
        if where.get("node"):
            out["x-nodeagent-node"] = str(where["node"])
        if where.get("attempts"):
            out["x-nodeagent-attempts"] = str(where["attempts"])
    return out


def access_fields(finished: Finished) -> dict[str, Any]:
    """What the access log says of a finished request: its tokens, and where it ran."""
    usage = finished.body.get("usage") or {}
    return {**{k: usage[k] for k in ("prompt_tokens", "completion_tokens") if k in usage},
            **{k: v for k, v in finished.where.items() if v is not None}}


def _sse(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


class Renderer(Protocol):
    """How one stream writes the four moments of an answer as server-sent events."""

    def begin(self, p: Prepared) -> list[bytes]: ...

    def piece(self, p: Piece) -> list[bytes]: ...

    def end(self, f: Finished) -> list[bytes]: ...

    def failed(self, error: HttpError) -> list[bytes]: ...


class Chunks:
    """The server-sent events of one streamed chat or text completion, in OpenAI's chunk shape (``include_usage``:
    a last chunk with the usage, as ``stream_options`` asks)."""

    def __init__(self, kind: str, model: str, include_usage: bool = False) -> None:
        self.kind, self.model, self.include_usage = kind, model, include_usage
        self.ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.calls_seen: dict[int, int] = {}

    def _chat(self, index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
              extra: dict[str, Any] | None = None) -> bytes:
        return _sse({"id": self.ident, "object": "chat.completion.chunk", "created": self.created,
                     "model": self.model, "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                                       "logprobs": logprobs}], **(extra or {})})

    def _text(self, index: int, text: str, finish: str | None = None, logprobs: Any = None,
              extra: dict[str, Any] | None = None) -> bytes:
        return _sse({"id": self.ident, "object": "text_completion", "created": self.created, "model": self.model,
                     "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}],
                     **(extra or {})})

    def begin(self, p: Prepared) -> list[bytes]:
        if self.kind == "chat":
            return [self._chat(i, {"role": "assistant", "content": ""}) for i in range(p.choices)]
        if p.echo:  # the prompt first, as the answer's text starts with it
            return [self._text(i, p.echo[i // p.n]) for i in range(p.choices)]
        return []

    def piece(self, p: Piece) -> list[bytes]:
        if self.kind == "text":
            return [self._text(p.index, p.value)]
        if p.what == "content":
            return [self._chat(p.index, {"content": p.value})]
        out = []
        for call in p.value:  # each call: its id and name, then its arguments (the openai helpers' shape)
            k = self.calls_seen.get(p.index, 0)
            self.calls_seen[p.index] = k + 1
            out.append(self._chat(p.index, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                                            "function": {"name": call["function"]["name"],
                                                                         "arguments": ""}}]}))
            out.append(self._chat(p.index, {"tool_calls": [{"index": k, "function": {
                "arguments": call["function"]["arguments"]}}]}))
        return out

    def end(self, f: Finished) -> list[bytes]:
        """Each choice's finish reason and log-probabilities, read off the whole answer; usage when asked. A stream
        that went on from another node after its first was lost says so on its finish chunk: ``nodeagent_resumed``
        (how many times; an extension field clients pass over)."""
        out = []
        extra = {"nodeagent_resumed": f.where["resumes"]} if f.where.get("resumes") else {}
        for c in f.body.get("choices", []):
            if self.kind == "chat":
                out.append(self._chat(c["index"], {}, c["finish_reason"], c.get("logprobs"), extra))
            else:
                out.append(self._text(c["index"], "", c["finish_reason"], c.get("logprobs"), extra))
        if self.include_usage:
            out.append(_sse({"id": self.ident, "object": "chat.completion.chunk" if self.kind == "chat"
                             else "text_completion", "created": self.created, "model": self.model, "choices": [],
                             "usage": f.body.get("usage")}))
        return out + [DONE]

    def failed(self, error: HttpError) -> list[bytes]:
        return [_sse(error.body()), DONE]


async def first(events: AsyncIterator[Event]) -> Prepared | Finished:
    """The first event that settles the response's status: Prepared (or a Finished that came without one);
    a Failed before it is raised as the HTTP error it is."""
    async for ev in events:
        if isinstance(ev, Failed):
            raise ev.error
        if isinstance(ev, (Prepared, Finished)):
            return ev
    raise HttpError(500, "the answer ended without a word: see the node's log", "server_error", "internal_error")


async def whole(events: AsyncIterator[Event]) -> Finished:
    """The whole answer: the events folded to their Finished (a Failed raised as its HTTP error)."""
    async for ev in events:
        if isinstance(ev, Failed):
            raise ev.error
        if isinstance(ev, Finished):
            return ev
    raise HttpError(500, "the answer ended without a word: see the node's log", "server_error", "internal_error")


def replayed(f: Finished) -> list[Event]:
    """An answer that came whole, as the events a stream of it would have been: its beginning, each choice's content
    and tool calls (read off OpenAI's body, chat's or text's), its end."""
    choices = f.body.get("choices") or []
    out: list[Event] = [Prepared(f.notes, max(1, len(choices)), max(1, len(choices)))]
    for c in choices:
        message = c.get("message")
        text = (message or {}).get("content") if message is not None else c.get("text")
        if text:
            out.append(Piece(c["index"], "content", text))
        if message and message.get("tool_calls"):
            out.append(Piece(c["index"], "tool_calls", message["tool_calls"]))
    return [*out, f]


async def stream(renderer: Renderer, head: Prepared | Finished, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """The server-sent events after the status line: the beginning, each piece, the end (or an error event), as
    ``renderer`` writes them."""
    async def rest() -> AsyncIterator[Event]:
        if isinstance(head, Finished):  # answered whole: nothing more comes
            for e in replayed(head):
                yield e
            return
        yield head
        async for e in events:
            yield e

    async for e in rest():
        if isinstance(e, Prepared):
            for b in renderer.begin(e):
                yield b
        elif isinstance(e, Piece):
            for b in renderer.piece(e):
                yield b
        elif isinstance(e, Finished):
            for b in renderer.end(e):
                yield b
            return
        elif isinstance(e, Failed):
            for b in renderer.failed(e.error):
                yield b
            return
    for b in renderer.failed(HttpError(500, "the answer ended without a word", "server_error", "internal_error")):
        yield b
