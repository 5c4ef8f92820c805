"""A client's token ids, checked once before a model reads them: the same check on every door and task type."""

from __future__ import annotations

from typing import Any

from nodeagent.backends.session import foreign_token
from nodeagent.errors import TaskFailed


def token_ids(ids: Any, n_vocab: int, what: str) -> list[int]:
    """A client's token ids (a prompt's, an input's, a logit bias's keys) as the model may read them: every one an
    id of its vocabulary, else TaskFailed(invalid_request) naming ``what`` and the id, before llama.cpp (where one id
    past the vocabulary fails every task sharing its batch) or the sampler reads any. The one check, on every
    door and task type."""
    ids = list(ids)
    bad = foreign_token(ids, n_vocab)
    if bad is not None:
        raise TaskFailed("invalid_request", f"{what}: token {bad} is not in the model's vocabulary (0-{n_vocab - 1})",
                         False)
    return ids
