"""The edge the probe reads through: a live machine or a recorded fixture.

Every platform module reads files, sysctl values and library facts through a
``SystemSource``; tests pass a ``RecordedSystem`` built from a JSON fixture.

The health reading (``health.py``) reads through the same edge, often (the guard asks every few seconds), so
what it asks costs no process: files, ``sysctlbyname`` for the few macOS values it reads (``FAST_SYSCTLS``),
and ``notify_get_state``. A command (``pmset``, ``diskutil``) is run at most once a minute per command line and
its output kept meanwhile (``command``).
"""

from __future__ import annotations

import fnmatch
import glob as globmod
import json
import os
import platform
import shutil
import subprocess
import sys as _sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nodeagent.errors import ProbeError
from nodeagent.hardware.types import GpuInfo, LlamaCppSupport


@dataclass(frozen=True)
class MemoryFacts:
    total_bytes: int
    available_bytes: int
    swap_total_bytes: int = 0
    swap_free_bytes: int = 0


class SystemSource(Protocol):
    def system(self) -> str: ...  # platform.system().lower()
    def release(self) -> str | None: ...
    def machine(self) -> str: ...
    def read_text(self, path: str) -> str | None: ...
    def sysctl(self, name: str) -> str | None: ...
    def memory(self) -> MemoryFacts: ...
    def cpu_count(self, logical: bool) -> int | None: ...
    def disk_free(self, path: str) -> int | None: ...
    def nvidia_gpus(self) -> list[GpuInfo]: ...
    def metal_working_set(self) -> int | None: ...
    def llama_cpp(self) -> LlamaCppSupport: ...
    def glob(self, pattern: str) -> list[str]: ...  # paths matching, sorted; ``*`` never crosses a ``/``
    def realpath(self, path: str) -> str | None: ...  # a sysfs link resolved (where a block device hangs)
    def notify_state(self, name: str) -> int | None: ...  # macOS notify_get_state; None elsewhere
    def command(self, argv: list[str]) -> str | None: ...  # its stdout; at most once a minute, cached


COMMAND_EVERY_S = 60.0  # a command line is run at most this often; its output is kept in between
# macOS values the health reading asks every few seconds: read with sysctlbyname, no process
FAST_SYSCTLS = {"kern.memorystatus_vm_pressure_level": "int", "vm.swapusage": "xsw_usage"}


class LiveSystem:
    """The machine this process runs on."""

    _commands: dict[tuple[str, ...], tuple[float, str | None]] = {}  # argv -> (when, output): per process
    _commands_lock = threading.Lock()
    _notify_tokens: dict[str, int] = {}

    def system(self) -> str:
        return platform.system().lower()

    def release(self) -> str | None:
        return platform.release() or None

    def machine(self) -> str:
        return platform.machine()

    def read_text(self, path: str) -> str | None:
        try:
            with open(path, "rb") as fh:
                return fh.read(1 << 20).decode("utf-8", "replace")
        except OSError:
            return None

    def sysctl(self, name: str) -> str | None:
        if name in FAST_SYSCTLS and _sys.platform == "darwin":
            return _sysctlbyname(name, FAST_SYSCTLS[name])
        exe = shutil.which("sysctl") or "/usr/sbin/sysctl"
        try:
            out = subprocess.run([exe, "-n", name], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    def memory(self) -> MemoryFacts:
        import psutil

        vm, sw = psutil.virtual_memory(), psutil.swap_memory()
        return MemoryFacts(vm.total, vm.available, sw.total, sw.free)

    def cpu_count(self, logical: bool) -> int | None:
        import psutil

        return psutil.cpu_count(logical=logical)

    def disk_free(self, path: str) -> int | None:
        p = Path(path)
        while not p.exists() and p != p.parent:
            p = p.parent
        try:
            return shutil.disk_usage(p).free
        except OSError:
            return None

    def nvidia_gpus(self) -> list[GpuInfo]:
        try:
            import pynvml  # from nvidia-ml-py, optional
        except ImportError:
            return []
        try:
            pynvml.nvmlInit()
        except Exception:  # no driver: no NVIDIA GPU to report
            return []
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            gpus = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                name = pynvml.nvmlDeviceGetName(h)
                gpus.append(GpuInfo(vendor="nvidia", name=name if isinstance(name, str) else name.decode(),
                                    memory_total_bytes=int(mem.total), memory_free_bytes=int(mem.free),
                                    driver=driver if isinstance(driver, str) else driver.decode(), index=i))
            return gpus
        finally:
            pynvml.nvmlShutdown()

    def metal_working_set(self) -> int | None:
        if self.system() != "darwin" or self.machine() != "arm64":
            return None
        try:
            import mlx.core as mx
        except ImportError:
            return None
        try:
            info = mx.metal.device_info() if hasattr(mx, "metal") else mx.device_info()
            return int(info["max_recommended_working_set_size"])
        except Exception:
            return None

    def llama_cpp(self) -> LlamaCppSupport:
        try:
            import llama_cpp
        except ImportError:
            return LlamaCppSupport(installed=False)
        except OSError as exc:  # the shared library failed to load
            raise ProbeError(f"llama-cpp-python is installed but its library failed to load: {exc}",
                             hint="reinstall llama-cpp-python") from None
        info = llama_cpp.llama_print_system_info()
        return LlamaCppSupport(
            installed=True,
            version=getattr(llama_cpp, "__version__", None),
            gpu_offload=bool(llama_cpp.llama_supports_gpu_offload()),
            mmap=bool(llama_cpp.llama_supports_mmap()),
            mlock=bool(llama_cpp.llama_supports_mlock()),
            cpu_features=build_features(info.decode() if isinstance(info, bytes) else str(info)),
        )


    def glob(self, pattern: str) -> list[str]:
        return sorted(globmod.glob(pattern))

    def realpath(self, path: str) -> str | None:
        return os.path.realpath(path) if os.path.exists(path) else None

    def notify_state(self, name: str) -> int | None:
        """The state of a Darwin notification (``notify_get_state``: thermal pressure needs no root); None on
        any other system, or where it cannot be read."""
        if _sys.platform != "darwin":
            return None
        import ctypes

        try:
            lib = ctypes.CDLL("/usr/lib/libSystem.B.dylib")
            token = self._notify_tokens.get(name)
            if token is None:
                out = ctypes.c_int(0)
                if lib.notify_register_check(name.encode(), ctypes.byref(out)) != 0:
                    return None
                token = self._notify_tokens[name] = out.value
            state = ctypes.c_uint64(0)
            if lib.notify_get_state(ctypes.c_int(token), ctypes.byref(state)) != 0:
                return None
            return int(state.value)
        except (OSError, AttributeError):
            return None

    def command(self, argv: list[str]) -> str | None:
        """A command's stdout, run at most once every ``COMMAND_EVERY_S`` per command line (the output is kept
        in between, failures too); None where the program is not installed (``pmset`` on Linux), fails or takes
        over 5 s."""
        key = tuple(argv)
        with self._commands_lock:
            got = self._commands.get(key)
            if got is not None and time.monotonic() - got[0] < COMMAND_EVERY_S:
                return got[1]
            exe = shutil.which(argv[0]) or (argv[0] if os.path.isabs(argv[0]) and os.access(argv[0], os.X_OK)
                                            else None)
            out: str | None = None
            if exe is not None:
                try:
                    proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=5)
                    out = proc.stdout if proc.returncode == 0 else None
                except (OSError, subprocess.TimeoutExpired):
                    out = None
            self._commands[key] = (time.monotonic(), out)
            return out


def _sysctlbyname(name: str, kind: str) -> str | None:
    """A macOS sysctl through libc's sysctlbyname, written as ``sysctl -n`` prints it: an integer, or for
    ``vm.swapusage`` (struct xsw_usage) ``total = 2048.00M  used = 1024.25M  free = 1023.75M``."""
    import ctypes

    try:
        libc = ctypes.CDLL("/usr/lib/libSystem.B.dylib")
        if kind == "int":
            buf, size = ctypes.c_int64(0), ctypes.c_size_t(8)
            if libc.sysctlbyname(name.encode(), ctypes.byref(buf), ctypes.byref(size), None, 0) != 0:
                return None
            value = buf.value if size.value == 8 else buf.value & 0xFFFFFFFF
            if size.value == 4 and value >= 1 << 31:
                value -= 1 << 32
            return str(value)

        class XswUsage(ctypes.Structure):
            _fields_ = [("total", ctypes.c_uint64), ("avail", ctypes.c_uint64), ("used", ctypes.c_uint64),
                        ("pagesize", ctypes.c_uint32), ("encrypted", ctypes.c_uint32)]

        xsw, size = XswUsage(), ctypes.c_size_t(ctypes.sizeof(XswUsage))
        if libc.sysctlbyname(name.encode(), ctypes.byref(xsw), ctypes.byref(size), None, 0) != 0:
            return None
        mib = float(1 << 20)
        return f"total = {xsw.total / mib:.2f}M  used = {xsw.used / mib:.2f}M  free = {xsw.avail / mib:.2f}M"
    except (OSError, AttributeError):
        return None


# llama_print_system_info() names -> ours (see hardware/linux.py)
_BUILD_FEATURES = {"AVX2": "avx2", "AVX512": "avx512", "AMX_INT8": "amx", "NEON": "neon", "DOTPROD": "dotprod",
                   "MATMUL_INT8": "i8mm", "SVE": "sve"}


def build_features(system_info: str) -> list[str]:
    """'CPU : SSE3 = 1 | AVX2 = 1 | ...' -> ['avx2', ...]: what the build will really use."""
    found = set()
    for part in system_info.split("|"):
        name, _, value = part.rpartition("=")
        name = name.split(":")[-1].strip()
        if value.strip() == "1" and name in _BUILD_FEATURES:
            found.add(_BUILD_FEATURES[name])
    return sorted(found)


@dataclass
class RecordedSystem:
    """A machine recorded as JSON: files, sysctl values and facts; for the health reading also the links sysfs
    resolves (``links``: path -> target), Darwin notification states (``notify``: name -> state) and commands'
    outputs (``commands``: the command line joined by spaces -> stdout)."""

    facts: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)
    sysctls: dict[str, str] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    notify: dict[str, int] = field(default_factory=dict)
    commands: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "RecordedSystem":
        data = json.loads(Path(path).read_text())
        return cls(facts=data["facts"], files=data.get("files", {}), sysctls=data.get("sysctl", {}),
                   links=data.get("links", {}), notify=data.get("notify", {}), commands=data.get("commands", {}))

    def system(self) -> str:
        return self.facts["system"]

    def release(self) -> str | None:
        return self.facts.get("release")

    def machine(self) -> str:
        return self.facts["machine"]

    def read_text(self, path: str) -> str | None:
        return self.files.get(path)

    def sysctl(self, name: str) -> str | None:
        return self.sysctls.get(name)

    def memory(self) -> MemoryFacts:
        m = self.facts["memory"]
        return MemoryFacts(m["total_bytes"], m["available_bytes"], m.get("swap_total_bytes", 0),
                           m.get("swap_free_bytes", 0))

    def cpu_count(self, logical: bool) -> int | None:
        return self.facts["cpu_logical" if logical else "cpu_physical"]

    def disk_free(self, path: str) -> int | None:
        return self.facts.get("disk_free_bytes")

    def nvidia_gpus(self) -> list[GpuInfo]:
        return [GpuInfo(**g) for g in self.facts.get("nvidia_gpus", [])]

    def metal_working_set(self) -> int | None:
        return self.facts.get("mlx_working_set_bytes")

    def llama_cpp(self) -> LlamaCppSupport:
        return LlamaCppSupport(**self.facts.get("llama_cpp", {"installed": False}))

    def glob(self, pattern: str) -> list[str]:
        """The recorded files, and the folders above them, that match (segment by segment, as glob does)."""
        want = pattern.split("/")
        paths = set(self.files) | set(self.links)
        for p in list(paths):
            parts = p.split("/")
            paths.update("/".join(parts[:i]) for i in range(2, len(parts)))
        return sorted(p for p in paths if len(parts := p.split("/")) == len(want)
                      and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, want)))

    def realpath(self, path: str) -> str | None:
        return self.links.get(path, path if path in self.files or any(f.startswith(path + "/") for f in self.files)
                              else None)

    def notify_state(self, name: str) -> int | None:
        return self.notify.get(name)

    def command(self, argv: list[str]) -> str | None:
        return self.commands.get(" ".join(argv))
