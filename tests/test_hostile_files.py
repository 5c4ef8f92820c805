"""Hostile model files through the whole inspect/plan path: one line of error, no traceback, and no
allocation beyond what the file's size justifies. GGUF metadata of the wrong types or ranges, and mlx-lm
directories with broken safetensors headers or configs."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tracemalloc

import pytest
from test_hostile_gguf import Builder

from nodeagent.config import resolve
from nodeagent.errors import ModelFileError, NodeAgentError
from nodeagent.modelfile.mlx import read_model_info
from nodeagent.node import Node

# (key, GGUF value type, value) replacing one field of a valid header
BAD_METADATA = {
    "head_count is a string": ("llama.attention.head_count", 8, "32"),
    "context_length is a float": ("llama.context_length", 6, 4096.0),
    "key_length is a string": ("llama.attention.key_length", 8, "64"),
    "block_count is negative": ("llama.block_count", 5, -3),
    "block_count is huge": ("llama.block_count", 10, 1 << 40),
    "block_count exceeds the tensors": ("llama.block_count", 4, 1000),
    "embedding_length is a bool": ("llama.embedding_length", 7, True),
    "head_count_kv is huge": ("llama.attention.head_count_kv", 10, 1 << 40),
}


def gguf(replace: tuple[str, int, object] | None = None) -> bytes:
    fields = {"llama.block_count": (4, 1), "llama.embedding_length": (4, 32), "llama.context_length": (4, 2048),
              "llama.attention.head_count": (4, 4), "llama.attention.head_count_kv": (4, 2),
              "llama.attention.key_length": (4, 8)}
    if replace:
        fields[replace[0]] = replace[1:]
    b = Builder()
    b.buf += b"GGUF"
    b.raw("<I", 3)
    b.raw("<Q", 3)
    b.raw("<Q", 2 + len(fields))
    b.kv("general.architecture", 8, "llama")
    for key, (vtype, value) in fields.items():
        b.kv(key, vtype, value)
    b.kv("tokenizer.ggml.tokens", 9, (8, [f"t{i}" for i in range(5)]))
    offset = 0
    for name, dims, ttype, nbytes in (("token_embd.weight", (32, 5), 1, 320), ("blk.0.attn_q.weight", (32, 32), 8,
                                                                                  34 * 32),
                                      ("output_norm.weight", (32,), 0, 128)):
        b.string(name)
        b.raw("<I", len(dims))
        for d in dims:
            b.raw("<Q", d)
        b.raw("<I", ttype)
        b.raw("<Q", offset)
        offset += (nbytes + 31) // 32 * 32
    data = bytes(b.buf)
    return data + bytes(-len(data) % 32) + bytes(offset)  # aligned, with the tensor data


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True, text=True, env=env)


def one_line_error(proc, code=5):
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("error: ") and len(lines) <= 2, proc.stderr
    return lines[0]


def test_the_valid_header_plans(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf())
    p = Node(str(path), config=resolve(env={})).plan
    assert p.fits and p.settings.n_ctx == 2048


@pytest.mark.parametrize("case", sorted(BAD_METADATA))
def test_bad_metadata_is_one_line_on_inspect_and_plan(tmp_path, case):
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf(BAD_METADATA[case]))
    key = BAD_METADATA[case][0]
    for command in ("inspect", "plan"):
        line = one_line_error(cli(command, str(path)))
        assert key in line, line


@pytest.mark.parametrize("case", sorted(BAD_METADATA))
def test_plan_path_allocates_no_more_than_the_file_justifies(tmp_path, case):
    path = tmp_path / "bad.gguf"
    data = gguf(BAD_METADATA[case])
    path.write_bytes(data)
    node = Node(str(path), config=resolve(env={}))
    node.device  # probe first: the machine's facts are not the file's
    import llama_cpp  # noqa: F401  (imported before measuring: the planner charges the runtime's overhead)

    tracemalloc.start()
    try:
        with pytest.raises(ModelFileError):
            node.plan
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20) + 16 * len(data), f"{case}: allocated {peak} bytes for a {len(data)}-byte file"


def mlx_dir(tmp_path, config=None, header: bytes | None = None, length: int | None = None):
    d = tmp_path / "mlx"
    d.mkdir()
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
           "vocab_size": 100, "intermediate_size": 128}
    (d / "config.json").write_text(json.dumps(cfg if config is None else config))
    body = header if header is not None else json.dumps({"w": {"dtype": "F16", "shape": [4],
                                                              "data_offsets": [0, 8]}}).encode()
    n = len(body) if length is None else length
    (d / "model.safetensors").write_bytes(struct.pack("<Q", n) + body + bytes(8))
    return d


MLX_CASES = {
    "truncated safetensors header": dict(header=b'{"w": {"dtype": "F16", "sha', length=4096),
    "a 2^34 header length": dict(length=1 << 34),
    "header not JSON": dict(header=b"\xff\xfe not json at all"),
    "tensor offsets past the file": dict(header=json.dumps({"w": {"dtype": "F16", "shape": [4],
                                                                  "data_offsets": [0, 1 << 40]}}).encode()),
    "config missing num_hidden_layers": dict(config={"model_type": "llama", "hidden_size": 64,
                                                     "num_attention_heads": 2, "vocab_size": 100}),
    "config with a string hidden_size": dict(config={"num_hidden_layers": 2, "hidden_size": "64",
                                                     "num_attention_heads": 2, "vocab_size": 100}),
    "config is a list": dict(config=[1, 2, 3]),
}


@pytest.mark.parametrize("case", sorted(MLX_CASES))
def test_hostile_mlx_directory(tmp_path, case):
    d = mlx_dir(tmp_path, **MLX_CASES[case])
    tracemalloc.start()
    try:
        with pytest.raises(NodeAgentError):
            read_model_info(d)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{case}: allocated {peak} bytes"
    one_line_error(cli("plan", str(d)))


def test_a_sound_mlx_directory_reads(tmp_path):
    info = read_model_info(mlx_dir(tmp_path))
    assert info.n_layers == 2 and info.weights_bytes == 8 and info.head_dim == 32
