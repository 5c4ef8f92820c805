"""MLX (mlx-lm) on Apple Silicon; also runs on Linux CPUs with ``mlx[cpu]``, which is how it is tested.

The model is an mlx-lm directory (config.json, *.safetensors, tokenizer files).
Tasks run through the same TaskRunner as llama.cpp: this module provides the
TokenSession (a KV cache that can be trimmed, so prompt prefixes are reused
and label scoring can backtrack; recurring prefixes kept on disk as mlx-lm's
prompt-cache files) and llguidance's tokenizer for constrained decoding. mlx and
mlx-lm are imported lazily: ``nodeagent --help`` never loads them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from nodeagent.backends.base import ModelHandle, importable
from nodeagent.backends.prefix_store import Opener, PrefixStore, WarmPrefixes
from nodeagent.backends.session import eval_each
from nodeagent.errors import BackendError
from nodeagent.kv_types import MLX_KV_BITS
from nodeagent.modelfile.mlx import read_model_info
from nodeagent.planner.types import Plan


class MlxSession(WarmPrefixes):
    """The model's one slot: an mlx-lm prompt cache that can be trimmed (a prompt's prefix kept, label scoring
    backtracking), its recurring prefixes kept on disk as mlx-lm's prompt-cache files (``WarmPrefixes``)."""

    def __init__(self, model: Any, tokenizer: Any, ctx_per_slot: int, kv_type: str = "f16", n_batch: int = 512,
                 kv_group: int = 64, prefixes: Callable[[], PrefixStore | None] = lambda: None) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self._mx = mx
        self.model, self.tokenizer = model, tokenizer
        self.ctx_per_slot, self.n_batch = ctx_per_slot, n_batch  # one slot: all of the context
        self._bits = MLX_KV_BITS[kv_type]
        self._group = kv_group
        self.cache = make_prompt_cache(model)
        hf = tokenizer._tokenizer
        self.n_vocab = int(model.args.vocab_size) if hasattr(model, "args") else len(hf)
        self.chat_template = getattr(hf, "chat_template", None) or None
        self.bos_text = hf.bos_token or ""
        self.eos_text = hf.eos_token or ""
        self.eog_tokens = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self._bos_id = hf.bos_token_id
        self._tokens: list[int] = []
        self._ll = None
        self._prefixes = prefixes

    def tokenize(self, text: str) -> list[int]:
        tokens = list(self.tokenizer.encode(text, add_special_tokens=False))
        if self._bos_id is not None and getattr(self.tokenizer._tokenizer, "add_bos_token", False) \
                and (not tokens or tokens[0] != self._bos_id):
            tokens = [self._bos_id] + tokens
        return tokens

    def tokenize_continuation(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def has_token(self, text: str) -> bool:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) == 1

    def detokenize(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def token_bytes(self, token: int) -> bytes:
        return self.detokenize([token]).encode("utf-8", "replace")

    def eval_all(self, tokens: list[int]) -> list[Any]:
        return eval_each(self, tokens)

    def reset(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)
        self._tokens = []

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    def eval_tree(self, parents: list[int], tokens: list[int]) -> list[np.ndarray]:
        from nodeagent.backends.session import eval_tree_sequential

        return eval_tree_sequential(self, parents, tokens)

    def truncate(self, n_tokens: int) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        extra = len(self._tokens) - n_tokens
        if extra > 0:
            trim_prompt_cache(self.cache, extra)
            del self._tokens[n_tokens:]

    def state(self, tokens: list[int]) -> bytes | None:
        """The prompt cache as mlx-lm's prompt-cache file (``save_prompt_cache``: safetensors), while it holds
        exactly ``tokens``; None when it holds other tokens."""
        from mlx_lm.models.cache import save_prompt_cache

        if self._tokens != tokens:
            return None
        with tempfile.TemporaryDirectory(prefix="nodeagent-mlx-") as tmp:
            path = os.path.join(tmp, "prefix.safetensors")
            save_prompt_cache(path, self.cache)
            with open(path, "rb") as fh:
                return fh.read()

    def _load_state(self, data: bytes, n_tokens: int, tokens: list[int]) -> bool:
        """A prompt-cache file read back (``load_prompt_cache``) as the cache, trimmed to ``n_tokens``; False where
        mlx-lm cannot read it or it holds fewer tokens."""
        from mlx_lm.models.cache import load_prompt_cache, trim_prompt_cache

        with tempfile.TemporaryDirectory(prefix="nodeagent-mlx-") as tmp:
            path = os.path.join(tmp, "prefix.safetensors")
            with open(path, "wb") as fh:
                fh.write(data)
            try:
                cache = load_prompt_cache(path)
            except Exception:  # noqa: BLE001  (mlx raises several types for a file it cannot read)
                return False
        held = {c.offset for c in cache if hasattr(c, "offset")}
        if len(cache) != len(self.cache) or len(held) != 1 or next(iter(held)) < n_tokens:
            return False
        trim_prompt_cache(cache, next(iter(held)) - n_tokens)
        self.cache, self._tokens = cache, list(tokens[:n_tokens])
        return True

    def eval(self, tokens: list[int]) -> np.ndarray:
        mx = self._mx
        logits = None
        for i in range(0, len(tokens), self.n_batch):  # prefill in chunks: logits are n_batch x vocab
            chunk = tokens[i : i + self.n_batch]
            logits = self.model(mx.array(chunk)[None], cache=self.cache)
            if self._bits is not None:
                self._quantize_cache()
            mx.eval([c.state for c in self.cache])
            self._tokens.extend(chunk)
        assert logits is not None
        last = logits[0, -1].astype(mx.float32)
        mx.eval(last)
        return np.array(last)

    def _quantize_cache(self) -> None:
        from mlx_lm.models.cache import KVCache

        for i, c in enumerate(self.cache):
            if isinstance(c, KVCache) and c.offset > 0:
                self.cache[i] = c.to_quantized(group_size=self._group, bits=self._bits)

    def lltokenizer(self) -> Any:
        if self._ll is None:
            from llguidance.hf import from_tokenizer

            self._ll = from_tokenizer(self.tokenizer._tokenizer, eos_token=sorted(self.eog_tokens) or None)
        return self._ll


class MlxModel(ModelHandle):
    name = "mlx"

    def __init__(self, model: Any, tokenizer: Any, ctx_per_slot: int, kv_type: str, n_batch: int,
                 kv_group: int, path: str = "") -> None:
        self.model, self.tokenizer, self.path, self.kv_type = model, tokenizer, path, kv_type
        self._prefixes = Opener()
        self._session = MlxSession(model, tokenizer, ctx_per_slot, kv_type, n_batch, kv_group,
                                   prefixes=self.prefix_store)

    def keep_prefixes(self, directory: Path, max_bytes: int, cache_dir: Path, tally: Any = None) -> None:
        """Keep recurring prompt prefixes on disk as mlx-lm's prompt-cache files (``prefix_store``), keyed by the
        sha256 of the model directory's weights and config, mlx-lm's and mlx's versions, and the KV type."""
        if max_bytes <= 0 or not self.path:
            return
        import mlx.core as mx
        import mlx_lm

        from nodeagent.backends.prefix_store import StateKey, files_sha256

        def key() -> StateKey:
            cache_dir.mkdir(parents=True, exist_ok=True)
            files = [p for p in Path(self.path).iterdir() if p.suffix == ".safetensors" or p.name == "config.json"]
            return StateKey(files_sha256(files, cache_dir), f"mlx-lm {mlx_lm.__version__} (mlx {mx.__version__})",
                            f"{self.kv_type}/{self.kv_type}")

        self._prefixes.open(directory, max_bytes, key, tally)

    def prefix_store(self) -> PrefixStore | None:
        return self._prefixes.store

    def session(self) -> MlxSession:
        if self.model is None:
            raise BackendError("the model is closed")
        return self._session

    def generate(self, prompt: str, max_tokens: int = 64, **kwargs: Any) -> str:
        from mlx_lm import generate

        return generate(self.model, self.tokenizer, prompt, max_tokens=max_tokens, **kwargs)

    def close(self) -> None:
        self._prefixes.close()
        self.model = None
        self._session = None  # type: ignore[assignment]


class MlxBackend:
    name = "mlx"

    def available(self) -> bool:
        return importable("mlx.core", "mlx_lm")

    def prompt_tokens(self, model_path: str, count: Callable[[Any], int]) -> int | None:
        return None  # it cannot tell without loading the model

    def load(self, plan: Plan) -> MlxModel:
        s = plan.settings
        path, ctx, kv_type, n_batch = s.model_path, s.ctx_per_slot, s.type_k, s.n_batch
        if not self.available():
            raise BackendError("MLX is not installed", hint="pip install 'nodeagent[mlx]' (Apple Silicon) or "
                                                            "'mlx[cpu]' mlx-lm (Linux)")
        if kv_type not in MLX_KV_BITS or s.type_v != kv_type:
            raise BackendError(f"MLX's KV cache takes f16, q8_0 (8 bits) or q4_0 (4 bits) for K and V alike, not "
                               f"{kv_type}/{s.type_v}")
        from mlx_lm import load

        info = read_model_info(path)  # a clear error for a directory that is not a model
        group = info.kv_group_size
        if MLX_KV_BITS[kv_type] is not None and group is None:
            raise BackendError(f"a {kv_type} KV cache needs a head size divisible by 32; this model's is "
                               f"{info.head_dim}", hint="use an f16 KV cache")
        try:
            model, tokenizer = load(path)
        except Exception as exc:  # mlx-lm raises many types for a broken model directory
            raise BackendError(f"mlx-lm could not load {path}: {exc}") from None
        return MlxModel(model, tokenizer, ctx, kv_type, n_batch, group or 64, path=str(path))
