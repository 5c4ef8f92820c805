"""The one frozen base model every typed value between stages derives from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """An immutable value: what one stage hands the next."""

    model_config = ConfigDict(frozen=True)


class Strict(Frozen):
    """An immutable value read from a file or a caller: unknown fields are an error, not ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")
