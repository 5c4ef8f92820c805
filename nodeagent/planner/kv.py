"""KV cache size, as llama.cpp's llama_kv_cache allocates it.

Cells are n_ctx rounded up to 256. Each attention layer holds K and V rows of
``head_dim * n_head_kv[layer]`` elements per cell in the cache type. With
``swa_full`` off, sliding-window layers keep only
PAD(min(n_ctx, n_swa * n_seq + n_ubatch), 256) cells.
"""

from __future__ import annotations

from nodeagent.kv_types import KV_TYPE_SIZES, QUANTIZED_KV  # noqa: F401  (re-exported for the search)
from nodeagent.modelfile.info import ModelInfo

KV_CELL_PAD = 256


def pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def kv_row_bytes(kv_type: str, n_elements: int) -> int:
    block, size = KV_TYPE_SIZES[kv_type]
    return n_elements // block * size


def kv_cells(n_ctx: int) -> int:
    return pad(n_ctx, KV_CELL_PAD)


def swa_cells(info: ModelInfo, n_ctx: int, n_seq: int, n_ubatch: int) -> int:
    assert info.sliding_window
    return pad(min(n_ctx, info.sliding_window * n_seq + n_ubatch), KV_CELL_PAD)


def kv_layer_bytes(info: ModelInfo, n_ctx: int, type_k: str, type_v: str, swa_full: bool = True,
                   n_seq: int = 1, n_ubatch: int = 512) -> list[int]:
    """Bytes of K plus V for each layer."""
    full = kv_cells(n_ctx)
    out = []
    for layer, n_kv_head in enumerate(info.head_count_kv):
        if n_kv_head == 0:  # layers without attention (recurrent or FFN-only) keep no KV
            out.append(0)
            continue
        swa = info.swa_layers is not None and info.swa_layers[layer]
        cells = full if (not swa or swa_full) else swa_cells(info, n_ctx, n_seq, n_ubatch)
        k = kv_row_bytes(type_k, info.key_length * n_kv_head)
        v = kv_row_bytes(type_v, info.value_length * n_kv_head)
        out.append((k + v) * cells)
    return out


def kv_bytes_per_token(info: ModelInfo, type_k: str, type_v: str) -> int:
    """K plus V of one token in every attention layer: what a prompt prefix's state holds per token (a prefix
    within the sliding window keeps every one in a sliding-window layer too)."""
    return sum(kv_row_bytes(type_k, info.key_length * n) + kv_row_bytes(type_v, info.value_length * n)
               for n in info.head_count_kv if n)


def check_kv_type(kv_type: str, head_dim: int) -> str | None:
    """Why llama.cpp would refuse this cache type for this head size, or None."""
    block, _ = KV_TYPE_SIZES[kv_type]
    if head_dim % block:
        return f"{kv_type} needs head sizes divisible by {block}, this model has {head_dim}"
    return None
