"""The edge the probe reads through: a live machine or a recorded fixture.

Every platform module reads files, sysctl values and library facts through a
``SystemSource``; tests pass a ``RecordedSystem`` built from a JSON fixture.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
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


class LiveSystem:
    """The machine this process runs on."""

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
    """A machine recorded as JSON: files, sysctl values and facts."""

    facts: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)
    sysctls: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "RecordedSystem":
        data = json.loads(Path(path).read_text())
        return cls(facts=data["facts"], files=data.get("files", {}), sysctls=data.get("sysctl", {}))

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
