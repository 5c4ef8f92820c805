"""A synthetic model whose decoding is bound by memory bandwidth, as a 1B model's is on a Pi or a Mac.

TinyLlama's shape (llama architecture, 22 blocks, 2048 wide, 32 heads, 4 KV heads, FFN 5632) with SmolLM2's
real tokenizer and chat template (read from the test model's header), and random quantized weights: Q8_0
(1.2 GB; llama.cpp does not repack it on x86) or Q4_0 (0.66 GB; repacked on AVX2). Its text is noise, but
under a task's grammar its outputs are valid JSON and valid labels, so tasks per second and validity can be
measured on it. ``small`` is a 4-block, 1024-wide variant for tests.

Written once into the test-model cache (``NODEAGENT_TEST_MODELS_DIR``/synthetic/), never committed; seeded, so
every machine writes the same bytes.

Usage: python benchmarks/synthetic_model.py [--quant Q8_0|Q4_0] [--small]   -> prints the file's path
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # blocks, width, heads, KV heads, FFN
    "tinyllama": (22, 2048, 32, 4, 5632),
    "small": (4, 1024, 16, 4, 2816),
}
BLOCK = 32  # values per Q8_0 and Q4_0 block
QUANTS = ("Q8_0", "Q4_0")


def _quantized(rng: np.random.Generator, n_values: int, quant: str) -> np.ndarray:
    """Random blocks of ``quant``: a small f16 scale each (activations stay finite through every layer), then the
    block's quants."""
    blocks = n_values // BLOCK
    scale = np.full((blocks, 1), 0.0008, dtype=np.float16).view(np.uint8).reshape(blocks, 2)
    if quant == "Q8_0":
        qs = rng.integers(-127, 128, size=(blocks, BLOCK), dtype=np.int8).view(np.uint8)
    else:  # Q4_0: 16 bytes of two 4-bit values each
        qs = rng.integers(0, 256, size=(blocks, BLOCK // 2), dtype=np.uint8)
    return np.concatenate([scale, qs], axis=1).reshape(-1)


def add_metadata(w, items: dict) -> None:  # noqa: ANN001
    """Header keys read from a model (a tokenizer's) written into another, each by its type."""
    for key, value in items.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)


def synthetic_model(quant: str = "Q8_0", shape: str = "tinyllama", models_dir: Path | None = None,
                    progress=lambda s: None) -> Path:  # noqa: ANN001
    """The model's path, written first if it is not there yet."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from nodeagent.config import load
    from nodeagent.modelfile.header import ArrayInfo, read_header
    from nodeagent.modelfile.source import FileSource
    from nodeagent.store.pkgindex import test_model_path

    if quant not in QUANTS:
        raise SystemExit(f"quant must be one of {', '.join(QUANTS)}")
    config = load()
    models_dir = Path(models_dir or config.test_models_dir)
    out = models_dir / "synthetic" / f"{shape}-shape-{quant.lower()}.gguf"
    if out.exists():
        return out
    n_layer, n_embd, n_head, n_kv, n_ff = SHAPES[shape]
    with FileSource(test_model_path("smollm2-135m-instruct", models_dir)) as src:
        md = read_header(src, decode_array_max=1 << 30).metadata
    qtype = getattr(GGMLQuantizationType, quant)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    w = GGUFWriter(str(tmp), "llama")
    w.add_name(f"synthetic {shape} ({quant}, random weights)")
    for key, value in (("block_count", n_layer), ("embedding_length", n_embd), ("feed_forward_length", n_ff),
                       ("context_length", 8192), ("attention.head_count", n_head),
                       ("attention.head_count_kv", n_kv), ("rope.dimension_count", n_embd // n_head)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_file_type(7 if quant == "Q8_0" else 2)
    add_metadata(w, {k: v for k, v in md.items() if k.startswith("tokenizer.") and not isinstance(v, ArrayInfo)})
    vocab = len(md["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(0)
    head_dim = n_embd // n_head

    def add(name: str, rows: int, cols: int) -> None:
        data = _quantized(rng, rows * cols, quant).reshape(rows, -1)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    add("token_embd.weight", vocab, n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    add("output.weight", vocab, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        progress(f"block {i + 1} of {n_layer}")
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add(p + "attn_q.weight", n_embd, n_embd)
        add(p + "attn_k.weight", n_kv * head_dim, n_embd)
        add(p + "attn_v.weight", n_kv * head_dim, n_embd)
        add(p + "attn_output.weight", n_embd, n_embd)
        add(p + "ffn_gate.weight", n_ff, n_embd)
        add(p + "ffn_up.weight", n_ff, n_embd)
        add(p + "ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="Q8_0", choices=QUANTS)
    ap.add_argument("--small", action="store_true", help="The 4-block test variant")
    args = ap.parse_args()
    print(synthetic_model(args.quant, "small" if args.small else "tinyllama",
                          progress=lambda s: print(s, file=sys.stderr, flush=True)))


if __name__ == "__main__":
    main()
