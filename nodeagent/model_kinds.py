"""What a model does, its kind: derived once, where its header is read (``modelfile/info.py``: a GGUF's pooling
type), and asked by capability everywhere else (``kind.generates``, ``kind.embeds``), never compared as a string.

- ``generate``: a decoder that writes text (no pooling): extraction, label scoring, chat, completions;
- ``embed``: an encoder (or a decoder given a pooling type) that pools one vector per input (mean, CLS, last
  token): embeddings, and classification by them;
- ``rerank``: a cross-encoder that pools one relevance score per query and document (llama.cpp's rank pooling).

Which task types a kind runs is each task type's own declaration (``tasks/registry.py``: ``TaskTypeSpec.kinds``);
``registry.runs(task_type, kind)`` is the one question the gateway, the model set and the runner ask.
"""

from __future__ import annotations

from enum import Enum


class ModelKind(str, Enum):
    """A model's kind; its value is the word every record, plan and message shows (``"generate"``...)."""

    GENERATE = "generate"
    EMBED = "embed"
    RERANK = "rerank"

    @classmethod
    def of_pooling(cls, pooling: str | None) -> "ModelKind":
        """The kind a GGUF's pooling type makes (``modelfile/info.py`` reads it: None for a model that
        generates; mean, cls or last for one that embeds; rank for a reranker)."""
        if pooling is None:
            return cls.GENERATE
        return cls.RERANK if pooling == "rank" else cls.EMBED

    @property
    def generates(self) -> bool:
        return self is ModelKind.GENERATE

    @property
    def embeds(self) -> bool:
        return self is ModelKind.EMBED

    @property
    def ranks(self) -> bool:
        return self is ModelKind.RERANK

    @property
    def described(self) -> str:
        """What a model of this kind is, in words (for the refusal of a task it does not run)."""
        return {"generate": "generates text", "embed": "is an embedding model: it embeds and classifies by "
                                                         "embeddings, and never generates text",
                "rerank": "is a reranker: it scores a document against a query"}[self.value]

    def __str__(self) -> str:
        return self.value


__all__ = ["ModelKind"]
