"""MLX (mlx-lm) on Apple Silicon; also runs on Linux CPUs with ``mlx[cpu]``, which is how it is tested.

The model is an mlx-lm directory (config.json, *.safetensors, tokenizer files).
Tasks run through the same TaskRunner as llama.cpp: this module provides the
TokenSession (a KV cache that can be trimmed, so prompt prefixes are reused
and label scoring can backtrack) and llguidance's tokenizer for constrained
decoding. mlx and mlx-lm are imported lazily: ``nodeagent --help`` never loads them.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from nodeagent.backends.base import Capabilities, ModelHandle, importable
from nodeagent.errors import BackendError, NotFoundError

KV_BITS = {"f16": None, "q8_0": 8, "q4_0": 4}  # the plan's KV type names -> mlx-lm's kv_bits
KV_GROUP = 64  # mlx-lm quantizes the cache in groups (64, else 32) with an f16 scale and bias each


def kv_group(head_dim: int) -> int | None:
    return next((g for g in (64, 32) if head_dim % g == 0), None)
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1, "I8": 1, "F64": 8, "I64": 8}


class MlxModelInfo(BaseModel):
    """What the planner needs from an mlx-lm directory, read without loading it."""

    model_config = ConfigDict(frozen=True)

    path: str
    model_type: str
    n_layers: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    weights_bytes: int
    dtype_bytes: int = 2  # the model's float type (norm weights): the KV cache and activations use it
    quantization_bits: int | None = None


def read_model_info(path: str | Path) -> MlxModelInfo:
    d = Path(path)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise NotFoundError(f"{d} is not an mlx-lm model directory (config.json: {exc})",
                            hint="pass a directory with config.json and *.safetensors") from None
    total = 0
    dtype = None
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:  # a safetensors file starts with an 8-byte length and a JSON header
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                start, end = t["data_offsets"]
                total += end - start
                if dtype is None and name.endswith("norm.weight"):
                    dtype = t["dtype"]
    if total == 0:
        raise NotFoundError(f"{d} has no safetensors weights")
    heads = cfg["num_attention_heads"]
    return MlxModelInfo(path=str(d), model_type=cfg.get("model_type", "?"), n_layers=cfg["num_hidden_layers"],
                        hidden_size=cfg["hidden_size"], intermediate_size=cfg.get("intermediate_size", 0),
                        n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads", heads),
                        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab_size=cfg["vocab_size"],
                        weights_bytes=total, dtype_bytes=DTYPE_BYTES.get(dtype or "F16", 2),
                        quantization_bits=(cfg.get("quantization") or {}).get("bits"))


def kv_bytes(info: MlxModelInfo, n_ctx: int, kv_type: str) -> int:
    """K and V for n_ctx tokens in the model's float type; a quantized cache packs bits per value and
    keeps a scale and a bias (in the model's float type) per group."""
    values = 2 * info.n_layers * info.n_kv_heads * info.head_dim * n_ctx
    bits = KV_BITS[kv_type]
    if bits is None:
        return values * info.dtype_bytes
    return values * bits // 8 + values // (kv_group(info.head_dim) or KV_GROUP) * 2 * info.dtype_bytes


def activation_bytes(info: MlxModelInfo, n_batch: int) -> int:
    """One prefill chunk: its logits (n_batch x vocab, f32) and the FFN and attention activations."""
    return n_batch * info.vocab_size * 4 + n_batch * (4 * info.hidden_size + 3 * info.intermediate_size) \
        * info.dtype_bytes


class MlxSession:
    def __init__(self, model: Any, tokenizer: Any, n_ctx: int, kv_type: str = "f16", n_batch: int = 512) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self._mx = mx
        self.model, self.tokenizer = model, tokenizer
        self.n_ctx, self.n_batch = n_ctx, n_batch
        self._bits = KV_BITS[kv_type]
        self._group = KV_GROUP
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

    def reset(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)
        self._tokens = []

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    def eval_tree(self, parents: list[int], tokens: list[int]) -> list[np.ndarray]:
        from nodeagent.tasks.session import eval_tree_sequential

        return eval_tree_sequential(self, parents, tokens)

    def truncate(self, n_tokens: int) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        extra = len(self._tokens) - n_tokens
        if extra > 0:
            trim_prompt_cache(self.cache, extra)
            del self._tokens[n_tokens:]

    def prefill(self, tokens: list[int]) -> np.ndarray:
        from nodeagent.tasks.session import common_prefix

        keep = min(common_prefix(self._tokens, tokens), len(tokens) - 1)
        self.truncate(keep)
        return self.eval(tokens[keep:])

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
    def __init__(self, model: Any, tokenizer: Any, n_ctx: int, kv_type: str, n_batch: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        self._session = MlxSession(model, tokenizer, n_ctx, kv_type, n_batch)

    def session(self) -> MlxSession:
        if self.model is None:
            raise BackendError("the model is closed")
        return self._session

    def generate(self, prompt: str, max_tokens: int = 64, **kwargs: Any) -> str:
        from mlx_lm import generate

        return generate(self.model, self.tokenizer, prompt, max_tokens=max_tokens, **kwargs)

    def close(self) -> None:
        self.model = None
        self._session = None  # type: ignore[assignment]


class MlxBackend:
    name = "mlx"

    def available(self) -> bool:
        return importable("mlx.core", "mlx_lm")

    def capabilities(self) -> Capabilities:
        return Capabilities(constrained_json=True, kv_types=list(KV_BITS), gpu_offload=True, label_scoring=True,
                            mmap=False)

    def load(self, path: str, n_ctx: int, kv_type: str = "f16", n_batch: int = 512) -> MlxModel:
        if not self.available():
            raise BackendError("MLX is not installed", hint="pip install 'nodeagent[mlx]' (Apple Silicon) or "
                                                            "'mlx[cpu]' mlx-lm (Linux)")
        if kv_type not in KV_BITS:
            raise BackendError(f"MLX's KV cache takes f16, q8_0 (8 bits) or q4_0 (4 bits), not {kv_type}")
        from mlx_lm import load

        info = read_model_info(path)  # a clear error for a directory that is not a model
        group = kv_group(info.head_dim)
        if KV_BITS[kv_type] is not None and group is None:
            raise BackendError(f"a {kv_type} KV cache needs a head size divisible by 32; this model's is "
                               f"{info.head_dim}", hint="use an f16 KV cache")
        try:
            model, tokenizer = load(path)
        except Exception as exc:  # mlx-lm raises many types for a broken model directory
            raise BackendError(f"mlx-lm could not load {path}: {exc}") from None
        loaded = MlxModel(model, tokenizer, n_ctx, kv_type, n_batch)
        loaded._session._group = group or KV_GROUP
        return loaded
