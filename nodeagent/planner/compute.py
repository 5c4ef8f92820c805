"""The compute buffer: llama.cpp reserves the worst-case graph for min(n_ctx, n_ubatch) tokens.

There is no closed form: ggml's allocator reuses freed tensors, so the buffer
is the high-water mark of the largest stage. Three stages dominate:

- output: the logits of every token of the micro-batch (n_vocab * n_ubatch * 4)
  plus the last hidden state and its norm (2 * n_embd * n_ubatch * 4);
- attention without flash attention: the scores (n_head * n_kv * n_ubatch * 4,
  softmax in place) plus the mask (n_kv * n_ubatch * 4) plus the layer's
  earlier activations that sit below them (the residual, the norm, Q/K/V
  before and after RoPE);
- attention with flash attention: no scores; the mask in f32 and f16;
- the FFN: everything it allocates, since the freed tensors stay below the
  high-water mark: the input sum, the norm, the down projection and the
  residual (n_embd each) and gate, up and their product (n_ff each).
"""

from __future__ import annotations

from nodeagent.modelfile.info import ModelInfo
from nodeagent.planner.kv import kv_cells, pad

F32 = 4
KQ_MASK_PAD = 64


def compute_stages(info: ModelInfo, n_ctx: int, n_ubatch: int, flash_attn: bool,
                   n_outputs: int | None = None) -> dict[str, int]:
    """Bytes of each stage. ``n_outputs``: logits rows per micro-batch (llama.cpp reserves n_ubatch)."""
    u = min(n_ctx, n_ubatch)
    rows = u if n_outputs is None else min(u, n_outputs)
    n_kv = kv_cells(n_ctx)
    n_embd = info.embedding_length
    n_q = info.head_count * info.key_length
    n_kvd = info.n_head_kv_max * info.key_length
    before_attn = u * F32 * (3 * n_embd + 2 * n_q + 4 * n_kvd)
    mask = n_kv * pad(u, KQ_MASK_PAD) * F32
    stages = {
        "output": info.vocab_size * rows * F32 + 2 * n_embd * u * F32,
        "ffn": u * F32 * (4 * n_embd + 3 * info.feed_forward_length),
    }
    if flash_attn:
        stages["attention"] = before_attn + mask + mask // 2
    else:
        stages["attention"] = before_attn + mask + info.head_count * n_kv * u * F32
    return stages


def compute_bytes(info: ModelInfo, n_ctx: int, n_ubatch: int, flash_attn: bool, n_outputs: int | None = None) -> int:
    """The compute buffer llama.cpp reserves (n_outputs None), or the part a workload that asks for
    ``n_outputs`` logits rows per micro-batch really touches (resident memory)."""
    return max(compute_stages(info, n_ctx, n_ubatch, flash_attn, n_outputs).values())


def output_bytes(info: ModelInfo, n_outputs: int = 1) -> int:
    """llama.cpp's output buffer: logits for max(n_seq, outputs asked for) rows; it starts at n_seq
    and grows when a batch asks for more outputs."""
    return info.vocab_size * n_outputs * F32


def embed_compute_bytes(info: ModelInfo, n_ubatch: int, n_seq: int, flash_attn: bool) -> int:
    """An encoder's compute buffer (attention not causal, no KV cache: the scores are over the micro-batch
    itself). Measured on all-MiniLM-L6-v2 (BERT, 6 blocks of 384) at micro-batches of 64 to 512 with and
    without flash attention, exactly to 0.02 MiB (tests/test_embeddings.py checks it against llama.cpp's
    report): without flash attention the scores (n_head * u^2 f32) and their mask (u^2 f32); with it, the mask
    in f16 alone; six (seven with flash attention) rows of n_embd per token beside them; and the pooling matrix
    (u * n_seq f32). Other encoders are planned by the same shape."""
    u, embd = n_ubatch, info.embedding_length
    pooling = u * n_seq * F32
    if flash_attn:
        return pooling + u * u * 2 + 7 * embd * u * F32
    return pooling + (info.head_count + 1) * u * u * F32 + 6 * embd * u * F32


def embed_output_bytes(info: ModelInfo, n_seq: int) -> int:
    """llama.cpp's output buffer in embedding mode: a row of logits and one of embeddings per sequence."""
    return (info.vocab_size + info.embedding_length) * n_seq * F32
