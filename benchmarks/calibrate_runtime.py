"""Measure what a llama.cpp load adds outside llama.cpp's own buffers (the planner's runtime term).

Four tiny models that are not the benchmark models: a generated 259-token
vocabulary, the real 152,064-token qwen2 tokenizer of the 7B header fixture,
the same tokenizer with a quarter of its BPE merges (llama.cpp keeps the
merge ranks in a map of string pairs; SentencePiece vocabularies have none,
so a rate per vocabulary token alone charges them for merges they lack),
and the small vocabulary again with 48 layers (llama.cpp sizes its graph
metadata by the number of tensors). Each is loaded in a fresh process and fills its context in full batches; the resident
memory that adds beyond what the planner models itself (the buffers llama.cpp
reports, the resident compute and the work buffer) is the runtime cost. The fixed
part, the part per vocabulary token and the part per graph node follow from
the four points.

Usage: python benchmarks/calibrate_runtime.py -> benchmarks/results/runtime_calibration.json
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import write_results  # noqa: E402
from benchmarks.synthetic_model import add_metadata  # noqa: E402
from nodeagent.modelfile.header import ArrayInfo, read_header  # noqa: E402
from nodeagent.modelfile.source import BytesSource  # noqa: E402

MEASURE = r"""
import json, sys
from nodeagent.procmem import process_memory
import llama_cpp
from nodeagent.backends.llamacpp_log import capture, parse_buffers
from nodeagent.modelfile import inspect_file
from nodeagent.planner.compute import compute_bytes
from nodeagent.planner.memory import work_bytes
info = inspect_file(sys.argv[1])
before = process_memory()
with capture() as lines:
    llm = llama_cpp.Llama(sys.argv[1], n_ctx=512, n_batch=512, n_ubatch=128, n_threads=2, verbose=False,
                          use_mmap=False, flash_attn=True)
# the workload the planner plans for: the whole context in full batches (kernels' code pages, OpenMP
# threads and their arenas, the runtime's per-token batch arrays all come in)
llm.eval([3 + (i * 37) % 250 for i in range(508)])
after = process_memory()
b = parse_buffers(lines)
# what the planner models itself, for this tiny model: subtracted, so the residual is the runtime term
touched = compute_bytes(info, 512, 128, True, n_outputs=1) + work_bytes(info, 128)
buffers = sum(b.model.values()) + b.kv_bytes + b.output_bytes + touched
print(json.dumps({"added": after.rss_bytes - before.rss_bytes, "buffers": buffers,
                  "runtime": after.rss_bytes - before.rss_bytes - buffers, "n_vocab": llm.n_vocab(),
                  "n_tensors": info.n_tensors, "n_merges": info.merges_count}))
"""


def tiny_model(path: Path, tokenizer: dict, n_layer: int = 2) -> None:
    w = GGUFWriter(str(path), "qwen2")
    n_embd, n_ff = 64, 128
    for k, v in (("block_count", n_layer), ("embedding_length", n_embd), ("feed_forward_length", n_ff),
                 ("context_length", 4096), ("attention.head_count", 4), ("attention.head_count_kv", 2)):
        w.add_uint32(f"qwen2.{k}", v)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    add_metadata(w, tokenizer)
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, n_embd)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        for name, shape in (("attn_q", (n_embd, n_embd)), ("attn_k", (32, n_embd)), ("attn_v", (32, n_embd)),
                            ("attn_output", (n_embd, n_embd)), ("ffn_gate", (n_ff, n_embd)),
                            ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))):
            w.add_tensor(p + name + ".weight", rng.standard_normal(shape).astype(np.float32) * 0.02)
        for bias, size in (("attn_q", n_embd), ("attn_k", 32), ("attn_v", 32)):
            w.add_tensor(p + bias + ".bias", np.zeros(size, dtype=np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + norm + ".weight", np.ones(n_embd, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def measure(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def tokenizers() -> tuple[dict, dict, dict]:
    """A SentencePiece vocabulary of the three specials and the 256 byte tokens, and the real 152,064-token
    qwen2 tokenizer of the 7B header fixture."""
    raw = gzip.decompress((ROOT / "tests/fixtures/deepseek-r1-distill-qwen-7b-q4_k_m.header.gguf.gz").read_bytes())
    md = read_header(BytesSource(raw), decode_array_max=1 << 30).metadata
    qwen_tok = {k: v for k, v in md.items() if k.startswith("tokenizer.") and not isinstance(v, ArrayInfo)}
    small_tok = {"tokenizer.ggml.model": "llama",
                 "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)],
                 "tokenizer.ggml.scores": [0.0] * 259, "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256,
                 "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    few_merges = dict(qwen_tok, **{"tokenizer.ggml.merges": qwen_tok["tokenizer.ggml.merges"][::4]})
    return small_tok, qwen_tok, few_merges


def main() -> None:
    small_tok, qwen_tok, few_merges = tokenizers()
    points = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tok, layers in (("generated-259", small_tok, 2), ("qwen2-152064", qwen_tok, 2),
                                  ("qwen2-152064-quarter-merges", few_merges, 2),
                                  ("generated-259-48-layers", small_tok, 48)):
            path = Path(tmp) / f"{name}.gguf"
            tiny_model(path, tok, layers)
            points[name] = [measure(path) for _ in range(3)]
    # the largest of three runs: the planner must not fall below a peak
    a, b, q, c = (max(p["runtime"] for p in points[k]) for k in (
        "generated-259", "qwen2-152064", "qwen2-152064-quarter-merges", "generated-259-48-layers"))
    va, vb = points["generated-259"][0]["n_vocab"], points["qwen2-152064"][0]["n_vocab"]
    mb, mq = points["qwen2-152064"][0]["n_merges"], points["qwen2-152064-quarter-merges"][0]["n_merges"]
    per_merge = (b - q) / (mb - mq)
    per_vocab = (b - a - per_merge * mb) / (vb - va)
    # llama.cpp sizes its graph metadata and scheduler by max(1024, 8 * n_tensors) nodes
    na, nc = (max(1024, 8 * points[k][0]["n_tensors"]) for k in ("generated-259", "generated-259-48-layers"))
    per_node = (c - a) / (nc - na)
    result = {"points": points, "fixed_bytes": int(a - per_vocab * va - per_node * na),
              "per_vocab_bytes": round(per_vocab, 1), "per_merge_bytes": round(per_merge, 1),
              "per_graph_node_bytes": round(per_node, 1)}
    write_results("runtime_calibration", result, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "points"}))


if __name__ == "__main__":
    main()
