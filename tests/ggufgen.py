"""Write small GGUF files with gguf.GGUFWriter: real architecture keys, tiny shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES


@dataclass
class Shape:
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int | list[int] = 2
    n_ff: int = 128
    vocab: int = 64
    ctx: int = 2048
    head_dim: int | None = None
    sliding_window: int | None = None
    swa_pattern: int | list[bool] | None = None
    tied: bool = False
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F16
    extra: dict = field(default_factory=dict)
    chat_template: str | None = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _tensor(w: GGUFWriter, name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    """Add a tensor of ggml shape ``shape`` (ne0 first); return its byte size."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    nbytes = n // block * size
    if qtype == GGMLQuantizationType.F32:
        data = np.zeros(tuple(reversed(shape)), dtype=np.float32)
        w.add_tensor(name, data)
    elif qtype == GGMLQuantizationType.F16:
        data = np.zeros(tuple(reversed(shape)), dtype=np.float16)
        w.add_tensor(name, data)
    else:
        rows = tuple(reversed(shape))
        data = np.zeros(rows[:-1] + (rows[-1] // block * size,), dtype=np.uint8)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    return nbytes


def write_gguf(path: Path, s: Shape) -> int:
    """Write the model; return the total tensor bytes it holds."""
    w = GGUFWriter(str(path), s.arch)
    a = s.arch
    head_dim = s.head_dim or s.n_embd // s.n_head
    w.add_name(f"test-{a}")
    w.add_uint32(f"{a}.block_count", s.n_layer)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", s.n_ff)
    w.add_uint32(f"{a}.context_length", s.ctx)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    if isinstance(s.n_head_kv, list):
        w.add_array(f"{a}.attention.head_count_kv", s.n_head_kv)
    else:
        w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    if s.head_dim:
        w.add_uint32(f"{a}.attention.key_length", head_dim)
        w.add_uint32(f"{a}.attention.value_length", head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    if s.sliding_window:
        w.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)
    if isinstance(s.swa_pattern, list):
        w.add_array(f"{a}.attention.sliding_window_pattern", s.swa_pattern)
    elif isinstance(s.swa_pattern, int):
        w.add_uint32(f"{a}.attention.sliding_window_pattern", s.swa_pattern)
    w.add_file_type(1 if s.weight_type == GGMLQuantizationType.F16 else 7)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(s.vocab)])
    w.add_token_scores([0.0] * s.vocab)
    w.add_token_types([1] * s.vocab)
    if s.chat_template:
        w.add_chat_template(s.chat_template)
    for k, v in s.extra.items():
        if isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_string(k, v)
    total = _tensor(w, "token_embd.weight", (s.n_embd, s.vocab), s.weight_type)
    total += _tensor(w, "output_norm.weight", (s.n_embd,), GGMLQuantizationType.F32)
    if not s.tied:
        total += _tensor(w, "output.weight", (s.n_embd, s.vocab), s.weight_type)
    kv = s.n_head_kv if isinstance(s.n_head_kv, list) else [s.n_head_kv] * s.n_layer
    for i in range(s.n_layer):
        p = f"blk.{i}."
        total += _tensor(w, p + "attn_norm.weight", (s.n_embd,), GGMLQuantizationType.F32)
        total += _tensor(w, p + "attn_q.weight", (s.n_embd, s.n_head * head_dim), s.weight_type)
        total += _tensor(w, p + "attn_k.weight", (s.n_embd, kv[i] * head_dim), s.weight_type)
        total += _tensor(w, p + "attn_v.weight", (s.n_embd, kv[i] * head_dim), s.weight_type)
        total += _tensor(w, p + "attn_output.weight", (s.n_head * head_dim, s.n_embd), s.weight_type)
        total += _tensor(w, p + "ffn_norm.weight", (s.n_embd,), GGMLQuantizationType.F32)
        total += _tensor(w, p + "ffn_gate.weight", (s.n_embd, s.n_ff), s.weight_type)
        total += _tensor(w, p + "ffn_up.weight", (s.n_embd, s.n_ff), s.weight_type)
        total += _tensor(w, p + "ffn_down.weight", (s.n_ff, s.n_embd), s.weight_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


def write_header_only(path: Path, arch: str, n_layer: int, n_embd: int, n_head: int, n_head_kv, n_ff: int,
                      vocab: int, ctx: int = 32768, n_expert: int = 0, n_expert_used: int = 0,
                      qtype: GGMLQuantizationType = GGMLQuantizationType.Q4_K,
                      sliding_window: int | None = None) -> None:
    """A GGUF that declares big tensors but holds none of their data, like a remote header read."""
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.feed_forward_length", n_ff)
    w.add_uint32(f"{arch}.context_length", ctx)
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    if isinstance(n_head_kv, list):
        w.add_array(f"{arch}.attention.head_count_kv", n_head_kv)
    else:
        w.add_uint32(f"{arch}.attention.head_count_kv", n_head_kv)
    if sliding_window:
        w.add_uint32(f"{arch}.attention.sliding_window", sliding_window)
    if n_expert:
        w.add_uint32(f"{arch}.expert_count", n_expert)
        w.add_uint32(f"{arch}.expert_used_count", n_expert_used)
    w.add_file_type(15)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    head_dim = n_embd // n_head
    kv = n_head_kv if isinstance(n_head_kv, list) else [n_head_kv] * n_layer

    def info(name, shape, qt):
        block, size = GGML_QUANT_SIZES[qt]
        n = int(np.prod(shape))
        byte_shape = tuple(reversed(shape))[:-1] + (shape[0] // block * size,)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), n // block * size, raw_dtype=qt)

    info("token_embd.weight", (n_embd, vocab), qtype)
    q6 = GGMLQuantizationType.Q6_K
    info("output.weight", (n_embd, vocab), q6 if n_embd % GGML_QUANT_SIZES[q6][0] == 0 else qtype)
    for i in range(n_layer):
        p = f"blk.{i}."
        info(p + "attn_q.weight", (n_embd, n_head * head_dim), qtype)
        info(p + "attn_k.weight", (n_embd, kv[i] * head_dim), qtype)
        info(p + "attn_v.weight", (n_embd, kv[i] * head_dim), qtype)
        info(p + "attn_output.weight", (n_head * head_dim, n_embd), qtype)
        if n_expert:
            info(p + "ffn_gate_exps.weight", (n_embd, n_ff, n_expert), qtype)
            info(p + "ffn_up_exps.weight", (n_embd, n_ff, n_expert), qtype)
            info(p + "ffn_down_exps.weight", (n_ff, n_embd, n_expert), qtype)
        else:
            info(p + "ffn_gate.weight", (n_embd, n_ff), qtype)
            info(p + "ffn_up.weight", (n_embd, n_ff), qtype)
            info(p + "ffn_down.weight", (n_ff, n_embd), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of a GGUF model with another chat template (weights and every other key as they were)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(
        gguf.GGUFValueType.STRING, template)}, [])
    return dst


def write_with_vocab(path: Path, vocab: Path, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_ff: int = 128,
                     seed: int = 0) -> Path:
    """A small llama model with random weights on a real vocabulary: the tokenizer keys of ``vocab`` (one of
    llama.cpp's vocabulary-only files, ``nodeagent.store.pkgindex.VOCABS``) as they are. Its answers are noise,
    but they are tokenized and detokenized as the vocabulary's real models' are."""
    from benchmarks.synthetic_model import add_metadata
    from nodeagent.modelfile.header import ArrayInfo, read_header
    from nodeagent.modelfile.source import FileSource

    with FileSource(vocab) as src:
        md = read_header(src, decode_array_max=1 << 30).metadata
    tokenizer = {k: v for k, v in md.items() if k.startswith("tokenizer.") and not isinstance(v, ArrayInfo)}
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"])
    w = GGUFWriter(str(path), "llama")
    w.add_name(f"test-llama on {vocab.name}")
    for key, value in (("block_count", n_layer), ("embedding_length", n_embd), ("feed_forward_length", n_ff),
                       ("context_length", 2048), ("attention.head_count", n_head),
                       ("attention.head_count_kv", n_head), ("rope.dimension_count", n_embd // n_head)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_file_type(1)
    add_metadata(w, tokenizer)
    rng = np.random.default_rng(seed)

    def add(name: str, *shape: int) -> None:  # ggml's shape, ne0 first
        w.add_tensor(name, rng.normal(0, 0.3, size=tuple(reversed(shape))).astype(np.float16))

    add("token_embd.weight", n_embd, n_vocab)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    add("output.weight", n_embd, n_vocab)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name, shape in (("attn_q", (n_embd, n_embd)), ("attn_k", (n_embd, n_embd)), ("attn_v", (n_embd, n_embd)),
                            ("attn_output", (n_embd, n_embd)), ("ffn_gate", (n_embd, n_ff)),
                            ("ffn_up", (n_embd, n_ff)), ("ffn_down", (n_ff, n_embd))):
            add(p + name + ".weight", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def as_reranker(src: Path, dst: Path, seed: int = 0, labels: list[str] | None = None,
                template: str | None = None) -> Path:
    """A cross-encoder from an encoder's GGUF (BERT's): its keys and weights as they were, a classification head of
    random weights added (``cls``: n_embd x n_embd with its bias, then tanh; ``cls.output``: one logit with its bias,
    or one a label of ``labels``: the tensors llama.cpp's rank pooling reads), and its pooling rank; ``template``:
    its rerank template (``tokenizer.chat_template.rerank``, as llama.cpp's converter writes Qwen3-Reranker's). Its
    scores are noise, but they are computed as a real reranker's are."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    w = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        kind = f.types[0]
        value = 4 if f.name == f"{arch}.pooling_type" else f.contents()  # llama.cpp's LLAMA_POOLING_TYPE_RANK
        w.add_key_value(f.name, value, kind, sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    n_embd = int(reader.get_field(f"{arch}.embedding_length").contents())
    n_out = len(labels) if labels else 1
    if labels:
        w.add_array(f"{arch}.classifier.output_labels", labels)
    if template is not None:
        w.add_string("tokenizer.chat_template.rerank", template)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    rng = np.random.default_rng(seed)
    w.add_tensor("cls.weight", (rng.standard_normal((n_embd, n_embd)) / np.sqrt(n_embd)).astype(np.float32))
    w.add_tensor("cls.bias", (rng.standard_normal(n_embd) * 0.1).astype(np.float32))
    w.add_tensor("cls.output.weight", (rng.standard_normal((n_out, n_embd)) * 2 / np.sqrt(n_embd)).astype(np.float32))
    w.add_tensor("cls.output.bias", np.linspace(0.1, -0.1, n_out).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
