"""One candidate configuration -> its memory breakdown (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from nodeagent.modelfile.info import ModelInfo
from nodeagent.planner.compute import (
    F32,
    compute_bytes,
    compute_stages,
    embed_compute_bytes,
    embed_output_bytes,
    output_bytes,
)
from nodeagent.planner.kv import kv_cells, kv_layer_bytes
from nodeagent.planner.types import Budget, Memory, ctx_per_slot
from nodeagent.planner.weights import CpuKernels, place_weights

MIB = 1 << 20

# What llama-cpp-python and llama.cpp add outside the buffers llama.cpp reports:
# the vocabulary tables (token text, scores, the token-to-piece cache), the BPE
# merge ranks (a map of string pairs; SentencePiece vocabularies have none), the
# graph metadata and scheduler (sized by max(1024, 8 * n_tensors) nodes), threads
# and batch arrays. Measured by benchmarks/calibrate_runtime.py on four models
# that are not the benchmark models: benchmarks/results/runtime_calibration.json.
RUNTIME_FIXED_BYTES = 4_514_132
RUNTIME_PER_VOCAB_BYTES = 179.0
RUNTIME_PER_MERGE_BYTES = 123.6
RUNTIME_PER_GRAPH_NODE_BYTES = 1709.1
# What the task machinery adds: llguidance's tokenizer (a trie of the vocabulary), the compiled grammars and
# matchers, the validator's modules, and running tasks (the slots' decode thread with its OpenMP team, the
# task's thread, prompt rendering, their allocator arenas). Measured by benchmarks/calibrate_tasks.py on the
# same generated models: benchmarks/results/task_runtime_calibration.json.
TASK_RUNTIME_FIXED_BYTES = 12_995_534
TASK_RUNTIME_PER_VOCAB_BYTES = 447.0


def task_runtime_bytes(n_vocab: int, slots: int = 1, seqs_per_slot: int = 1) -> int:
    """The task runner's decoder state, and the logits each slot copies out of llama.cpp at once (a row per
    sequence it decodes, and the decode step's own copy)."""
    return int(TASK_RUNTIME_FIXED_BYTES + n_vocab * TASK_RUNTIME_PER_VOCAB_BYTES
               + slots * (seqs_per_slot + 1) * n_vocab * F32)


@dataclass(frozen=True)
class Candidate:
    info: ModelInfo
    n_ctx: int
    type_k: str
    type_v: str
    flash_attn: bool
    n_ubatch: int
    n_batch: int
    use_mmap: bool
    swa_full: bool
    n_gpu_layers: int  # -1: all
    n_seq: int = 1  # sequences in the unified KV cache: every slot's, and its label branches
    n_outputs: int = 1
    slots: int = 1  # parallel tasks; n_ctx holds the cells of all of them

    @property
    def ctx_per_slot(self) -> int:
        """The context each task gets (n_ctx is every slot's cells together), as Settings.ctx_per_slot."""
        return self.n_ctx if not self.info.kind.generates else ctx_per_slot(self.n_ctx, self.slots)


def work_bytes(info: ModelInfo, n_ubatch: int, n_ctx: int = 0, flash_attn: bool = True) -> int:
    """The CPU backend's work buffer (outside llama.cpp's reported buffers): the largest operand a
    matrix product converts to its dot-product type. Activations converted for the weights take about
    one byte per value plus scales; without flash attention the softmaxed scores (n_head * n_kv *
    n_ubatch, f32) are converted to f16 for the product with the V cache."""
    u = min(n_ubatch, n_ctx) if n_ctx else n_ubatch
    activations = u * max(info.embedding_length, info.feed_forward_length) * 2
    scores = 0 if flash_attn or not n_ctx else info.head_count * kv_cells(n_ctx) * u * 2
    return max(activations, scores)


def graph_nodes(info: ModelInfo) -> int:
    """llama_context::graph_max_nodes for most architectures."""
    return max(1024, 8 * info.n_tensors)


def runtime_bytes(info: ModelInfo, n_ubatch: int, n_ctx: int = 0, flash_attn: bool = True) -> int:
    """Vocabulary tables, graph metadata, threads and the runtime's batch arrays, plus the work buffer."""
    return int(RUNTIME_FIXED_BYTES + info.vocab_size * RUNTIME_PER_VOCAB_BYTES + info.merges_count * RUNTIME_PER_MERGE_BYTES
               + graph_nodes(info) * RUNTIME_PER_GRAPH_NODE_BYTES) + work_bytes(info, n_ubatch, n_ctx, flash_attn)


def estimate(c: Candidate, cpu: CpuKernels, overhead_bytes: int, metal: bool = False) -> Memory:
    info = c.info
    w = place_weights(info, c.n_gpu_layers, c.use_mmap, cpu, metal=metal)
    n_layer = info.block_count
    first_gpu = n_layer + 1 - w.gpu_layers
    encoder = not info.causal  # no KV cache: the whole input in one micro-batch, scored over itself
    kv_layers = [0] * n_layer if encoder else kv_layer_bytes(info, c.n_ctx, c.type_k, c.type_v, c.swa_full, c.n_seq,
                                                             c.n_ubatch)
    kv_gpu = sum(b for il, b in enumerate(kv_layers) if il >= first_gpu)
    kv_host = sum(kv_layers) - kv_gpu
    if encoder:
        comp = resident = embed_compute_bytes(info, c.n_ubatch, c.n_seq, c.flash_attn)
    else:
        comp = compute_bytes(info, c.n_ctx, c.n_ubatch, c.flash_attn)
        resident = compute_bytes(info, c.n_ctx, c.n_ubatch, c.flash_attn, c.n_outputs)
    u = min(c.n_ctx, c.n_ubatch)
    if w.gpu_layers == 0 or encoder:  # (an encoder's buffer is planned whole on each side it runs on)
        comp_host, comp_gpu, comp_host_resident = comp, comp if w.gpu_layers else 0, resident
    elif w.gpu_layers > n_layer:  # the output layer too: only the embedding lookup stays on the CPU
        comp_host, comp_gpu = 2 * info.embedding_length * u * F32, comp
        comp_host_resident = comp_host
    else:
        stages = compute_stages(info, c.n_ctx, c.n_ubatch, c.flash_attn)
        comp_host, comp_gpu, comp_host_resident = comp, max(stages["attention"], stages["ffn"]), resident
    runtime = runtime_bytes(info, c.n_ubatch, c.n_ctx, c.flash_attn)
    if not info.kind.generates:  # a vector per input: no logits copied out, no grammar
        out = embed_output_bytes(info, c.n_seq)
        tasks = 2 * c.n_seq * info.embedding_length * F32
    else:
        out = output_bytes(info, max(c.n_seq, c.n_outputs))
        tasks = task_runtime_bytes(info.vocab_size, c.slots, max(1, c.n_seq // c.slots))
    gpu_weights = w.gpu_bytes
    # host memory counts what the workload touches: reserved but untouched pages are not resident
    host = w.mapped_bytes - (w.gpu_bytes if metal and c.use_mmap else 0) + w.anon_bytes + kv_host \
        + comp_host_resident + out + runtime + tasks + overhead_bytes
    gpu = gpu_weights + kv_gpu + comp_gpu
    return Memory(
        weights_mapped_bytes=w.mapped_bytes - (w.gpu_bytes if metal and c.use_mmap else 0),
        weights_anon_bytes=w.anon_bytes, weights_gpu_bytes=gpu_weights,
        kv_bytes=kv_host + kv_gpu, compute_bytes=comp_host + comp_gpu,
        compute_resident_bytes=comp_host_resident + comp_gpu, output_bytes=out,
        runtime_bytes=runtime, task_runtime_bytes=tasks, overhead_bytes=overhead_bytes,
        total_bytes=host + gpu, host_bytes=host, gpu_bytes=gpu,
    )


def shortfall(mem: Memory, budget: Budget) -> tuple[int, str | None]:
    """(bytes over the budget, what is over) with the margin applied; (<=0, None) when it fits."""
    margin = budget.margin_bytes
    unified = budget.kind == "metal-working-set"
    worst = (-(1 << 62), None)
    if budget.gpu_limit_bytes is not None:
        over = mem.gpu_bytes + margin - budget.gpu_limit_bytes
        worst = max(worst, (over, "the GPU budget"), key=lambda t: t[0])
    host_need = mem.total_bytes if unified else mem.host_bytes
    over = host_need + margin - budget.host_limit_bytes
    worst = max(worst, (over, "available RAM"), key=lambda t: t[0])
    return worst if worst[0] > 0 else (worst[0], None)
