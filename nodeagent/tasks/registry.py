"""The task types, each declared once (``TaskTypeSpec``): its contract (whose ``type`` literal is its name and
queue), the role a model needs for it (the planner's task and the catalog's role), the kinds of model that run it
(``model_kinds.py``), the runner's hook that runs it, the fields a kind does not read, its time limit, and its typed
HTTP route. The broker, the worker, the client, the CLI, the model set, the gateway and the server read this;
adding a type is one contract in ``contracts.py``, one entry here, and its hook on the runners that run it
(docs/architecture.md, "How to add a task type")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, get_args

from nodeagent.errors import UsageError
from nodeagent.model_kinds import ModelKind
from nodeagent.planner.types import TaskType as Role
from nodeagent.tasks.contracts import (
    BATCH_SUFFIX,
    CONTRACTS,
    ChatTask,
    ClassifyTask,
    CompletionTask,
    EmbedTask,
    ExtractTask,
    RerankTask,
)
from nodeagent.tasks.prompts import classify_messages, extract_messages, rerank_messages

# a hook: (runner, task, notes, timing, counts) -> the task's output; each one a public method of ``Runner``
# (tasks/runner.py), which refuses it naming the model's kind unless the runner of that kind overrides it
Hook = Callable[[Any, Any, list, dict, dict], Any]


@dataclass(frozen=True)
class TaskTypeSpec:
    contract: Any  # the pydantic model of the task
    role: Role  # what a model must suit: the planner's task, the catalog's role
    kinds: frozenset[ModelKind]  # the kinds of model that run it
    hook: Hook  # the runner's method that runs it
    route: str  # the HTTP route that serves it (and a batch line's url)
    messages: Any  # (task) -> the chat messages of its prompt
    openai: bool = False  # an OpenAI request queued (its route is OpenAI's; the task holds the request body)
    since: str = "1.0"  # the fleet's contract version that brought it: an older node cannot run it
    # the task's fields a kind runs it without reading: each with why, said in the Result's notes when the task
    # sets it (a field honoured, or ignored with a note; a refused one is the contract's to refuse)
    unread: Mapping[ModelKind, Mapping[str, str]] = field(default_factory=dict)
    timeout_s: float | None = None  # its own time limit, None: NODEAGENT_TASK_TIMEOUT_S's (for all, or per type)
    own_door: bool = False  # its route answers in its clients' shape (server/openai_routes.py), not the Result
    prefers: ModelKind | None = None  # of a node's models that run it, the kind a task naming none goes to first

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


def _rerank_messages(task: Any) -> list[dict[str, Any]]:
    """A rerank task's prompts, a document's each, as one list (what its prompt is, for a count of its tokens)."""
    return [m for d in task.documents for m in rerank_messages(task, d)]


GENERATE, EMBED = frozenset({ModelKind.GENERATE}), frozenset({ModelKind.EMBED})
# label scoring's own fields, which classification by embeddings does not read
_SCORING = "label scoring's (classification by a model that generates); an embedding model does not read it"
TYPES: tuple[TaskTypeSpec, ...] = (
    TaskTypeSpec(ExtractTask, "extract", GENERATE, lambda r, *a: r.extract(*a), "/v1/extract", extract_messages),
    TaskTypeSpec(ClassifyTask, "classify", GENERATE | EMBED, lambda r, *a: r.classify(*a), "/v1/classify",
                 classify_messages, unread={ModelKind.EMBED: {
                     "instructions": "not read by an embedding model (its labels and examples are)",
                     "answer": _SCORING, "calibrate": _SCORING, "length_norm": _SCORING}}),
    TaskTypeSpec(ChatTask, "chat", GENERATE, lambda r, *a: r.complete("chat", *a), "/v1/chat/completions",
                 _request_messages, openai=True),
    TaskTypeSpec(CompletionTask, "chat", GENERATE, lambda r, *a: r.complete("completion", *a), "/v1/completions",
                 _request_messages, openai=True),
    TaskTypeSpec(EmbedTask, "embed", EMBED, lambda r, *a: r.embed(*a), "/v1/embed", _embed_messages, since="1.6"),
    TaskTypeSpec(RerankTask, "rerank", GENERATE | {ModelKind.RERANK}, lambda r, *a: r.rerank(*a), "/v1/rerank",
                 _rerank_messages, since="1.8", own_door=True, prefers=ModelKind.RERANK, unread={ModelKind.RERANK: {
                     "instruction": "a generator's (its prompt's Instruct); a reranker reads the query and the "
                                    "document alone"}}),
)
BY_ROUTE = {t.route: t for t in TYPES}
BY_NAME = {t.name: t for t in TYPES}
assert {t.contract for t in TYPES} == set(CONTRACTS), "every contract has exactly one entry"
assert all(t.role in get_args(Role) for t in TYPES), "a role is one the planner plans for"


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


def for_roles(roles: list[str]) -> list[str]:
    """The task types a model of these roles (the catalog's) serves."""
    return [t.name for t in TYPES if t.role in roles]


def for_model_kind(kind: ModelKind | str) -> list[str]:
    """The task types a model of this kind runs (each type's ``kinds``): an embedding model embeds and classifies;
    a generator every type but embedding; a reranker reranks."""
    return [t.name for t in TYPES if ModelKind(kind) in t.kinds]


def runs(task_type: str, kind: ModelKind | str) -> bool:
    """Whether a model of ``kind`` runs tasks of ``task_type`` (its name, or its queue's): the one question the
    gateway, the model set and the runner ask before a task meets a model."""
    spec = BY_NAME.get(task_type.removesuffix(BATCH_SUFFIX))
    return spec is not None and ModelKind(kind) in spec.kinds


def preferred(task_type: str) -> ModelKind | None:
    """Of the kinds that run ``task_type`` (its name, or its queue's), the one a task naming no model goes to first
    (``prefers``), or None."""
    spec = BY_NAME.get(task_type.removesuffix(BATCH_SUFFIX))
    return spec.prefers if spec is not None else None


def make(name: str, **fields: Any) -> Any:
    """A task of this type from its fields (None values left out); ValidationError when they do not fit."""
    return get(name).contract(**{k: v for k, v in fields.items() if v is not None})
