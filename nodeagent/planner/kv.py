"""KV cache size, as llama.cpp's llama_kv_cache allocates it.

Cells are n_ctx rounded up to 256. Each attention layer holds K and V rows of
``head_dim * n_head_kv[layer]`` elements per cell in the cache type. With
``swa_full`` off, sliding-window layers keep only
PAD(min(n_ctx, n_swa * n_seq + n_ubatch), 256) cells.
"""

from __future__ import annotations

from nodeagent.modelfile.info import ModelInfo

KV_CELL_PAD = 256
# type -> (elements per block, bytes per block)
KV_TYPE_SIZES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q5_1": (32, 24),
                 "q5_0": (32, 22), "q4_1": (32, 20), "q4_0": (32, 18), "iq4_nl": (32, 18)}
QUANTIZED_KV = {"q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"}


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


def check_kv_type(kv_type: str, head_dim: int) -> str | None:
    """Why llama.cpp would refuse this cache type for this head size, or None."""
    block, _ = KV_TYPE_SIZES[kv_type]
    if head_dim % block:
        return f"{kv_type} needs head sizes divisible by {block}, this model has {head_dim}"
    return None
