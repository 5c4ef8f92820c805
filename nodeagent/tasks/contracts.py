"""Typed, versioned task contracts: ``extract.v1``, ``classify.v1``, ``embed.v1`` (vectors for texts, on an
embedding model), ``rerank.v1`` (documents scored against a query), and OpenAI's chat and text completions as
queue tasks (``chat.v1``, ``completion.v1``), and their ``Result``.

Published as JSON Schema (``nodeagent schema task|result``, ``schemas/*.json``) so
orchestrators in other languages can produce tasks and consume results.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Annotated, Any, Callable, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from nodeagent import payload
from nodeagent.errors import ErrorInfo
from nodeagent.values import Strict

__all__ = ["ErrorInfo"]  # a Result's error: defined with the error hierarchy, part of this contract


class _Model(Strict):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class _Checked(_Model):
    """A contract that comes from callers: all of its text is Unicode (no lone surrogate) and its JSON nesting
    is bounded, so it can be queued, serialised and validated anywhere (a task's envelope adds two levels)."""

    @model_validator(mode="before")
    @classmethod
    def _payload(cls, data: Any) -> Any:
        if isinstance(data, dict):
            payload.check(data, payload.MAX_JSON_DEPTH - 2)
        return data


class Example(_Checked):
    text: str
    output: dict[str, Any]


class LabeledExample(_Checked):
    """A worked classification: a text and the label it gets (rendered as a turn of the conversation)."""

    text: str
    label: str


class LabelSpec(_Checked):
    name: str = Field(min_length=1, max_length=200)
    description: str | None = None

    @field_validator("name")
    @classmethod
    def _strip(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("a label name cannot be blank")
        return v


class _Queued(_Checked):
    """What every task carries, whatever its work."""

    id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=200)
    deadline: datetime | None = Field(None, description="When the result stops being useful (UTC); "
                                                         "generation stops there")
    idempotency_key: str | None = Field(None, max_length=200, description="Same key, same result: a retried "
                                                                          "submission is not run twice")
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))


class _TaskBase(_Queued):
    input: str = Field(description="The text to work on (not empty)")

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("the input is empty: give the text to work on")
        return v


class ExtractTask(_TaskBase):
    type: Literal["extract.v1"] = "extract.v1"
    # fields a contract minor added (by their wire names), and that minor: a task that sets one is routed to the
    # nodes that read it (``needs``), never to an older one that would refuse it
    SINCE: ClassVar[dict[str, str]] = {"prompt": "1.2", "copy": "1.2"}
    json_schema: dict[str, Any] = Field(alias="schema", description="JSON Schema of the object to extract "
                                                                     "(the supported subset: see docs/typed-tasks.md)")
    instructions: str | None = None
    examples: list[Example] = Field(default_factory=list)
    prompt: Literal["schema", "fields", "none"] | None = Field(
        None, description="How the system prompt states what to extract: the JSON Schema (schema), one line per "
                          "field with its type and description (fields), or only the instruction, the grammar "
                          "alone holding the shape (none); unset: the default (docs/typed-tasks.md)")
    copy_mode: Literal["auto", "all", "none"] | None = Field(
        None, alias="copy", description="Which string fields must be spans of the input (tasks/copying.py): "
                                        "those whose name or format says so (auto), every plain string field "
                                        "(all), none but those the schema marks with x-nodeagent copy (none); "
                                        "unset: the default (docs/typed-tasks.md)")

    @model_validator(mode="after")
    def _schema_supported(self) -> "ExtractTask":
        from nodeagent.tasks.schema import check_schema

        check_schema(self.json_schema)  # raises ValueError with the reason
        return self


def _auto_or(v: Any, kind: type, accepts: Callable[[Any], bool], message: str) -> Any:
    """A field of ``kind | "auto"``, parsed with one message for both branches (pydantic's first error names only
    the ``kind`` one): "auto", or ``v`` as ``kind`` (pydantic's lax parsing) when ``accepts`` it."""
    if v == "auto":
        return v
    try:
        value = TypeAdapter(kind).validate_python(v)
    except ValidationError:
        raise ValueError(message.format(v)) from None
    if not accepts(value):
        raise ValueError(message.format(v))
    return value


class ClassifyTask(_TaskBase):
    type: Literal["classify.v1"] = "classify.v1"
    labels: list[LabelSpec] = Field(min_length=2, max_length=200)
    multi_label: bool = False
    threshold: Annotated[float, Field(gt=0.0, lt=1.0)] | Literal["auto"] = Field(
        "auto", description="Multi-label: labels at or above this probability (above 0, below 1); auto: 1 / K of K "
                            "labels, the share a label gets when the prompt favours none (docs/typed-tasks.md, "
                            "Classification)")
    instructions: str | None = None
    examples: list[LabeledExample] = Field(default_factory=list, max_length=64,
                                           description="Worked examples, rendered as turns before the input")
    calibrate: bool | Literal["auto"] = Field(
        "auto", description="Divide each label's probability by the one it gets for content-free inputs under the "
                            "same prompt, then renormalise (contextual calibration); auto: as measured best "
                            "(docs/typed-tasks.md, Classification)")
    answer: Literal["json", "label"] = Field(
        "json", description="The answer the labels are scored in: json, as the value the JSON route writes "
                            "({\"label\": \"...\"}, after the same prompt); label, the bare label")
    length_norm: bool = Field(False, description="Score a label by the mean log-probability of its tokens "
                                                 "instead of their sum (labels of different token counts)")

    @field_validator("labels", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"name": x} if isinstance(x, str) else x for x in v]
        return v

    @field_validator("calibrate", mode="before")
    @classmethod
    def _calibrate(cls, v: Any) -> Any:
        return _auto_or(v, bool, lambda x: True, 'calibrate must be true, false or "auto", not {!r}')

    @field_validator("threshold", mode="before")
    @classmethod
    def _threshold(cls, v: Any) -> Any:
        return _auto_or(v, float, lambda x: 0.0 < x < 1.0,
                        'threshold must be a probability above 0 and below 1, or "auto", not {!r}')

    @model_validator(mode="after")
    def _unique(self) -> "ClassifyTask":
        seen: set[str] = set()
        for label in self.labels:
            key = label.name.casefold()
            if key in seen:
                raise ValueError(f"duplicate label {label.name!r}")
            seen.add(key)
        names = {label.name for label in self.labels}
        for ex in self.examples:
            if ex.label not in names:
                raise ValueError(f"the example labelled {ex.label!r} names no label of the task")
        return self


MAX_EMBED_INPUTS = 2048  # OpenAI's most inputs in one embeddings request


class EmbedTask(_Queued):
    """Vectors for texts, or for token ids: a vector per input, in order, as the embedding model pools them
    (``/v1/embeddings``' input as a task)."""

    type: Literal["embed.v1"] = "embed.v1"
    input: list[str] | list[list[int]] = Field(min_length=1, max_length=MAX_EMBED_INPUTS,
                                               description="The texts (or each input's token ids) to embed")
    dimensions: int | None = Field(None, gt=0, description="Each vector cut to its first N values and normalised "
                                                           "again: only to a Matryoshka size the model declares")
    normalize: bool = Field(True, description="Each vector scaled to length 1, as OpenAI's are (False: as pooled)")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="How /v1/embeddings (and a batch's output line) gives the vectors back: floats, or "
                             "base64 of little-endian float32 (the Result holds base64 either way)")

    @field_validator("input", mode="before")
    @classmethod
    def _one(cls, v: Any) -> Any:
        if isinstance(v, str):  # one text
            return [v]
        if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return [v]  # one input's token ids
        return v

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v: list[Any]) -> list[Any]:
        for i, x in enumerate(v):
            if (isinstance(x, str) and not x.strip()) or (isinstance(x, list) and not x):
                raise ValueError(f"input {i} is empty: every input holds text (or tokens)")
            if isinstance(x, list) and any(t < 0 for t in x):
                raise ValueError(f"input {i} holds a negative token id")
        return v


class EmbedOutput(_Model):
    """A vector per input, in order: each base64 of its little-endian float32 values (OpenAI's base64 encoding;
    a quarter of the JSON's size), their size, and each input's tokens."""

    embeddings: list[str]
    dimensions: int
    tokens: list[int] = Field(description="The tokens each input took")
    encoding_format: Literal["float", "base64"] = Field("float", description="How the task asked OpenAI's API to "
                                                                             "give them back")

    def vectors(self) -> list[list[float]]:
        """The vectors as floats."""
        import base64

        import numpy as np

        return [np.frombuffer(base64.b64decode(e), dtype="<f4").tolist() for e in self.embeddings]


MAX_RERANK_DOCUMENTS = 1000  # the most documents one rerank task scores (Cohere's and Jina's bound)


class RerankTask(_Queued):
    """Documents scored against a query, most relevant first (``/v1/rerank``'s request as a task): by a reranker
    (a cross-encoder GGUF, llama.cpp's rank pooling), or by a model that generates (its yes/no answer to whether the
    document meets the query). Each document is read whole, never cut."""

    type: Literal["rerank.v1"] = "rerank.v1"
    query: str = Field(min_length=1, description="What the documents are ranked against (not empty)")
    documents: list[str] = Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS,
                                 description="The texts to score, each not empty")
    top_n: int | None = Field(None, gt=0, le=MAX_RERANK_DOCUMENTS,
                              description="Only the N most relevant (all of them by default; more than the documents: "
                                          "all of them)")
    instruction: str | None = Field(None, max_length=4000,
                                    description="A generator's: what relevance means for this query (Qwen3-Reranker's "
                                                "Instruct; by default web-search relevance); a reranker does not "
                                                "read it")

    @field_validator("query")
    @classmethod
    def _query(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("the query is empty: give the text the documents are ranked against")
        return v

    @field_validator("documents")
    @classmethod
    def _documents(cls, v: list[str]) -> list[str]:
        for i, x in enumerate(v):
            if not x.strip():
                raise ValueError(f"document {i} is empty: every document holds text")
        return v


class RerankScore(_Model):
    index: int = Field(description="The document's place in the task's documents")
    relevance_score: float = Field(description="The probability that the document is relevant to the query (0 to 1):"
                                               " a reranker's score through a logistic, a generator's P(yes)")


class RerankOutput(_Model):
    """The documents' scores, most relevant first (the ``top_n`` most relevant when the task says so)."""

    results: list[RerankScore]

    @classmethod
    def ranked(cls, scores: list[float], top_n: int | None) -> "RerankOutput":
        """The output of ``scores`` (one a document, in the task's order): ordered by score, the highest first (a
        tie by the document's place), cut to ``top_n``."""
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
        return cls(results=[RerankScore(index=i, relevance_score=float(scores[i])) for i in order])


class _OpenAiTask(_Queued):
    """An OpenAI request queued as a task: the body ``/v1/chat/completions`` or ``/v1/completions`` takes, held
    to the same field table (each field honoured, harmless or refused), not streamed. Its result's
    output is the response body the route would have answered."""

    request: dict[str, Any] = Field(description="The OpenAI request body (not streamed)")
    openai_table: ClassVar[str] = ""

    @field_validator("request")
    @classmethod
    def _honoured(cls, v: dict[str, Any]) -> dict[str, Any]:
        from nodeagent.tasks.openai.requests import queued_request

        queued_request(cls.openai_table, v)  # ValueError with the field and the reason
        return v


class ChatTask(_OpenAiTask):
    type: Literal["chat.v1"] = "chat.v1"
    openai_table: ClassVar[str] = "chat"


class CompletionTask(_OpenAiTask):
    type: Literal["completion.v1"] = "completion.v1"
    openai_table: ClassVar[str] = "completion"


# Every contract, once: its `type` literal is the task type's one spelling (tasks/registry.py reads it from here)
CONTRACTS = (ExtractTask, ClassifyTask, ChatTask, CompletionTask, EmbedTask, RerankTask)
TYPE_NAMES = tuple(c.model_fields["type"].default for c in CONTRACTS)
AnyTask = Union[CONTRACTS]  # type: ignore[valid-type]
Task = Annotated[AnyTask, Field(discriminator="type")]


class ClassifyOutput(_Model):
    label: str = Field(description="The most probable label")
    labels: list[str] = Field(default_factory=list, description="Multi-label: every label at or above the threshold")
    probabilities: dict[str, float] = Field(description="Single-label: every label's probability, normalised over "
                                                        "the labels (they sum to 1). Multi-label: each label's own "
                                                        "probability of applying, judged against a neutral input")


class Timings(_Model):
    queue_wait_s: float = 0.0
    prompt_s: float = 0.0
    generation_s: float = 0.0
    total_s: float = 0.0


class TokenCounts(_Model):
    prompt: int = 0
    generated: int = 0


class Result(_Model):
    """A task's outcome. Read leniently: a field a newer contract minor added is ignored, not an error (the
    compatibility rule, schemas/redis-contract.md); written for the reader: ``for_reader`` leaves out what the
    task's writer's contract does not know, and a field left out is not written at all."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)
    # fields a contract minor added to results, and that minor: left out for a reader of an older one
    SINCE: ClassVar[dict[str, tuple[int, int]]] = {"field_logprobs": (1, 3)}

    task_id: str
    type: Literal[TYPE_NAMES]  # type: ignore[valid-type]
    status: Literal["ok", "error"]
    output: dict[str, Any] | ClassifyOutput | EmbedOutput | RerankOutput | None = Field(
        None, description="extract: the validated object; classify: label, labels, probabilities; embed: the "
                          "vectors (EmbedOutput); rerank: the documents' scores, most relevant first (RerankOutput); "
                          "chat, completion: OpenAI's response body")
    error: ErrorInfo | None = None
    model: str | None = None
    quant: str | None = None
    backend: str | None = None
    timings: Timings = Timings()
    tokens: TokenCounts = TokenCounts()
    attempts: int = 1
    notes: list[str] = Field(default_factory=list, description="Stated behaviour, e.g. a fallback chat template")
    field_logprobs: dict[str, float] | None = Field(
        None, description="extract: each top-level field's mean log-probability over the tokens the model chose "
                          "for its value (<= 0; 0 when the grammar left one way to write it): a confidence to send "
                          "low fields to review (tasks/field_logprobs.py, docs/typed-tasks.md)")

    @model_serializer(mode="wrap")
    def _leave_out(self, handler: Any) -> dict[str, Any]:
        """The fields a minor added are not written while unset, so a reader of an older minor reads the rest."""
        out = handler(self)
        for name in self.SINCE:
            if out.get(name, 0) is None:
                del out[name]
        return out

    def for_reader(self, contract: tuple[int, int]) -> "Result":
        """This result as a reader of ``contract`` (MAJOR, MINOR) can read it: the fields added after it unset."""
        late = {name: None for name, since in self.SINCE.items()
                if contract < since and getattr(self, name) is not None}
        return self.model_copy(update=late) if late else self

    @model_validator(mode="before")
    @classmethod
    def _typed_output(cls, data: Any) -> Any:
        """A classify, embed or rerank result read back from JSON gets its typed output, not a plain dict."""
        outputs = {"classify.v1": ClassifyOutput, "embed.v1": EmbedOutput, "rerank.v1": RerankOutput}
        typed = outputs.get(data.get("type")) if isinstance(data, dict) else None
        if typed is not None and isinstance(data.get("output"), dict):
            data = {**data, "output": typed.model_validate(data["output"])}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "Result":
        if self.status == "ok" and (self.output is None or self.error is not None):
            raise ValueError("an ok result has an output and no error")
        if self.status == "error" and (self.error is None or self.output is not None):
            raise ValueError("an error result has an error and no output: no partial result passes as one")
        return self


def wire(task: BaseModel) -> dict[str, Any]:
    """A task as the queue carries it: its fields by their wire names, less the optional ones left unset (None by
    default and None here), so a task that uses nothing a newer contract minor added reads under an older one: a
    fleet mid-upgrade runs it on any node (schemas/redis-contract.md)."""
    out = task.model_dump(mode="json", by_alias=True)
    for name, field in type(task).model_fields.items():
        key = field.alias or name
        if out.get(key, 0) is None and field.default is None:
            del out[key]
    return out


def task_json_schema() -> dict[str, Any]:
    return TypeAdapter(Task).json_schema(by_alias=True)


def result_json_schema() -> dict[str, Any]:
    return Result.model_json_schema(by_alias=True)


# A batch's lines go to queues of their own, which workers take after the interactive ones (a batch must not
# starve interactive work): ``chat.v1.batch`` holds chat.v1 tasks.
BATCH_SUFFIX = ".batch"


def queue_type(queue: str) -> str:
    """The task type a queue holds: ``chat.v1`` for ``chat.v1`` and ``chat.v1.batch`` (and a route's queue,
    ``extract.v1~1.2``)."""
    return queue.split(ROUTE_MARK, 1)[0].removesuffix(BATCH_SUFFIX)


# A task that sets a field a contract minor added after its type is routed apart: ``<queue>~<minor>`` (a stream of
# its own on Redis, its queue column on SQLite), which only nodes that read routes (ROUTED_SINCE and later) take,
# each the routes of minors it knows. A node of an older minor never claims what it could not read.
ROUTE_MARK = "~"


def _contract_of(queue: str) -> Any:
    return next((c for c in CONTRACTS if c.model_fields["type"].default == queue_type(queue)), None)


def field_minors(queue: str) -> list[str]:
    """The contract minors that added fields to the task type of ``queue`` (each a route of its own)."""
    contract = _contract_of(queue)
    since = getattr(contract, "SINCE", {}) if contract is not None else {}
    return sorted(set(since.values()), key=lambda v: tuple(int(x) for x in v.split(".")))


def needs(queue: str, task: dict[str, Any]) -> str | None:
    """The contract minor a node must read to run ``task`` (its wire form) when that is later than its type's
    own: the latest minor of the fields it sets; None when any node that runs the type reads it."""
    contract = _contract_of(queue)
    since: dict[str, str] = getattr(contract, "SINCE", {}) if contract is not None else {}
    used = [v for k, v in since.items() if task.get(k) is not None]
    return max(used, key=lambda v: tuple(int(x) for x in v.split("."))) if used else None
