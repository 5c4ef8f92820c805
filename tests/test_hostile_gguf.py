"""Hostile GGUF headers: truncated anywhere, absurd counts, bad types, bad UTF-8.

Each must end in one ModelFileError naming the offset, never a crash, and the
reader must never allocate more than the file holds.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import tracemalloc

import pytest

from nodeagent.errors import ModelFileError
from nodeagent.modelfile import BytesSource, inspect_source

VALUE_FORMATS = {4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q"}  # GGUF value types -> struct


class Builder:
    """Packs a GGUF header and records the offset of every count and length field."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.count_fields: list[tuple[int, str]] = []  # (offset, format)

    def raw(self, fmt: str, value, count_field: bool = False) -> None:
        if count_field:
            self.count_fields.append((len(self.buf), fmt))
        self.buf += struct.pack(fmt, value)

    def string(self, text: str | bytes) -> None:
        data = text.encode() if isinstance(text, str) else text
        self.raw("<Q", len(data), count_field=True)
        self.buf += data

    def kv(self, key: str, vtype: int, value) -> None:
        self.string(key)
        self.raw("<I", vtype)
        if vtype == 8:
            self.string(value)
        elif vtype == 9:
            etype, items = value
            self.raw("<I", etype)
            self.raw("<Q", len(items), count_field=True)
            for item in items:
                if etype == 8:
                    self.string(item)
                else:
                    self.raw({4: "<I", 6: "<f"}[etype], item)
        else:
            self.raw(VALUE_FORMATS[vtype], value)


def small_header(n_vocab: int = 5) -> tuple[bytes, Builder]:
    b = Builder()
    b.buf += b"GGUF"
    b.raw("<I", 3)
    b.raw("<Q", 3, count_field=True)  # tensors
    b.raw("<Q", 7, count_field=True)  # key/values
    b.kv("general.architecture", 8, "llama")
    b.kv("llama.block_count", 4, 1)
    b.kv("llama.embedding_length", 4, 32)
    b.kv("llama.attention.head_count", 4, 4)
    b.kv("llama.attention.head_count_kv", 9, (4, [2]))
    b.kv("tokenizer.ggml.tokens", 9, (8, [f"t{i}" for i in range(n_vocab)]))
    b.kv("tokenizer.ggml.scores", 9, (6, [0.0] * n_vocab))
    offset = 0
    tensors = (("token_embd.weight", (32, n_vocab), 1, 32 * n_vocab * 2), ("blk.0.attn_q.weight", (32, 32), 8, 34 * 32),
               ("output_norm.weight", (32,), 0, 32 * 4))
    for i, (name, dims, ttype, nbytes) in enumerate(tensors):
        b.string(name)
        b.raw("<I", len(dims), count_field=True)
        for d in dims:
            # the last tensor's shape may legally promise more data than the file holds
            b.raw("<Q", d, count_field=i < len(tensors) - 1)
        b.raw("<I", ttype)
        b.raw("<Q", offset)
        offset += (nbytes + 31) // 32 * 32
    return bytes(b.buf), b


def parse(data: bytes):
    return inspect_source(BytesSource(data, "hostile.gguf"))


def test_small_header_is_valid():
    data, _ = small_header()
    info = parse(data)
    assert info.block_count == 1 and info.vocab_size == 5 and info.head_count_kv == [2]
    assert info.tensor_bytes == 32 * 5 * 2 + 32 * 32 // 32 * 34 + 32 * 4


def test_every_truncation_point_fails_cleanly():
    data, _ = small_header()
    for cut in range(len(data)):
        with pytest.raises(ModelFileError) as err:
            parse(data[:cut])
        assert "offset" in str(err.value) or cut < 4, f"cut at {cut}: {err.value}"


@pytest.mark.parametrize("huge", [2**63, 2**64 - 1, 2**32 - 1, 10**9])
def test_every_count_field_set_huge(huge):
    data, builder = small_header()
    for offset, fmt in builder.count_fields:
        value = huge if fmt == "<Q" else min(huge, 2**32 - 1)
        bad = bytearray(data)
        struct.pack_into(fmt, bad, offset, value)
        tracemalloc.start()
        try:
            with pytest.raises(ModelFileError):
                parse(bytes(bad))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < (1 << 20) + 16 * len(data), f"field at {offset}: allocated {peak} bytes"


def test_last_tensor_promising_more_data_is_reported_incomplete():
    data, _ = small_header()
    idx = data.rindex(b"output_norm.weight") + len("output_norm.weight") + 4
    bad = bytearray(data)
    struct.pack_into("<Q", bad, idx, 10**9)
    info = parse(bytes(bad))
    assert info.is_complete is False
    assert info.tensor_bytes == 32 * 5 * 2 + 34 * 32 + 4 * 10**9


def test_overlapping_tensor_offsets():
    data, _ = small_header()
    idx = data.rindex(b"output_norm.weight") + len("output_norm.weight") + 4 + 8 + 4
    bad = bytearray(data)
    struct.pack_into("<Q", bad, idx, 0)
    with pytest.raises(ModelFileError, match="has data offset 0, expected"):
        parse(bytes(bad))


def test_wrong_magic():
    data, _ = small_header()
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        parse(b"GGML" + data[4:])


def test_empty_file():
    with pytest.raises(ModelFileError, match="empty"):
        parse(b"")


def test_unsupported_version():
    data, _ = small_header()
    with pytest.raises(ModelFileError, match="version 1"):
        parse(data[:4] + struct.pack("<I", 1) + data[8:])


def test_unknown_value_type():
    b = Builder()
    b.buf += b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    b.string("general.architecture")
    b.raw("<I", 99)
    with pytest.raises(ModelFileError, match="unknown value type 99"):
        parse(bytes(b.buf))


def test_unknown_tensor_type():
    data, _ = small_header()
    idx = data.rindex(b"output_norm.weight") + len("output_norm.weight") + 4 + 8
    bad = bytearray(data)
    struct.pack_into("<I", bad, idx, 250)
    with pytest.raises(ModelFileError, match="unknown ggml type 250"):
        parse(bytes(bad))


def test_bad_utf8_key_and_value():
    b = Builder()
    b.buf += b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    b.string(b"general.\xff\xfe")
    b.raw("<I", 4)
    b.raw("<I", 1)
    with pytest.raises(ModelFileError, match="not valid UTF-8"):
        parse(bytes(b.buf))
    b = Builder()
    b.buf += b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    b.kv("general.architecture", 8, b"ll\xc3ama")
    with pytest.raises(ModelFileError, match=r"not valid UTF-8.*offset \d+"):
        parse(bytes(b.buf))


def test_too_many_dimensions():
    data, _ = small_header()
    idx = data.index(b"token_embd.weight") + len("token_embd.weight")
    bad = bytearray(data)
    struct.pack_into("<I", bad, idx, 7)
    with pytest.raises(ModelFileError, match="7 dimensions"):
        parse(bytes(bad))


def test_missing_architecture():
    b = Builder()
    b.buf += b"GGUF" + struct.pack("<IQQ", 3, 0, 0)
    with pytest.raises(ModelFileError, match="general.architecture is missing"):
        parse(bytes(b.buf))


@pytest.mark.parametrize("case", ["truncated", "magic", "empty", "directory", "missing"])
def test_cli_reports_one_line_without_traceback(tmp_path, case):
    data, _ = small_header()
    path = tmp_path / "bad.gguf"
    if case == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif case == "magic":
        path.write_bytes(b"PK\x03\x04" + data[4:])
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "directory":
        path.mkdir()
    proc = subprocess.run([sys.executable, "-m", "nodeagent", "inspect", str(path)], capture_output=True, text=True)
    assert proc.returncode in (4, 5), proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("error: ") and len(lines) <= 2
    assert proc.stdout == ""
