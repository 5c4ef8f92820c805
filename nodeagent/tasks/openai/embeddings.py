"""``/v1/embeddings`` in OpenAI's shape, as the ``embed.v1`` task it runs as: the request (``fields.EMBEDDINGS``'
fields; a string, a list of strings, token ids or lists of them as input; ``encoding_format`` float or base64;
``dimensions``) to a task, and the task's Result to OpenAI's list of embeddings with its usage."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nodeagent.tasks.contracts import EmbedOutput, EmbedTask, Result
from nodeagent.tasks.openai.fields import EMBEDDINGS, Refused


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, gt=0)
    user: str | None = None


def embed_task(body: dict[str, Any]) -> tuple[EmbeddingsRequest, EmbedTask]:
    """The request checked against its field table and parsed, and the task it runs as; ``Refused`` naming the
    field otherwise."""
    from nodeagent.errors import validation_message

    EMBEDDINGS.check(body)
    try:
        request = EmbeddingsRequest.model_validate(body)
        task = EmbedTask(input=request.input, dimensions=request.dimensions,
                         encoding_format=request.encoding_format)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if not str(p).startswith(("list[", "str", "int"))]
        raise Refused(".".join(loc) or "input", validation_message(exc), code="invalid_value") from None
    return request, task


def embeddings_body(result: Result, model: str) -> dict[str, Any]:
    """OpenAI's answer: a list of embeddings, in the order of the inputs (in the encoding the request asked for),
    and the tokens they took."""
    out = result.output if isinstance(result.output, EmbedOutput) else EmbedOutput.model_validate(result.output)
    vectors = out.embeddings if out.encoding_format == "base64" else out.vectors()
    tokens = sum(out.tokens)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
