"""Where each weight tensor lives, and how much memory that costs.

- The last ``n_gpu_layers`` blocks go to the GPU; the output layer only when
  n_gpu_layers > n_layer; the token embedding always stays on the CPU.
- With mmap, every CPU weight is file-backed (page cache); without it they are
  anonymous copies.
- llama.cpp's CPU backend *repacks* matrix weights it has fast kernels for
  into extra buffers, which are anonymous even with mmap on:
  ``AMX`` on x86 with AMX (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, F16, in
  a VNNI layout that is larger for Q8_0, Q4_K, Q5_K and IQ4_XS), then
  ``CPU_REPACK`` (same size as the tensor) by type and SIMD features
  (ggml-cpu/repack.cpp ggml_repack_get_optimal_repack_type). A tied output
  layer is a second copy of the embedding, so it is repacked too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nodeagent.modelfile.info import ModelInfo, TensorSpec

_BLOCK = re.compile(r"^blk\.(\d+)\.")
_NOT_MATMUL = ("norm", "bias", "rope_freqs", "pos_embd", "token_types", "scale", "conv1d", "ssm_a", "ssm_d")
TENSOR_ALIGNMENT = 64
QK_K = 256

# AMX (ggml-cpu/amx): type -> (block elements, block bytes, extra bytes per block, K alignment)
AMX_TYPES = {"Q4_0": (32, 18, 0, 32), "Q4_1": (32, 20, 0, 32), "Q8_0": (32, 34, 4, 32),
             "Q4_K": (256, 144, 4, QK_K), "Q5_K": (256, 176, 4, QK_K), "Q6_K": (256, 210, 0, QK_K),
             "IQ4_XS": (256, 136, 2, QK_K), "F16": (1, 2, 0, 16)}
AMX_TILE_N2 = 32


@dataclass(frozen=True)
class CpuKernels:
    """The SIMD features llama.cpp's CPU backend chooses weight layouts by."""

    amx: bool = False
    avx2: bool = False
    avx512: bool = False
    neon: bool = False
    dotprod: bool = False
    i8mm: bool = False
    sve: bool = False

    @classmethod
    def from_features(cls, features: list[str]) -> "CpuKernels":
        f = set(features)
        return cls(**{name: name in f for name in ("amx", "avx2", "avx512", "neon", "dotprod", "i8mm", "sve")})


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def is_matmul_weight(t: TensorSpec) -> bool:
    if t.name == "token_embd.weight" or not t.name.endswith(".weight") or len(t.shape) < 2:
        return False
    return not any(word in t.name for word in _NOT_MATMUL)


def amx_bytes(t: TensorSpec) -> int | None:
    """Size in the AMX buffer, or None when AMX does not take the tensor."""
    spec = AMX_TYPES.get(t.type)
    if spec is None or len(t.shape) != 2:
        return None
    block, size, extra, k_align = spec
    k, n = t.shape
    if n % AMX_TILE_N2 or k % k_align:
        return None
    return _pad(n * (k // block) * (size + extra), TENSOR_ALIGNMENT)


def repack_bytes(t: TensorSpec, cpu: CpuKernels) -> int | None:
    """Size in the CPU_REPACK buffer, or None when no repacked kernel applies."""
    rows = t.shape[1]
    rule: int | None = None  # the row multiple the chosen layout needs
    neon = cpu.neon
    if t.type == "Q4_0":
        if cpu.avx2 or (cpu.sve and cpu.i8mm):
            rule = 8
        elif neon and (cpu.i8mm or cpu.dotprod):
            rule = 4
    elif t.type == "Q4_K":
        if cpu.avx2 or (neon and (cpu.i8mm or cpu.dotprod)):
            rule = 8
    elif t.type == "Q2_K":
        rule = 8 if cpu.avx512 else None
    elif t.type in ("Q5_K", "Q6_K"):
        rule = 8 if neon and (cpu.i8mm or cpu.dotprod) else None
    elif t.type == "IQ4_NL" or t.type == "MXFP4":
        rule = 8 if cpu.avx2 else (4 if neon and cpu.dotprod else None)
    elif t.type == "Q8_0":
        rule = 4 if neon and (cpu.i8mm or cpu.dotprod) else None
    if rule is None or rows % rule:
        return None
    return _pad(t.n_bytes, TENSOR_ALIGNMENT)


@dataclass(frozen=True)
class WeightPlacement:
    mapped_bytes: int  # file-backed host pages (mmap on)
    anon_bytes: int  # anonymous host copies: repacked, or everything on the CPU with mmap off
    gpu_bytes: int
    repacked: dict[str, int]  # buffer name -> bytes
    cpu_tensor_bytes: int
    gpu_layers: int


def _layer_of(name: str) -> int | None:
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def place_weights(info: ModelInfo, n_gpu_layers: int, use_mmap: bool, cpu: CpuKernels,
                  metal: bool = False) -> WeightPlacement:
    n_layer = info.block_count
    gpu_layers = n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)
    first_gpu = n_layer + 1 - gpu_layers  # layer index n_layer stands for the output layer
    mapped = anon = gpu = cpu_bytes = 0
    repacked: dict[str, int] = {}
    for t in info.tensors:
        layer = _layer_of(t.name)
        if t.name == "token_embd.weight":
            idx = -1  # always on the CPU
        elif layer is not None:
            idx = layer
        else:
            idx = n_layer  # output, output_norm and other tensors after the blocks
        on_gpu = idx >= first_gpu and idx >= 0
        if on_gpu:
            gpu += t.n_bytes
            if metal and use_mmap:
                mapped += t.n_bytes  # Metal wraps the mapped file: the pages are the file's
            continue
        cpu_bytes += t.n_bytes
        if use_mmap:
            mapped += t.n_bytes
        extra = _repack(t, cpu) if is_matmul_weight(t) else None
        if extra:
            buf, size = extra
            repacked[buf] = repacked.get(buf, 0) + size
            anon += size
        elif not use_mmap:
            anon += t.n_bytes
    # a tied output layer: llama.cpp duplicates the embedding as the output matrix
    if info.tied_embeddings:
        embd = next((t for t in info.tensors if t.name == "token_embd.weight"), None)
        if embd is not None and first_gpu > n_layer:
            extra = _repack(embd, cpu)
            if extra:
                repacked[extra[0]] = repacked.get(extra[0], 0) + extra[1]
                anon += extra[1]
        elif embd is not None:
            gpu += embd.n_bytes
    return WeightPlacement(mapped, anon, gpu, repacked, cpu_bytes, gpu_layers)


def _repack(t: TensorSpec, cpu: CpuKernels) -> tuple[str, int] | None:
    if cpu.amx:
        size = amx_bytes(t)
        if size is not None:
            return "AMX", size
    size = repack_bytes(t, cpu)
    return ("CPU_REPACK", size) if size is not None else None
