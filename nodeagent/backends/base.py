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


class ModelHandle:
    """What every loaded model shares: a context manager around an idempotent close()."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def importable(*modules: str) -> bool:
    """Whether a backend's libraries can be imported here (without importing them twice)."""
    import importlib

    try:
        for m in modules:
            importlib.import_module(m)
    except ImportError:
        return False
    return True
