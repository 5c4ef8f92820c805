"""A GGUF header parser that never reads tensor data.

It reads the metadata key/values and the tensor descriptions, checking every
length against the bytes the source really holds before reading, so a
truncated or hostile file ends in one ``ModelFileError`` naming the offset and
the problem, and no allocation is larger than the file.

Large arrays (the tokenizer's tokens, scores, merges) are not decoded: the
header keeps their element type and count, which is all the planner needs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from nodeagent.errors import ModelFileError
from nodeagent.modelfile.ggml import ggml_types
from nodeagent.modelfile.source import BufferedReader, ByteSource

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4
MAX_ARRAY_DEPTH = 4
MAX_STRING_BYTES = 64 << 20  # no real key, value or tensor name comes near this
DECODE_ARRAY_MAX = 4096  # arrays longer than this are kept as (type, count) only
MAX_ELEMENTS = 1 << 50

# value type id -> (name, struct format or None for string/array)
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"),
    4: ("uint32", "<I"), 5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<?"),
    8: ("string", None), 9: ("array", None), 10: ("uint64", "<Q"), 11: ("int64", "<q"),
    12: ("float64", "<d"),
}
STRING_T, ARRAY_T, BOOL_T = 8, 9, 7


@dataclass(frozen=True)
class ArrayInfo:
    """An array that was not decoded: its element type and length."""

    element_type: str
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # relative to the start of the data section
    n_elements: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        return ggml_types()[self.ggml_type][0]


@dataclass
class GGUFHeader:
    source_name: str
    file_size: int
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    alignment: int = 32
    header_bytes: int = 0  # end of the tensor descriptions
    data_offset: int = 0  # aligned start of tensor data

    @property
    def data_bytes_needed(self) -> int:
        """Offset of the end of the last tensor: what a complete file must hold."""
        if not self.tensors:
            return self.data_offset
        return self.data_offset + max(t.offset + t.n_bytes for t in self.tensors)

    @property
    def is_complete(self) -> bool:
        return self.file_size >= self.data_bytes_needed


class _Cursor:
    def __init__(self, source: ByteSource) -> None:
        self.reader = BufferedReader(source)
        self.size = source.size
        self.pos = 0

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.remaining():
            if self.pos >= self.size:
                raise ModelFileError(f"file ends before {what}: header truncated", offset=self.pos,
                                     hint="the file is incomplete; download it again")
            raise ModelFileError(
                f"{what} needs {n} bytes but only {self.remaining()} remain: header truncated or corrupt",
                offset=self.pos, hint="the file is incomplete or damaged; download it again")

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self.reader.read(self.pos, n)
        if len(data) != n:
            raise ModelFileError(f"short read for {what}", offset=self.pos)
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, decode: bool = True) -> str | None:
        start = self.pos
        n = self.unpack("<Q", f"length of {what}")
        if n > MAX_STRING_BYTES:
            raise ModelFileError(f"{what} claims {n} bytes, more than any GGUF string can hold", offset=start)
        if not decode:
            self.skip(n, what)
            return None
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelFileError(f"{what} is not valid UTF-8 ({exc.reason})", offset=start + 8 + exc.start) from None


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0, decode_max: int = DECODE_ARRAY_MAX) -> Any:
    if vtype not in VALUE_TYPES:
        raise ModelFileError(f"unknown value type {vtype} for key {key!r}", offset=cur.pos - 4)
    name, fmt = VALUE_TYPES[vtype]
    if fmt is not None:
        return cur.unpack(fmt, f"value of {key!r}")
    if vtype == STRING_T:
        return cur.string(f"string value of {key!r}")
    if depth >= MAX_ARRAY_DEPTH:
        raise ModelFileError(f"arrays nested deeper than {MAX_ARRAY_DEPTH} in {key!r}", offset=cur.pos)
    start = cur.pos
    etype = cur.unpack("<I", f"array type of {key!r}")
    count = cur.unpack("<Q", f"array length of {key!r}")
    if etype not in VALUE_TYPES:
        raise ModelFileError(f"unknown array element type {etype} for key {key!r}", offset=start)
    ename, efmt = VALUE_TYPES[etype]
    min_elem = struct.calcsize(efmt) if efmt else (8 if etype == STRING_T else 12)
    if count * min_elem > cur.remaining():
        raise ModelFileError(
            f"array {key!r} claims {count} elements of {ename}, more than the {cur.remaining()} bytes left",
            offset=start + 4)
    decode = count <= decode_max
    if efmt is not None:
        if not decode:
            cur.skip(count * min_elem, f"array {key!r}")
            return ArrayInfo(ename, count)
        raw = cur.take(count * min_elem, f"array {key!r}")
        return list(struct.unpack(f"<{count}{efmt[1]}", raw))
    items = []
    for i in range(count):
        if etype == STRING_T:
            value = cur.string(f"element {i} of {key!r}", decode=decode)
        else:
            value = _read_value(cur, etype, f"{key}[{i}]", depth + 1, decode_max)
        if decode:
            items.append(value)
    return items if decode else ArrayInfo(ename, count)


def read_header(source: ByteSource, decode_array_max: int = DECODE_ARRAY_MAX) -> GGUFHeader:
    """Parse the GGUF header of ``source``. Raises ``ModelFileError`` on anything malformed.

    Arrays longer than ``decode_array_max`` are kept as ``ArrayInfo`` (type and count) only."""
    cur = _Cursor(source)
    if source.size == 0:
        raise ModelFileError(f"{source.name} is empty, not a GGUF file", offset=0)
    if source.size < 4:
        raise ModelFileError(f"{source.name} is {source.size} bytes long, too short for a GGUF file", offset=0)
    magic = cur.take(4, "magic")
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{source.name} is not a GGUF file (magic {magic!r}, expected b'GGUF')",
                             offset=0, hint="pass a .gguf model file")
    version = cur.unpack("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(f"GGUF version {version} is not supported (supported: 2, 3)", offset=4,
                             hint="convert the model with a current llama.cpp")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "metadata count")
    # each tensor description takes at least 28 bytes, each key/value at least 13
    if n_tensors * 28 > cur.remaining():
        raise ModelFileError(f"tensor count {n_tensors} cannot fit in a file of {source.size} bytes", offset=8)
    if n_kv * 13 > cur.remaining():
        raise ModelFileError(f"metadata count {n_kv} cannot fit in a file of {source.size} bytes", offset=16)
    header = GGUFHeader(source_name=source.name, file_size=source.size, version=version)
    for _ in range(n_kv):
        key_at = cur.pos
        key = cur.string("metadata key")
        assert key is not None
        vtype = cur.unpack("<I", f"value type of {key!r}")
        if key in header.metadata:
            raise ModelFileError(f"duplicate metadata key {key!r}", offset=key_at)
        header.metadata[key] = _read_value(cur, vtype, key, decode_max=decode_array_max)
    for i in range(n_tensors):
        start = cur.pos
        name = cur.string(f"name of tensor {i}")
        assert name is not None
        n_dims = cur.unpack("<I", f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelFileError(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)", offset=start)
        shape = tuple(cur.unpack("<Q", f"shape of tensor {name!r}") for _ in range(n_dims))
        ttype = cur.unpack("<I", f"type of tensor {name!r}")
        offset = cur.unpack("<Q", f"data offset of tensor {name!r}")
        if ttype not in ggml_types():
            raise ModelFileError(f"tensor {name!r} has unknown ggml type {ttype}", offset=start,
                                 hint="this file needs a newer reader; update nodeagent and the gguf package")
        n_elements = 1
        for d in shape:
            n_elements *= d
        _, block, type_size = ggml_types()[ttype]
        if n_elements > MAX_ELEMENTS or shape[0] % block != 0:
            raise ModelFileError(f"tensor {name!r} has an impossible shape {shape} for type {ggml_types()[ttype][0]}",
                                 offset=start)
        header.tensors.append(TensorInfo(name, shape, ttype, offset, n_elements, n_elements // block * type_size))
    header.header_bytes = cur.pos
    alignment = header.metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(f"general.alignment {alignment!r} is not a power of two", offset=None)
    header.alignment = alignment
    header.data_offset = (cur.pos + alignment - 1) // alignment * alignment
    # as llama.cpp's gguf loader: tensors lie in order, each at the aligned end of the previous one
    expected = 0
    for t in header.tensors:
        if t.offset != expected:
            raise ModelFileError(f"tensor {t.name!r} has data offset {t.offset}, expected {expected}",
                                 offset=header.data_offset + expected, hint="the file is corrupt")
        expected += (t.n_bytes + alignment - 1) // alignment * alignment
    return header
