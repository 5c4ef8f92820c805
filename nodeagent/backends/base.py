"""The backend protocol: what a backend says about itself and what a loaded model does."""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict


class Capabilities(BaseModel):
    model_config = ConfigDict(frozen=True)

    constrained_json: bool
    kv_types: list[str]
    gpu_offload: bool
    label_scoring: bool
    mmap: bool


class LoadedModel(Protocol):
    def generate(self, prompt: str, max_tokens: int = 64, **kwargs: Any) -> str: ...
    def close(self) -> None: ...
    def __enter__(self) -> "LoadedModel": ...
    def __exit__(self, *exc: object) -> None: ...


class Backend(Protocol):
    name: str

    def available(self) -> bool: ...
    def capabilities(self) -> Capabilities: ...
    def load(self, plan: Any) -> LoadedModel: ...
