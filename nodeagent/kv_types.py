"""The one vocabulary of KV cache types: names, ggml's block sizes and type ids.

Everything that names a KV type (the planner, device profiles, the CLI's choices,
the llama.cpp and MLX backends) takes it from here.
"""

from __future__ import annotations

from typing import Literal, get_args

KvType = Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"]
KV_TYPES: tuple[str, ...] = get_args(KvType)

# type -> (elements per block, bytes per block), as ggml stores a row
KV_TYPE_SIZES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q5_1": (32, 24), "q5_0": (32, 22),
    "q4_1": (32, 20), "q4_0": (32, 18), "iq4_nl": (32, 18)}
QUANTIZED_KV = frozenset(t for t, (block, _) in KV_TYPE_SIZES.items() if block > 1)
# llama.cpp's ggml_type ids
GGML_TYPE_IDS: dict[str, int] = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
                                 "iq4_nl": 20, "bf16": 30}
# mlx-lm's cache: f16 (the model's float type), or quantized to 8 or 4 bits
MLX_KV_BITS: dict[str, int | None] = {"f16": None, "q8_0": 8, "q4_0": 4}

assert set(KV_TYPE_SIZES) == set(KV_TYPES) == set(GGML_TYPE_IDS) and set(MLX_KV_BITS) <= set(KV_TYPES)
