"""Byte sources for the GGUF header reader.

A source knows its total size and returns the bytes at an offset. The reader
never asks for more than the source holds, so a hostile header cannot make it
allocate more than the file's size. ``RangeSource`` wraps any ranged fetch
(an HTTP ``Range`` request, for example) so a remote header can be read
without downloading the weights.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, Protocol

from nodeagent.errors import ModelFileError, NotFoundError


class ByteSource(Protocol):
    name: str
    size: int

    def read_at(self, offset: int, length: int) -> bytes:
        """Return up to ``length`` bytes starting at ``offset``."""


class BytesSource:
    def __init__(self, data: bytes, name: str = "<bytes>") -> None:
        self._data = data
        self.size = len(data)
        self.name = name

    def read_at(self, offset: int, length: int) -> bytes:
        return self._data[offset : offset + length]


class FileSource:
    """A local file read with ``pread``; nothing is read until asked for."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.name = str(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFoundError(f"no such file: {self.path}", hint="check the path") from None
        except IsADirectoryError:
            raise ModelFileError(f"{self.path} is a directory, not a GGUF file") from None
        except OSError as exc:
            raise ModelFileError(f"cannot open {self.path}: {exc.strerror}") from None
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self._fd)
            raise ModelFileError(f"{self.path} is not a regular file", hint="pass a .gguf model file")
        self.size = st.st_size

    def read_at(self, offset: int, length: int) -> bytes:
        try:
            return os.pread(self._fd, length, offset)
        except OSError as exc:
            raise ModelFileError(f"cannot read {self.path}: {exc.strerror}", offset=offset) from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "FileSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RangeSource:
    """A source over a ranged fetch ``fetch(offset, length) -> bytes`` of known size."""

    def __init__(self, fetch: Callable[[int, int], bytes], size: int, name: str) -> None:
        self._fetch = fetch
        self.size = size
        self.name = name

    def read_at(self, offset: int, length: int) -> bytes:
        length = max(0, min(length, self.size - offset))
        return self._fetch(offset, length) if length else b""


class BufferedReader:
    """Sequential reads over a source, fetched in chunks (few round trips for HTTP)."""

    def __init__(self, source: ByteSource, chunk_bytes: int = 1 << 20) -> None:
        self.source = source
        self.chunk_bytes = chunk_bytes
        self._buf = b""
        self._buf_start = 0

    def read(self, offset: int, length: int) -> bytes:
        end = offset + length
        if offset >= self._buf_start and end <= self._buf_start + len(self._buf):
            start = offset - self._buf_start
            return self._buf[start : start + length]
        want = min(max(length, self.chunk_bytes), max(0, self.source.size - offset))
        self._buf = self.source.read_at(offset, want)
        self._buf_start = offset
        return self._buf[:length]
