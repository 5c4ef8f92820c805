"""llama.cpp through llama-cpp-python: load a plan with exactly its settings, and report.

The load captures llama.cpp's own buffer report (routed into Python logging)
and the process memory before and after, so every plan can be checked against
what really happened (``LoadReport``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from pydantic import Field

from nodeagent.backends.base import ModelHandle, importable
from nodeagent.backends.llamacpp_log import BufferReport, capture, parse_buffers
from nodeagent.backends.prefix_store import Opener
from nodeagent.errors import BackendError
from nodeagent.kv_types import GGML_TYPE_IDS
from nodeagent.planner.types import Memory, Plan, Settings
from nodeagent.procmem import ProcessMemory, process_memory
from nodeagent.values import Frozen

if TYPE_CHECKING:
    from nodeagent.backends.llamacpp_batch import SlotSession

log = logging.getLogger(__name__)


class ComponentCheck(Frozen):
    component: str
    planned_bytes: int
    actual_bytes: int


class LoadReport(Frozen):
    """Planned vs what llama.cpp reported, and what the process really used."""

    settings: Settings
    planned: Memory
    buffers: dict[str, dict[str, int]] = Field(description="llama.cpp's reported buffers by kind and name")
    components: list[ComponentCheck]
    load_s: float
    memory_before: ProcessMemory
    memory_after: ProcessMemory


def _actual_components(buf: BufferReport) -> dict[str, int]:
    model = dict(buf.model)
    mapped = sum(v for k, v in model.items() if k.endswith("_Mapped"))
    repacked = sum(v for k, v in model.items() if k in ("AMX", "CPU_REPACK"))
    plain_cpu = model.get("CPU", 0)
    return {
        "weights_mapped_bytes": mapped,
        "weights_anon_bytes": repacked + plain_cpu,
        "kv_bytes": buf.kv_bytes,
        "compute_bytes": buf.compute_bytes,
        "output_bytes": buf.output_bytes,
    }


class LlamaCppModel(ModelHandle):
    """A loaded llama.cpp model. A context manager; ``close()`` is idempotent."""

    name = "llamacpp"

    def __init__(self, llama: Any, report: LoadReport) -> None:
        self.llama = llama
        self.report = report
        self._engine: Any = None
        self._embedder: Any = None
        self._prefixes = Opener()  # the PrefixStore, once its key (the model file's sha256) is known

    def keep_prefixes(self, directory: Path, max_bytes: int, cache_dir: Path, tally: Any = None) -> None:
        """Keep the state of prompt prefixes that recur on disk (``prefix_store``), keyed by the model file's
        sha256 (found on a thread of its own and remembered in ``cache_dir`` by the file's path, size and time:
        until then nothing is stored or read), llama-cpp-python's version and the KV types; ``tally``: where
        what they do is counted (``PrefixTally``, kept by the node across its loads)."""
        if max_bytes <= 0 or self.report.settings.pooling is not None:
            return
        import llama_cpp

        from nodeagent.backends.prefix_store import StateKey, model_sha256

        s = self.report.settings

        def key() -> StateKey:
            cache_dir.mkdir(parents=True, exist_ok=True)
            return StateKey(model_sha256(Path(s.model_path), cache_dir),
                            f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", f"{s.type_k}/{s.type_v}")

        self._prefixes.open(directory, max_bytes, key, tally)

    def prefix_store(self) -> Any:
        """The PrefixStore, or None (not kept, or its key not known yet)."""
        return self._prefixes.store

    def embedder(self) -> Any:
        """An embedding model's (or a reranker's) shared forward batches (``llamacpp_embed.LlamaEmbedder``)."""
        if self.llama is None:
            raise BackendError("the model is closed")
        pooling = self.report.settings.pooling
        if pooling is None:
            raise BackendError(f"{self.report.settings.model_path} is not an embedding model: it generates text")
        if self._embedder is None:
            from nodeagent.backends.llamacpp_embed import LlamaEmbedder

            self._embedder = LlamaEmbedder(self.llama, pooling)
        return self._embedder

    def fault(self) -> str | None:
        return None if self._embedder is None else self._embedder.broken

    def session(self) -> "SlotSession":
        """The first slot's TokenSession (nodeagent.backends.session.TokenSession)."""
        return self.sessions()[0]

    def sessions(self, adapt_threads: bool = False) -> "list[SlotSession]":
        """One TokenSession per slot of the plan, all decoded by one BatchEngine thread (``llamacpp_batch``):
        with several slots, their steps go in one batch; with one, every llama_decode still comes from that one
        thread, whichever thread runs the task (OpenMP keeps a spinning thread team per calling thread: two
        teams on the same cores made each token about 2-3x slower here). ``adapt_threads``: give threads up
        while other processes hold cores (``backends/threads.py``)."""
        if self.llama is None:
            raise BackendError("the model is closed")
        if self.report.settings.pooling is not None:
            raise BackendError(f"{self.report.settings.model_path} is an embedding model: it does not generate")
        if self._engine is None:
            from nodeagent.backends.llamacpp_batch import BatchEngine
            from nodeagent.backends.llamacpp_vocab import LlamaCppVocab

            s = self.report.settings
            governor = None
            if adapt_threads and s.n_threads > 1:
                from nodeagent import hostload
                from nodeagent.backends.threads import ThreadGovernor

                governor = ThreadGovernor(s.n_threads, hostload.cpu_count(),
                                          lambda: hostload.other_cpu_pct(max_age_s=0.2))
            self._engine = BatchEngine(LlamaCppVocab(self.llama), s.slots, max(1, s.n_seq_max // s.slots), governor,
                                       prefixes=self.prefix_store)
        return list(self._engine.sessions)

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        return self.llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def generate(self, prompt: str, max_tokens: int = 64, **kwargs: Any) -> str:
        out = self.llama.create_completion(prompt, max_tokens=max_tokens, **kwargs)
        return out["choices"][0]["text"]

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self._prefixes.close()
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None
        if self.llama is not None:
            self.llama.close()
            self.llama = None


_PARAMS_LOCK = threading.Lock()


@contextlib.contextmanager
def _context_params(n_seq_max: int) -> Iterator[None]:
    """llama-cpp-python's Llama() takes no n_seq_max or kv_unified: give its constructor context defaults
    with them set. One unified KV cache holds every sequence (n_ctx cells in all, as with one sequence);
    sequences that share the prompt's cells let label branches run in one batch."""
    if n_seq_max <= 1:
        yield
        return
    import llama_cpp.llama_cpp as lib

    original = lib.llama_context_default_params

    def defaults() -> Any:
        params = original()
        params.n_seq_max = n_seq_max
        params.kv_unified = True
        return params

    with _PARAMS_LOCK:
        lib.llama_context_default_params = defaults
        try:
            yield
        finally:
            lib.llama_context_default_params = original


def open_llama(s: Settings) -> Any:
    """A llama-cpp-python Llama on exactly these settings (n_seq_max and the unified KV cache included): the
    backend's load, and the benchmarks' llama-cpp-python-alone side, which must run on the same settings."""
    import llama_cpp

    from nodeagent.backends.llamacpp_embed import POOLING_TYPES

    embedding = {"embedding": True, "pooling_type": POOLING_TYPES[s.pooling]} if s.pooling else {}
    with _context_params(s.n_seq_max):
        return llama_cpp.Llama(
            model_path=s.model_path, n_ctx=s.n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch,
            n_threads=s.n_threads, n_threads_batch=s.n_threads, n_gpu_layers=s.n_gpu_layers,
            use_mmap=s.use_mmap, use_mlock=s.use_mlock, flash_attn=s.flash_attn, swa_full=s.swa_full,
            type_k=GGML_TYPE_IDS[s.type_k], type_v=GGML_TYPE_IDS[s.type_v], verbose=False, **embedding,
        )


class LlamaCppBackend:
    name = "llamacpp"

    def available(self) -> bool:
        return importable("llama_cpp")

    def prompt_tokens(self, model_path: str, count: Callable[[Any], int]) -> int | None:
        """``count`` over a session on the model's vocabulary alone (no weights)."""
        import llama_cpp

        from nodeagent.backends.llamacpp_vocab import LlamaCppVocab

        vocab = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
        try:
            return count(LlamaCppVocab(vocab))
        finally:
            vocab.close()

    def load(self, plan: Plan) -> LlamaCppModel:
        import llama_cpp

        s = plan.settings
        before = process_memory()
        started = time.perf_counter()
        with capture() as lines:
            try:
                llama = open_llama(s)
            except (ValueError, RuntimeError) as exc:
                raise BackendError(f"llama.cpp could not load {s.model_path}: {exc}",
                                   hint="run with --log-level debug to see llama.cpp's log") from None
        load_s = time.perf_counter() - started
        got = llama_cpp.llama_n_seq_max(llama.ctx)
        if got != s.n_seq_max:  # the planned buffers would be wrong
            llama.close()
            raise BackendError(f"llama.cpp runs {got} sequences where the plan asked for {s.n_seq_max}",
                               hint="this llama-cpp-python does not take the context defaults nodeagent sets; "
                                    "plan with n_seq_max 1 (a task other than classify)")
        buffers = parse_buffers(lines)
        actual = _actual_components(buffers)
        planned = plan.memory.model_dump()
        checks = [ComponentCheck(component=k, planned_bytes=planned[k], actual_bytes=v) for k, v in actual.items()]
        report = LoadReport(settings=s, planned=plan.memory,
                            buffers={"model": buffers.model, "kv": buffers.kv, "compute": buffers.compute,
                                     "output": buffers.output},
                            components=checks, load_s=load_s, memory_before=before, memory_after=process_memory())
        log.info("loaded %s in %.2fs", s.model_path, load_s)
        return LlamaCppModel(llama, report)
