"""The backend protocol: what a backend says about itself, and what a loaded model gives the tasks.

Every backend (llama.cpp, MLX, the fake one for tests) loads a ``Plan`` with
``load(plan)`` into a ``LoadedModel``: a context manager with an idempotent
``close()`` whose ``session()`` is the ``TokenSession`` (``backends/session.py``)
the task runner works on. ``backend_for(name)`` is the registry; each backend
imports its heavy library lazily, so ``nodeagent --help`` on a Pi never imports MLX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

from nodeagent.values import Frozen
from nodeagent.errors import BackendError

if TYPE_CHECKING:
    from nodeagent.backends.session import TokenSession
    from nodeagent.planner.types import Plan


class Capabilities(Frozen):
    constrained_json: bool
    kv_types: list[str]
    gpu_offload: bool
    label_scoring: bool
    mmap: bool


class LoadedModel(Protocol):
    name: str  # the backend's name, as Results report it

    def session(self) -> "TokenSession": ...
    def sessions(self, adapt_threads: bool = False) -> "list[TokenSession]":
        """One session per slot: tasks on different slots may run at once, from different threads.
        ``adapt_threads``: a backend with CPU threads may use fewer while other processes hold cores."""
    def close(self) -> None: ...
    def __enter__(self) -> "LoadedModel": ...
    def __exit__(self, *exc: object) -> None: ...


class Backend(Protocol):
    name: str

    def available(self) -> bool: ...
    def capabilities(self) -> Capabilities: ...
    def load(self, plan: "Plan") -> LoadedModel: ...


class ModelHandle:
    """What every loaded model shares: a context manager around an idempotent close()."""

    name = "?"

    def session(self) -> "TokenSession":
        raise NotImplementedError

    def sessions(self, adapt_threads: bool = False) -> "list[TokenSession]":
        """One slot unless the backend batches parallel sequences."""
        return [self.session()]

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def importable(*modules: str) -> bool:
    """Whether a backend's libraries can be imported here (without importing them twice)."""
    try:
        for m in modules:
            importlib.import_module(m)
    except ImportError:
        return False
    return True


_REGISTRY = {"llamacpp": ("nodeagent.backends.llamacpp", "LlamaCppBackend"),
             "mlx": ("nodeagent.backends.mlx", "MlxBackend"),
             "fake": ("nodeagent.backends.fake", "FakeBackend")}


def backend_for(name: str) -> Backend:
    """The backend a plan names."""
    if name not in _REGISTRY:
        raise BackendError(f"unknown backend {name!r}", hint=f"known: {', '.join(_REGISTRY)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)()
