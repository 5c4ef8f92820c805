"""llama.cpp's native log routed into Python logging, with capture of buffer sizes.

llama.cpp prints one line per buffer it allocates ("CPU_Mapped model buffer
size = 92.10 MiB", "CPU KV buffer size", "CPU compute buffer size", "CPU output
buffer size"). ``capture()`` collects the lines of one load so that
``parse_buffers()`` can turn them into measured component sizes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Iterator

log = logging.getLogger("nodeagent.llamacpp")
MIB = 1 << 20

# ggml log levels: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 cont
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_lock = threading.Lock()
_captures: list[list[str]] = []
_partial: list[str] = []
_installed = None  # keeps the ctypes callback alive


def _on_log(level: int, text: bytes | None, _user: ctypes.c_void_p) -> None:
    if not text:
        return
    chunk = text.decode("utf-8", "replace")
    with _lock:
        _partial.append(chunk)
        if not chunk.endswith("\n"):
            return
        lines = "".join(_partial).splitlines()
        _partial.clear()
        for cap in _captures:
            cap.extend(lines)
    for line in lines:
        log.log(_LEVELS.get(level, logging.DEBUG), "%s", line)


def install() -> None:
    """Route llama.cpp's log into Python logging (idempotent)."""
    global _installed
    if _installed is not None:
        return
    import llama_cpp

    _installed = llama_cpp.llama_log_callback(_on_log)
    llama_cpp.llama_log_set(_installed, ctypes.c_void_p(0))


@contextlib.contextmanager
def capture() -> Iterator[list[str]]:
    install()
    lines: list[str] = []
    with _lock:
        _captures.append(lines)
    try:
        yield lines
    finally:
        with _lock:
            _captures.remove(lines)


_MODEL = re.compile(r"load_tensors:\s+(\S+) model buffer size\s*=\s*([\d.]+) MiB")
_KV = re.compile(r"llama_kv_cache:\s+(\S+) KV buffer size\s*=\s*([\d.]+) MiB")
_COMPUTE = re.compile(r"sched_reserve:\s+(\S+) compute buffer size\s*=\s*([\d.]+) MiB")
_OUTPUT = re.compile(r"llama_context:\s+(\S+)\s+output buffer size\s*=\s*([\d.]+) MiB")


@dataclass
class BufferReport:
    """Sizes llama.cpp reported, in bytes (from MiB with two decimals: +-5 KiB each)."""

    model: dict[str, int] = field(default_factory=dict)  # buffer name -> bytes
    kv: dict[str, int] = field(default_factory=dict)
    compute: dict[str, int] = field(default_factory=dict)
    output: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def _total(d: dict[str, int]) -> int:
        return sum(d.values())

    @property
    def kv_bytes(self) -> int:
        return self._total(self.kv)

    @property
    def compute_bytes(self) -> int:
        return self._total(self.compute)

    @property
    def output_bytes(self) -> int:
        return self._total(self.output)


def parse_buffers(lines: list[str]) -> BufferReport:
    rep = BufferReport()
    for line in lines:
        for rx, target in ((_MODEL, rep.model), (_KV, rep.kv), (_COMPUTE, rep.compute), (_OUTPUT, rep.output)):
            m = rx.search(line)
            if m:
                # the KV cache of SWA models comes in two buffers of the same name: add them;
                # compute buffers are re-reserved: the last report is the one in force
                size = round(float(m.group(2)) * MIB)
                if target is rep.compute:
                    target[m.group(1)] = size
                else:
                    target[m.group(1)] = target.get(m.group(1), 0) + size
                break
    return rep
