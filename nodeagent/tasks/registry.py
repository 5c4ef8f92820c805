"""The task types, each declared once: its contract (whose ``type`` literal is its name and queue), the kind
of work a model needs for it (the planner's task and the catalog's role), the TaskRunner method that runs it,
and its typed HTTP route. The broker, the worker, the client, the CLI and the server read this; adding a type
is one contract in ``contracts.py`` and one entry here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

from nodeagent.errors import UsageError
from nodeagent.planner.types import TaskType as Kind
from nodeagent.tasks.contracts import (
    BATCH_SUFFIX,
    CONTRACTS,
    ChatTask,
    ClassifyTask,
    CompletionTask,
    EmbedTask,
    ExtractTask,
)
from nodeagent.tasks.prompts import classify_messages, extract_messages


@dataclass(frozen=True)
class TaskTypeSpec:
    contract: Any  # the pydantic model of the task
    kind: Kind  # what a model must suit: the planner's task, the catalog's role
    runner: str  # the runner's method that runs it: (task, notes, timing, counts) -> output
    route: str  # the HTTP route that serves it (and a batch line's url)
    messages: Any  # (task) -> the chat messages of its prompt
    openai: bool = False  # an OpenAI request queued (its route is OpenAI's; the task holds the request body)
    since: str = "1.0"  # the fleet's contract version that brought it: an older node cannot run it

    @property
    def name(self) -> str:
        """Type and contract version, e.g. classify.v1: the task's ``type`` and its queue."""
        return str(self.contract.model_fields["type"].default)


def _request_messages(task: Any) -> list[dict[str, Any]]:
    """A queued OpenAI request's prompt as messages (a text completion's prompt as one user turn)."""
    request = task.request
    if "messages" in request:
        return [{"role": m.get("role", "user"), "content": m.get("content") if isinstance(m.get("content"), str)
                 else ""} for m in request["messages"]]
    prompt = request.get("prompt")
    return [{"role": "user", "content": prompt if isinstance(prompt, str) else ""}]


def _embed_messages(task: Any) -> list[dict[str, Any]]:
    """An embedding task's inputs, a turn each (what its prompt is, for a count of its tokens)."""
    return [{"role": "user", "content": x if isinstance(x, str) else ""} for x in task.input]


TYPES: tuple[TaskTypeSpec, ...] = (
    TaskTypeSpec(ExtractTask, "extract", "_extract", "/v1/extract", extract_messages),
    TaskTypeSpec(ClassifyTask, "classify", "_classify", "/v1/classify", classify_messages),
    TaskTypeSpec(ChatTask, "chat", "_chat", "/v1/chat/completions", _request_messages, openai=True),
    TaskTypeSpec(CompletionTask, "chat", "_completion", "/v1/completions", _request_messages, openai=True),
    TaskTypeSpec(EmbedTask, "embed", "_embed", "/v1/embed", _embed_messages, since="1.6"),
)
BY_ROUTE = {t.route: t for t in TYPES}
BY_NAME = {t.name: t for t in TYPES}
assert {t.contract for t in TYPES} == set(CONTRACTS), "every contract has exactly one entry"
assert all(t.kind in get_args(Kind) for t in TYPES), "a kind is one the planner plans for"


def names() -> list[str]:
    return [t.name for t in TYPES]


def get(name: str) -> TaskTypeSpec:
    """A task type by its name (``classify.v1``) or without its version (``classify``: the current one)."""
    found = BY_NAME.get(name) or next((t for t in TYPES if t.name.rsplit(".", 1)[0] == name), None)
    if found is None:
        raise UsageError(f"unknown task type {name!r}", hint=f"known: {', '.join(names())}")
    return found


def batch_queue(name: str) -> str:
    """The queue a batch's tasks of this type go to (after the interactive ones)."""
    return get(name).name + BATCH_SUFFIX


def of(task: Any) -> TaskTypeSpec:
    return BY_NAME[task.type]


def for_kinds(kinds: list[str]) -> list[str]:
    """The task types a model of these kinds (the catalog's roles) serves."""
    return [t.name for t in TYPES if t.kind in kinds]


EMBEDDING_KINDS = ("embed", "classify")  # what an embedding model does: vectors, and classification by them


def for_model_kind(kind: str) -> list[str]:
    """The task types a model of this kind serves: an embedding model embeds and classifies; a generator every
    type but embedding; a reranker none."""
    if kind == "generate":
        return [t.name for t in TYPES if t.kind != "embed"]
    return for_kinds(list(EMBEDDING_KINDS)) if kind == "embed" else []


def make(kind: str, **fields: Any) -> Any:
    """A task of this type from its fields (None values left out); ValidationError when they do not fit."""
    return get(kind).contract(**{k: v for k, v in fields.items() if v is not None})
