"""``MlxModelInfo``: what the planner needs from an mlx-lm model directory, read without loading it.

The directory is untrusted input like a GGUF file: ``config.json`` fields are
type-checked, and each safetensors header is read only after its stated length
is checked against the file's size (and a fixed cap), so a hostile file cannot
make the reader allocate more than the file justifies.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from nodeagent.errors import ModelFileError, NotFoundError
from nodeagent.values import Frozen

DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1, "I8": 1, "F64": 8, "I64": 8}
# safetensors' own reference implementation refuses headers over 100 MB
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
MAX_CONFIG_BYTES = 1 << 20


class MlxModelInfo(Frozen):
    """What the planner needs from an mlx-lm directory."""

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

    @property
    def kv_group_size(self) -> int | None:
        """The group mlx-lm quantizes a KV cache in (64, else 32); None: this head size cannot be quantized."""
        return next((g for g in (64, 32) if self.head_dim % g == 0), None)


def is_mlx_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def _config(d: Path) -> dict[str, Any]:
    f = d / "config.json"
    try:
        if f.stat().st_size > MAX_CONFIG_BYTES:
            raise ModelFileError(f"{f} is larger than {MAX_CONFIG_BYTES} bytes: not a model config")
        cfg = json.loads(f.read_bytes())
    except FileNotFoundError:
        raise NotFoundError(f"{d} is not an mlx-lm model directory (no config.json)",
                            hint="pass a directory with config.json and *.safetensors") from None
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{f} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ModelFileError(f"{f} is not a JSON object")
    return cfg


def _int(cfg: dict[str, Any], key: str, where: Path, default: int | None = None, low: int = 1,
         high: int = 1 << 40) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ModelFileError(f"{where}: {key} is missing", hint="an mlx-lm config.json names the model's shape")
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ModelFileError(f"{where}: {key} is {value!r}, not an integer in [{low}, {high}]")
    return value


def _safetensors_header(f: Path) -> tuple[dict[str, Any], int]:
    """The header, and how many data bytes follow it."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelFileError(f"{f} is truncated: no safetensors header length")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, MAX_SAFETENSORS_HEADER_BYTES):
            raise ModelFileError(f"{f}: the safetensors header claims {n} bytes, but the file has {size - 8} after "
                                 "the length" if n > size - 8 else f"{f}: a {n}-byte safetensors header is over "
                                 f"the {MAX_SAFETENSORS_HEADER_BYTES}-byte limit")
        try:
            header = json.loads(fh.read(n))
        except ValueError as exc:
            raise ModelFileError(f"{f}: the safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{f}: the safetensors header is not a JSON object")
    return header, size - 8 - n


def _tensor_extent(name: str, t: Any, f: Path, data_bytes: int) -> tuple[int, str | None]:
    offsets = t.get("data_offsets") if isinstance(t, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise ModelFileError(f"{f}: tensor {name!r} has bad data_offsets {offsets!r}")
    dtype = t.get("dtype")
    return offsets[1] - offsets[0], dtype if isinstance(dtype, str) else None


# Hugging Face's model_type of the encoders sentence-embedding models are made of: mlx-lm generates, and loads none
ENCODER_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "nomic_bert", "modernbert",
                                 "jina_bert", "new", "eurobert", "neobert"})


def read_model_info(path: str | Path) -> MlxModelInfo:
    d = Path(path)
    cfg = _config(d)
    where = d / "config.json"
    if cfg.get("model_type") in ENCODER_MODEL_TYPES:
        from nodeagent.errors import UsageError

        raise UsageError(f"{d.name} is an embedding model ({cfg['model_type']}): the MLX backend runs generators "
                         "only", hint="serve the model's GGUF, whose embeddings llama.cpp computes (Metal on a Mac)")
    total = 0
    dtype = None
    files = sorted(d.glob("*.safetensors"))
    for f in files:
        header, data_bytes = _safetensors_header(f)
        for name, t in header.items():
            if name == "__metadata__":
                continue
            n, kind = _tensor_extent(name, t, f, data_bytes)
            total += n
            if dtype is None and name.endswith("norm.weight"):
                dtype = kind
    if total == 0:
        raise NotFoundError(f"{d} has no safetensors weights")
    heads = _int(cfg, "num_attention_heads", where)
    hidden = _int(cfg, "hidden_size", where)
    head_dim = cfg.get("head_dim") or hidden // heads
    quant = cfg.get("quantization")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    model_type = cfg.get("model_type", "?")
    return MlxModelInfo(path=str(d), model_type=model_type if isinstance(model_type, str) else "?",
                        n_layers=_int(cfg, "num_hidden_layers", where, high=1 << 16), hidden_size=hidden,
                        intermediate_size=_int(cfg, "intermediate_size", where, default=0, low=0),
                        n_heads=heads, n_kv_heads=_int(cfg, "num_key_value_heads", where, default=heads),
                        head_dim=_int({"head_dim": head_dim}, "head_dim", where),
                        vocab_size=_int(cfg, "vocab_size", where, high=1 << 24), weights_bytes=total,
                        dtype_bytes=DTYPE_BYTES.get(dtype or "F16", 2),
                        quantization_bits=bits if isinstance(bits, int) and not isinstance(bits, bool) else None)


def is_mlx_spec(spec: str) -> bool:
    """Whether a model spec names an mlx-lm directory (the backend registry's ``claims`` for MLX)."""
    return is_mlx_dir(Path(spec).expanduser())


def read_for_plan(spec: str, config: Any = None, quant: str | None = None) -> tuple["MlxModelInfo", list[str]]:
    """What the planner needs of an mlx-lm directory (the backend registry's ``read`` for MLX)."""
    return read_model_info(spec), []
