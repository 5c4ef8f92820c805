"""The GGUF header reader on real models, the 7B header and generated files."""

from __future__ import annotations

import hashlib

import pytest
from gguf import GGMLQuantizationType as Q
from ggufgen import Shape, write_gguf

from nodeagent.modelfile import BytesSource, RangeSource, inspect_file, inspect_source


def test_7b_header_only(header_7b):
    assert hashlib.sha256(header_7b.read_bytes()).hexdigest() == \
        "3358ed988046d379023eac5a4cd8b1a383c6f0c3d6ed2fc24174f1bbfd734bf6"
    info = inspect_file(header_7b)
    assert info.architecture == "qwen2"
    assert info.block_count == 28
    assert info.head_count_kv == [4] * 28
    assert info.key_length == info.value_length == 128
    assert info.vocab_size == 152_064
    assert info.tensor_bytes == 4_677_120_000
    assert info.n_tensors == 339
    assert info.quant == "Q4_K_M"
    assert info.is_complete is False  # 6 MB standing for 4.7 GB
    assert info.tied_embeddings is False
    assert info.output_type == "Q6_K"
    assert sum(info.block_tensor_bytes) + info.token_embd_bytes + info.output_bytes + info.other_tensor_bytes \
        == info.tensor_bytes
    assert info.context_length == 131072
    assert info.has_chat_template


def test_smollm2_real_file(smollm2_path):
    info = inspect_file(smollm2_path)
    assert (info.architecture, info.block_count, info.head_count_kv[0]) == ("llama", 30, 3)
    assert info.vocab_size == 49_152
    assert info.context_length == 8192
    assert info.quant == "Q4_1"
    assert info.tied_embeddings
    assert info.is_complete
    # the tensor data ends within the file (alignment padding aside)
    assert info.data_offset_bytes + info.tensor_bytes <= info.file_size_bytes


def test_gemma3_sliding_window(gemma3_path):
    info = inspect_file(gemma3_path)
    assert info.architecture == "gemma3"
    assert info.sliding_window == 512
    assert info.vocab_size == 262_144
    # llama.cpp's gemma3 pattern: every 6th layer is global
    assert info.swa_layers == [i % 6 < 5 for i in range(18)]
    assert info.key_length == 256


def test_generated_per_layer_kv_heads(tmp_path):
    path = tmp_path / "m.gguf"
    total = write_gguf(path, Shape(arch="llama", n_layer=4, n_head=8, n_head_kv=[8, 4, 2, 1], n_embd=128))
    info = inspect_file(path)
    assert info.head_count_kv == [8, 4, 2, 1]
    assert info.tensor_bytes == total
    assert info.is_complete


@pytest.mark.parametrize("qtype,name", [(Q.Q8_0, "Q8_0"), (Q.Q4_0, "Q4_0"), (Q.F16, "F16"), (Q.Q4_K, "Q4_K")])
def test_generated_bytes_by_type(tmp_path, qtype, name):
    shape = Shape(n_embd=256, n_ff=512, vocab=256, weight_type=qtype)
    total = write_gguf(tmp_path / "m.gguf", shape)
    info = inspect_file(tmp_path / "m.gguf")
    assert info.tensor_bytes == total
    assert info.tensor_bytes_by_type[name] == total - info.tensor_bytes_by_type.get("F32", 0)


def test_generated_swa_explicit_pattern(tmp_path):
    pattern = [True, False, True, True]
    write_gguf(tmp_path / "m.gguf", Shape(arch="gemma2", n_layer=4, sliding_window=128, swa_pattern=pattern))
    info = inspect_file(tmp_path / "m.gguf")
    assert info.swa_layers == pattern and info.sliding_window == 128


def test_generated_swa_default_period(tmp_path):
    write_gguf(tmp_path / "m.gguf", Shape(arch="gemma2", n_layer=4, sliding_window=4096))
    assert inspect_file(tmp_path / "m.gguf").swa_layers == [True, False, True, False]


def test_generated_swa_period_key(tmp_path):
    write_gguf(tmp_path / "m.gguf", Shape(arch="gemma3", n_layer=8, sliding_window=64, swa_pattern=4))
    assert inspect_file(tmp_path / "m.gguf").swa_layers == [True, True, True, False] * 2


def test_generated_tied_and_head_dim(tmp_path):
    write_gguf(tmp_path / "m.gguf", Shape(arch="qwen3", tied=True, head_dim=32, n_head=4, n_embd=64))
    info = inspect_file(tmp_path / "m.gguf")
    assert info.tied_embeddings and info.output_bytes == 0
    assert info.key_length == 32


def test_big_vocabulary_is_counted_not_decoded(tmp_path):
    write_gguf(tmp_path / "m.gguf", Shape(vocab=20_000, n_embd=32, n_head=2, n_head_kv=1))
    assert inspect_file(tmp_path / "m.gguf").vocab_size == 20_000


def test_range_source_reads_header_only(header_7b):
    data = header_7b.read_bytes()
    fake_total = 4_683_073_248  # the real file's size; only the header bytes exist here
    calls = []

    def fetch(offset, length):
        calls.append((offset, length))
        chunk = data[offset : offset + length]
        return chunk + bytes(length - len(chunk))  # tensor data stands in as zeros

    info = inspect_source(RangeSource(fetch, fake_total, "https://example.invalid/7b.gguf"))
    assert info.tensor_bytes == 4_677_120_000
    assert info.is_complete  # the (pretend) remote file holds all the data
    fetched = sum(length for _, length in calls)
    assert fetched <= len(data) + (1 << 20), "read more than the header plus one read-ahead chunk"
    assert len(calls) <= 8, "header should come in a few large ranged reads"


def test_bytes_source_matches_file(smollm2_path):
    head = smollm2_path.read_bytes()[:2_000_000]
    a = inspect_source(BytesSource(head, "head"))
    b = inspect_file(smollm2_path)
    assert a.tensor_bytes == b.tensor_bytes and a.block_count == b.block_count
    assert not a.is_complete
