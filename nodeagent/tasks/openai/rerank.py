"""``/v1/rerank`` in the shape llama-server answers, and Jina's and Cohere's clients send and read: a query and
documents (strings, or objects holding ``text``) in, ``top_n`` and ``return_documents``; out, ``results`` (each
document's ``index`` and ``relevance_score``, most relevant first, with its ``document`` when asked) and ``usage``.
It runs as the ``rerank.v1`` task (``fields.RERANK``'s fields; a document is read whole, never cut)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nodeagent.tasks.contracts import MAX_RERANK_DOCUMENTS, RerankOutput, RerankTask, Result
from nodeagent.tasks.openai.fields import RERANK, Refused


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str
    documents: list[str] = Field(description="The texts (a document sent as an object holding text, as its text)")
    model: str | None = None
    top_n: int | None = Field(None, gt=0, le=MAX_RERANK_DOCUMENTS)
    return_documents: bool = False
    instruction: str | None = None


def rerank_task(body: dict[str, Any]) -> tuple[RerankRequest, RerankTask]:
    """The request checked against its field table and parsed, and the task it runs as; ``Refused`` naming the
    field otherwise."""
    from nodeagent.errors import param_of, validation_message

    RERANK.check(body)
    try:
        request = RerankRequest.model_validate({**body, "documents": texts(body.get("documents"))})
        task = RerankTask(query=request.query, documents=request.documents, top_n=request.top_n,
                          instruction=request.instruction)
    except ValidationError as exc:
        raise Refused(param_of(exc) or "documents", validation_message(exc), code="invalid_value") from None
    return request, task


def texts(documents: Any) -> Any:
    """The documents as texts: a string as it is, an object holding ``text`` alone (Jina's and Cohere's clients
    may send one) as its text; Refused naming the first that is neither."""
    if not isinstance(documents, list):
        return documents  # (the model's validation names it)
    out = []
    for i, d in enumerate(documents):
        if isinstance(d, dict) and set(d) == {"text"} and isinstance(d["text"], str):
            d = d["text"]
        if not isinstance(d, str):
            held = f"an object with {', '.join(sorted(map(str, d)))}" if isinstance(d, dict) else type(d).__name__
            raise Refused("documents", f"document {i} is {held}: a document is a string, or an object holding its "
                                       "text alone ({\"text\": \"...\"})", code="invalid_value")
        out.append(d)
    return out


def rerank_body(result: Result, model: str, request: RerankRequest, task: RerankTask) -> dict[str, Any]:
    """llama-server's answer (which Jina's and Cohere's clients read): the results, most relevant first, each with
    its document's text when the request asked for it, and the tokens read."""
    out = result.output if isinstance(result.output, RerankOutput) else RerankOutput.model_validate(result.output)
    results = [{"index": r.index, "relevance_score": r.relevance_score,
                **({"document": {"text": task.documents[r.index]}} if request.return_documents else {})}
               for r in out.results]
    tokens = result.tokens.prompt
    return {"id": f"rerank-{result.task_id}", "object": "list", "model": model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "meta": {"billed_units": {"search_units": 1}}}
