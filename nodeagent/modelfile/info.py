"""``ModelInfo``: typed accessors over a GGUF header's raw keys."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from nodeagent.errors import ModelFileError
from nodeagent.model_kinds import ModelKind
from nodeagent.modelfile.ggml import file_type_label
from nodeagent.modelfile.header import ArrayInfo, GGUFHeader
from nodeagent.values import Frozen

# Architectures whose sliding-window layers follow a period when the file
# gives no explicit pattern: (period, dense_first). From llama.cpp's
# load_swa_pattern() calls in src/models/*.cpp.
SWA_PERIODS: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False), "gemma3": (6, False), "gemma-embedding": (6, False), "gemma3n": (5, False),
    "cohere2": (4, False), "cohere2moe": (4, True), "exaone4": (4, False), "exaone-moe": (4, False),
    "llama4": (4, False), "olmo2": (4, False), "gpt-oss": (2, False), "plamo3": (8, False),
    "smallthinker": (4, True), "afmoe": (4, False), "modern-bert": (3, True),
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
# The encoder-only architectures llama.cpp runs (src/llama-arch.cpp): attention not causal, no KV cache, the
# whole input in one micro-batch; they are embedding models (a file without a pooling type pools its tokens'
# mean, as sentence-transformers BERTs do)
ENCODER_ARCHS = frozenset({"bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2",
                           "jina-bert-v3", "eurobert"})
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum llama_pooling_type


def swa_layers_from_period(n_layer: int, period: int, dense_first: bool) -> list[bool]:
    """llama_hparams::set_swa_pattern: which layers use the sliding window."""
    if dense_first:
        return [period == 0 or il % period != 0 for il in range(n_layer)]
    return [period == 0 or il % period < period - 1 for il in range(n_layer)]


class TensorSpec(Frozen):
    name: str
    shape: tuple[int, ...] = Field(description="ggml order: ne0 (row length) first")
    type: str
    n_bytes: int


class ModelInfo(Frozen):
    source: str = Field(description="File path or URL the header was read from")
    file_size_bytes: int
    is_complete: bool = Field(description="Whether the source holds all tensor data, not only the header")
    gguf_version: int
    architecture: str
    name: str | None = None
    size_label: str | None = None
    block_count: int
    embedding_length: int
    feed_forward_length: int = Field(0, description="FFN width (the largest, when per layer)")
    head_count: int
    head_count_kv: list[int] = Field(description="KV heads per layer (the scalar repeated when the file gives one)")
    key_length: int = Field(description="Head size of keys")
    value_length: int = Field(description="Head size of values")
    sliding_window: int | None = None
    swa_layers: list[bool] | None = Field(None, description="Per layer: uses the sliding window")
    context_length: int | None = Field(None, description="Trained context length in tokens")
    vocab_size: int
    merges_count: int = Field(0, description="BPE merge rules in the tokenizer (0 for SentencePiece)")
    expert_count: int | None = None
    expert_used_count: int | None = None
    file_type: int | None = None
    quant: str | None = Field(None, description="Quant label from general.file_type, e.g. Q4_K_M")
    n_tensors: int
    n_params: int
    tensor_bytes: int = Field(description="Sum of every tensor's bytes, from shapes and ggml types")
    tensor_bytes_by_type: dict[str, int]
    block_tensor_bytes: list[int] = Field(description="Tensor bytes of each repeating block blk.N")
    token_embd_bytes: int
    token_embd_type: str | None = None
    output_bytes: int = Field(description="Bytes of output.weight (0 when tied to the embeddings)")
    output_type: str | None = None
    other_tensor_bytes: int = Field(description="Tensors outside the blocks, the embedding and the output")
    tied_embeddings: bool
    tokenizer_model: str | None = None
    pooling: str | None = Field(None, description="How an embedding model pools its tokens into one vector: mean, "
                                                  "cls, last, or rank (a reranker's score); None for a generator")
    causal: bool = Field(True, description="Attention is causal (False: an encoder, the whole input at once)")
    has_chat_template: bool
    chat_template: str | None = Field(None, exclude=True)
    data_offset_bytes: int
    tensors: list[TensorSpec] = Field(default_factory=list, exclude=True,
                                      description="Every tensor's name, shape and type (not printed)")

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.tensor_bytes / self.n_params if self.n_params else 0.0

    @property
    def n_head_kv_max(self) -> int:
        return max(self.head_count_kv) if self.head_count_kv else 0

    @property
    def kind(self) -> ModelKind:
        """What the model does (``model_kinds.py``): ``generate`` (text), ``embed`` (one vector per input) or
        ``rerank`` (a score per query and document), from its pooling type: the one place a kind is derived."""
        return ModelKind.of_pooling(self.pooling)


MAX_DIM = 1 << 32  # no head count, width or context of a real model comes near this


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _scalar_or_array(value: Any, n_layer: int, key: str) -> list[int]:
    """A per-layer value given as one integer or an array of one per block, each in [0, MAX_DIM]."""
    if isinstance(value, list):
        if len(value) != n_layer:
            raise ModelFileError(f"{key} has {len(value)} entries for {n_layer} blocks")
        if not all(_is_int(v) and 0 <= v <= MAX_DIM for v in value):
            raise ModelFileError(f"{key} holds values that are not integers in [0, {MAX_DIM}]")
        return list(value)
    if isinstance(value, ArrayInfo):
        raise ModelFileError(f"{key} has {value.count} entries, more than nodeagent decodes")
    if not _is_int(value) or not 0 <= value <= MAX_DIM:
        raise ModelFileError(f"{key} is {value!r} ({type(value).__name__}), not an integer in [0, {MAX_DIM}]",
                             hint="the file's metadata is damaged or not from a GGUF writer")
    return [value] * n_layer


class _ArchKeys:
    """The architecture's own keys (``<arch>.<key>``), each read with its type and range checked: anything else is
    a one-line error, as a damaged file deserves."""

    def __init__(self, md: dict[str, Any], arch: str) -> None:
        self.md, self.arch = md, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.md.get(f"{self.arch}.{key}", default)

    def opt_int(self, key: str, default: int | None = None, low: int = 0, high: int = MAX_DIM) -> int | None:
        """An integer key, or ``default`` when absent."""
        value = self.get(key)
        if value is None:
            return default
        if not _is_int(value) or not low <= value <= high:
            raise ModelFileError(f"{self.arch}.{key} is {value!r} ({type(value).__name__}), not an integer in "
                                 f"[{low}, {high}]", hint="the file's metadata is damaged or not from a GGUF writer")
        return value

    def need_int(self, key: str, low: int = 1, high: int = MAX_DIM) -> int:
        value = self.opt_int(key, None, low, high)
        if value is None:
            raise ModelFileError(f"{self.arch}.{key} is missing")
        return value


def _vocab(md: dict[str, Any], keys: _ArchKeys) -> tuple[int, int]:
    """The vocabulary's size and its merges' count."""
    tokens = md.get("tokenizer.ggml.tokens")
    if isinstance(tokens, ArrayInfo):
        vocab = tokens.count
    elif isinstance(tokens, list):
        vocab = len(tokens)
    else:
        vocab = keys.opt_int("vocab_size", 0) or 0
    merges = md.get("tokenizer.ggml.merges")
    n_merges = merges.count if isinstance(merges, ArrayInfo) else len(merges) if isinstance(merges, list) else 0
    return vocab, n_merges


def _sliding(keys: _ArchKeys, n_layer: int) -> tuple[int | None, list[bool] | None]:
    """The sliding window and which blocks use it (from the file's pattern, or the architecture's period)."""
    sliding_window = keys.opt_int("attention.sliding_window")
    if not isinstance(sliding_window, int) or sliding_window <= 0:
        return None, None
    pattern = keys.get("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == n_layer and all(isinstance(p, bool) for p in pattern):
        return sliding_window, list(pattern)
    period, dense_first = SWA_PERIODS.get(keys.arch, (0, False))
    if _is_int(pattern):
        period = keys.opt_int("attention.sliding_window_pattern", 0, 0, n_layer) or 0
    return sliding_window, swa_layers_from_period(n_layer, period, dense_first)


@dataclass
class _Tensors:
    """The tensors' bytes by type, by block, and the embeddings' and output's apart."""

    by_type: dict[str, int] = field(default_factory=dict)
    per_block: list[int] = field(default_factory=list)
    embd_bytes: int = 0
    out_bytes: int = 0
    other: int = 0
    embd_type: str | None = None
    out_type: str | None = None
    n_params: int = 0

    @classmethod
    def read(cls, header: GGUFHeader, n_layer: int) -> "_Tensors":
        s = cls(per_block=[0] * n_layer)
        for t in header.tensors:
            s.by_type[t.type_name] = s.by_type.get(t.type_name, 0) + t.n_bytes
            s.n_params += t.n_elements
            m = _BLOCK_RE.match(t.name)
            if m and int(m.group(1)) < n_layer:
                s.per_block[int(m.group(1))] += t.n_bytes
            elif t.name == "token_embd.weight":
                s.embd_bytes, s.embd_type = t.n_bytes, t.type_name
            elif t.name == "output.weight":
                s.out_bytes, s.out_type = t.n_bytes, t.type_name
            else:
                s.other += t.n_bytes
        return s


def _pooling(keys: _ArchKeys) -> tuple[str | None, bool]:
    """How the model pools (None: a generator) and whether its attention is causal. An encoder architecture
    embeds whatever its file says (no pooling type: the tokens' mean); a decoder embeds where its file gives a
    pooling type (a Qwen3-Embedding's ``last``), and generates otherwise."""
    encoder = keys.arch in ENCODER_ARCHS
    said = keys.get("attention.causal")
    causal = bool(said) if isinstance(said, bool) else not encoder
    kind = POOLING_TYPES[keys.opt_int("pooling_type", 0, 0, len(POOLING_TYPES) - 1) or 0]
    if encoder:
        return ("mean" if kind == "none" else kind), causal
    return (None if kind == "none" else kind), causal


def model_info(header: GGUFHeader) -> ModelInfo:
    md = header.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError("general.architecture is missing: not a model GGUF",
                             hint="inspect works on model files, not on LoRA adapters or projectors")
    keys = _ArchKeys(md, arch)
    # every block holds at least one tensor: more blocks than tensors is a lie the file cannot back
    n_layer = keys.need_int("block_count", high=max(1, len(header.tensors)))
    n_embd = keys.need_int("embedding_length")
    head_raw = keys.get("attention.head_count", 0)
    heads = _scalar_or_array(head_raw, n_layer, f"{arch}.attention.head_count")
    n_head = max(heads) if heads else 0
    kv_raw = keys.get("attention.head_count_kv", head_raw)
    head_kv = _scalar_or_array(kv_raw, n_layer, f"{arch}.attention.head_count_kv")
    ff_raw = keys.get("feed_forward_length", 0)
    n_ff = max(_scalar_or_array(ff_raw, n_layer, f"{arch}.feed_forward_length"), default=0)
    key_len = keys.opt_int("attention.key_length") or (n_embd // n_head if n_head else 0)
    value_len = keys.opt_int("attention.value_length") or key_len
    vocab, n_merges = _vocab(md, keys)
    sliding_window, swa_layers = _sliding(keys, n_layer)
    ts = _Tensors.read(header, n_layer)
    template = md.get("tokenizer.chat_template")
    file_type = md.get("general.file_type")
    pooling, causal = _pooling(keys)
    return ModelInfo(
        source=header.source_name,
        file_size_bytes=header.file_size,
        is_complete=header.is_complete,
        gguf_version=header.version,
        architecture=arch,
        name=md.get("general.name") if isinstance(md.get("general.name"), str) else None,
        size_label=md.get("general.size_label") if isinstance(md.get("general.size_label"), str) else None,
        block_count=n_layer,
        embedding_length=n_embd,
        feed_forward_length=int(n_ff),
        head_count=n_head,
        head_count_kv=head_kv,
        key_length=int(key_len),
        value_length=int(value_len),
        sliding_window=sliding_window,
        swa_layers=swa_layers,
        context_length=keys.opt_int("context_length", None, 1),
        vocab_size=vocab,
        merges_count=n_merges,
        expert_count=keys.opt_int("expert_count"),
        expert_used_count=keys.opt_int("expert_used_count"),
        file_type=file_type if isinstance(file_type, int) else None,
        quant=file_type_label(file_type if isinstance(file_type, int) else None),
        n_tensors=len(header.tensors),
        n_params=ts.n_params,
        tensor_bytes=sum(t.n_bytes for t in header.tensors),
        tensor_bytes_by_type=dict(sorted(ts.by_type.items(), key=lambda kv: -kv[1])),
        block_tensor_bytes=ts.per_block,
        token_embd_bytes=ts.embd_bytes,
        token_embd_type=ts.embd_type,
        output_bytes=ts.out_bytes,
        output_type=ts.out_type,
        other_tensor_bytes=ts.other,
        tied_embeddings=ts.out_type is None,
        tokenizer_model=md.get("tokenizer.ggml.model") if isinstance(md.get("tokenizer.ggml.model"), str) else None,
        pooling=pooling,
        causal=causal,
        has_chat_template=isinstance(template, str) and bool(template),
        chat_template=template if isinstance(template, str) else None,
        data_offset_bytes=header.data_offset,
        tensors=[TensorSpec(name=t.name, shape=t.shape, type=t.type_name, n_bytes=t.n_bytes) for t in header.tensors],
    )
