"""The backend protocol and the registry: which backend runs a model spec, how its model is read and planned,
and how a plan is loaded.

Every backend (llama.cpp, MLX, the fake one for tests) loads a ``Plan`` with ``load(plan)`` into a
``LoadedModel``: a context manager with an idempotent ``close()`` whose ``sessions()`` are the ``TokenSession``s
(``backends/session.py``) the task runner works on. The registry gives each backend, by import path (each
imports its heavy library lazily, so ``nodeagent --help`` on a Pi never imports MLX):

- ``claims``: whether a model spec is this backend's (the first that claims it; GGUF, the default, last);
- ``read``: what the planner needs of the model, read from its files, the store or the spec (I/O, the edge);
- ``plan``: the pure planner for it (``planner/``);
- ``backend``: the class that loads a plan.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from nodeagent.errors import BackendError

if TYPE_CHECKING:
    from pathlib import Path

    from nodeagent.backends.session import EmbeddingSession, TokenSession
    from nodeagent.planner.types import Plan


class LoadedModel(Protocol):
    name: str  # the backend's name, as Results report it

    def session(self) -> "TokenSession": ...
    def sessions(self, adapt_threads: bool = False) -> "list[TokenSession]":
        """One session per slot: tasks on different slots may run at once, from different threads.
        ``adapt_threads``: a backend with CPU threads may use fewer while other processes hold cores."""
    def keep_prefixes(self, directory: "Path", max_bytes: int, cache_dir: "Path", tally: Any = None) -> None:
        """Keep recurring prompt prefixes' state on disk (before ``sessions``), what they do counted in ``tally``;
        a backend that cannot ignores it."""
    def prefix_store(self) -> Any:
        """The prefixes kept on disk (``prefix_store.PrefixStore``), or None."""
    def fault(self) -> str | None:
        """Why the model cannot serve as it is (a failure left it in a state it could not be reset from: it must be
        loaded again), or None."""
    def close(self) -> None: ...
    def __enter__(self) -> "LoadedModel": ...
    def __exit__(self, *exc: object) -> None: ...


class Backend(Protocol):
    name: str

    def available(self) -> bool: ...
    def load(self, plan: "Plan") -> LoadedModel: ...
    def prompt_tokens(self, model_path: str, count: Callable[["TokenSession"], int]) -> int | None:
        """``count`` (a prompt's tokens, rendered through the model's template: the caller's, so a backend
        knows no prompts) over a session on the model's vocabulary alone, without loading its weights; None
        where the backend cannot tell."""


class ModelHandle:
    """What every loaded model shares: a context manager around an idempotent close()."""

    name = "?"

    def session(self) -> "TokenSession":
        raise NotImplementedError

    def sessions(self, adapt_threads: bool = False) -> "list[TokenSession]":
        """One slot unless the backend batches parallel sequences."""
        return [self.session()]

    def keep_prefixes(self, directory: Path, max_bytes: int, cache_dir: Path, tally: Any = None) -> None:
        """Keep the KV state of prompt prefixes that recur on disk in ``directory`` (bounded to ``max_bytes``)
        and read it back into a slot in place of reading the prefix again (``backends/prefix_store.py``;
        ``cache_dir``: where facts of the model file, its sha256, are remembered; ``tally``: the node's
        ``PrefixTally``, what they did across its loads). A backend that cannot does nothing."""

    def prefix_store(self) -> Any:
        return None

    def embedder(self) -> "EmbeddingSession":
        """An embedding model's forward batches (``backends/session.py``'s ``EmbeddingSession``); a backend that
        does not run embedding models refuses."""
        from nodeagent.errors import BackendError

        raise BackendError(f"the {self.name} backend does not run embedding models",
                           hint="serve the embedding model's GGUF on the llama.cpp backend")

    def fault(self) -> str | None:
        return None

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


@dataclass(frozen=True)
class Entry:
    name: str
    backend: str  # "module:Class"
    read: str  # "module:function" (spec, config, quant) -> (model info, notes)
    plan: str  # "module:function" (model info, hardware, profile, requirements, overhead bytes) -> Plan
    claims: str | None  # "module:function" (spec) -> bool; None: every spec no other backend claims


REGISTRY: tuple[Entry, ...] = (
    Entry("fake", "nodeagent.backends.fake:FakeBackend", "nodeagent.backends.fake:read_fake",
          "nodeagent.planner.fake:plan_fake", "nodeagent.backends.fake:is_fake"),
    Entry("mlx", "nodeagent.backends.mlx:MlxBackend", "nodeagent.modelfile.mlx:read_for_plan",
          "nodeagent.planner.mlx:plan_mlx", "nodeagent.modelfile.mlx:is_mlx_spec"),
    Entry("llamacpp", "nodeagent.backends.llamacpp:LlamaCppBackend", "nodeagent.store.local:read_for_plan",
          "nodeagent.planner.search:plan", None),
)
_BY_NAME = {e.name: e for e in REGISTRY}


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def entry(name: str) -> Entry:
    if name not in _BY_NAME:
        raise BackendError(f"unknown backend {name!r}", hint=f"known: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def backend_name_for(spec: str) -> str:
    """Which backend runs a model spec: the first whose ``claims`` says so, else GGUF on llama.cpp."""
    return next(e.name for e in REGISTRY if e.claims is None or _resolve(e.claims)(spec))


def reader_for(name: str) -> Any:
    return _resolve(entry(name).read)


def planner_for(name: str) -> Any:
    return _resolve(entry(name).plan)


def backend_for(name: str) -> Backend:
    """The backend a plan names."""
    return _resolve(entry(name).backend)()
