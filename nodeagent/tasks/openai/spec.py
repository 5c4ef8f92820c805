"""The values between a completion request and its answer: what was asked (``CompletionSpec``, built once from the
parsed request by the door and by a worker alike), what a node made of it on its first slot (``PreparedRequest``),
and each choice decoded (``Choice``).

``CompletionSpec.of`` is the one mapping from an OpenAI request to a run: the token budget (a chat request without
one takes what the context leaves, up to the server's limit; a text completion 16, as OpenAI's), the sampling, the
choices (``n``, ``best_of``), the output's schema, the tools. The door's limits refuse what is past them; a queued
task's door checked it already (``Limits.bounded`` is off on the worker), and a queued chat that gave no budget is
given the running node's own limit as its budget (``budgeted``), as `serve` gives one its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from nodeagent.tasks.decoding.closer import Closer
from nodeagent.tasks.decoding.sampling import Sampling, TokenLogprob
from nodeagent.tasks.openai.fields import Refused
from nodeagent.tasks.openai.tools import ToolPlan

TEXT_MAX_TOKENS = 16  # a text completion without max_tokens, as OpenAI's


@dataclass(frozen=True)
class Limits:
    """What a server gives one request: ``max_tokens`` (a chat request without a budget takes what the context
    leaves, up to it; with ``bounded``, a budget past it is refused), and ``max_n`` choices (None: unchecked)."""

    max_tokens: int
    bounded: bool = False
    max_n: int | None = None


@dataclass(frozen=True)
class CompletionSpec:
    """A chat or text completion request, as a node runs it."""

    kind: Literal["chat", "text"]
    max_tokens: int  # the chosen tokens (a grammar's forced ones are free: tasks/decoding/)
    sampling: Sampling
    model: str | None = None
    n: int = 1
    best_of: int = 1  # text: the choices decoded, the n most likely returned
    messages: tuple[dict[str, Any], ...] = ()  # chat: each as the prompt is built from it
    schema: dict[str, Any] | None = None  # chat: the response_format's
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    prompts: tuple[str | list[int], ...] = ()  # text: each a text or token ids
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    keep_alive: float | str | None = None

    @property
    def choices(self) -> int:
        """The choices decoded: ``best_of`` of a text completion's, ``n`` of a chat's."""
        return self.best_of if self.kind == "text" else self.n

    @classmethod
    def of(cls, kind: str, body: Any, limits: Limits) -> "CompletionSpec":
        """The parsed request (``requests.ChatRequest`` or ``CompletionRequest``) as a run; ``Refused`` (naming
        the field) for what ``limits`` or OpenAI's rules refuse."""
        common = {"model": body.model, "stream": bool(body.stream), "include_usage": body.include_usage(),
                  "keep_alive": body.keep_alive}
        n = body.n or 1
        if kind == "chat":
            name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            asked = body.max_completion_tokens or body.max_tokens
            return cls("chat", _budget(asked, limits.max_tokens, limits, name), body.sampling(body.top_k()),
                       n=_choices(n, "n", limits), best_of=n, messages=tuple(m.plain() for m in body.messages),
                       schema=body.schema_for_output(), tools=body.tools, tool_choice=body.tool_choice,
                       parallel_tool_calls=body.parallel_tool_calls, **common)
        best_of = body.best_of or n
        if best_of < n:
            raise Refused("best_of", f"best_of ({best_of}) must be at least n ({n})", code="invalid_value")
        if body.stream and best_of > n:
            raise Refused("best_of", "best_of cannot be streamed", code="invalid_value")
        _choices(best_of, "n" if best_of == n else "best_of", limits)
        return cls("text", _budget(body.max_tokens, TEXT_MAX_TOKENS, limits, "max_tokens"),
                   body.sampling(body.logprobs), n=n, best_of=best_of, prompts=tuple(body.prompts()),
                   echo=bool(body.echo), **common)


def budgeted(request: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """A queued chat request as a node whose limit is ``max_tokens`` (its NODEAGENT_MAX_TOKENS) runs it: one that
    gave no budget (neither ``max_tokens`` nor ``max_completion_tokens``) takes that limit as its budget, so it gets
    what the context leaves up to the node's own limit, as on `serve`; one that gave its budget keeps it (its door
    checked it)."""
    if request.get("max_tokens") is not None or request.get("max_completion_tokens") is not None:
        return request
    return {**request, "max_tokens": max_tokens}


def _budget(asked: int | None, default: int, limits: Limits, name: str) -> int:
    value = default if asked is None else asked
    if limits.bounded and value > limits.max_tokens:
        raise Refused(name, f"{name} {value} is over this server's limit of {limits.max_tokens}",
                      code="max_tokens_too_large")
    return value


def _choices(n: int, name: str, limits: Limits) -> int:
    if limits.max_n is not None and n > limits.max_n:
        raise Refused(name, f"{name} {n} asks for more choices than this server gives one request: at most "
                            f"{limits.max_n} (NODEAGENT_MAX_N)", code="invalid_value")
    return n


@dataclass
class PreparedRequest:
    """A request checked and rendered on a node's first slot: its prompts' tokens, its grammar, its budget."""

    kind: str  # chat | text
    prompts: list[list[int]]  # one per prompt (chat: one)
    prompt_texts: list[str]
    max_tokens: int  # the chosen tokens, within what the context leaves
    sampling: Sampling
    n: int
    grammar: str | None = None
    schema: dict[str, Any] | None = None  # the response_format schema the answer is validated against
    tools: ToolPlan | None = None
    closing: Callable[[], Closer] | None = None  # the tool answer's follower: room kept to close
    echo: bool = False
    best_of: int = 1
    notes: list[str] = field(default_factory=list)
    room: int | None = None  # every token, forced ones included: what the context leaves after the prompt

    def note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)


@dataclass
class Choice:
    index: int
    text: str
    finish: str
    tokens: list[int]
    logprobs: list[TokenLogprob]
    masked: bool
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    chosen: int | None = None  # the tokens charged to max_tokens (None: every one)
