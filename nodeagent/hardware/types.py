"""Typed values the probe returns."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nodeagent.values import Frozen as _Frozen


class CgroupLimits(_Frozen):
    version: int = 2
    memory_max_bytes: int | None = Field(None, description="memory.max (None when 'max')")
    memory_current_bytes: int | None = None
    cpu_max_cores: float | None = Field(None, description="cpu.max quota / period")


class AppleSilicon(_Frozen):
    chip: str
    unified_memory_bytes: int
    performance_cores: int | None = None
    efficiency_cores: int | None = None
    metal_working_set_bytes: int
    metal_working_set_source: str = Field(description="'mlx', 'sysctl iogpu.wired_limit_mb' or 'estimate'")


class RaspberryPi(_Frozen):
    model: str = Field(description="From /proc/device-tree/model")
    revision: str | None = Field(None, description="Revision code from /proc/cpuinfo")
    board: str | None = Field(None, description="Board type decoded from the revision code, e.g. '4B'")
    soc: str | None = None
    ram_bytes: int | None = Field(None, description="RAM decoded from the revision code")


class GpuInfo(_Frozen):
    vendor: str
    name: str
    memory_total_bytes: int
    memory_free_bytes: int | None = None
    driver: str | None = None
    index: int = 0


class LlamaCppSupport(_Frozen):
    installed: bool
    version: str | None = None
    gpu_offload: bool = False
    mmap: bool = False
    mlock: bool = False
    cpu_features: list[str] | None = Field(None, description="CPU features the installed llama.cpp was built "
                                                              "to use (from llama_print_system_info)")


StorageKind = Literal["sd", "emmc", "usb", "nvme", "ssd", "hdd", "virtual"]


class Storage(_Frozen):
    """The device a folder (the model folder) lives on, and its sequential read speed where it was measured
    (``hardware/storage.py``; kept in the state directory's ``storage.json``, never measured in the hot path)."""

    path: str = Field(description="The folder")
    device: str | None = Field(None, description="The block device (mmcblk0, nvme0n1, sda, disk3), None where the "
                                                 "folder is on no block device (overlay, tmpfs) or it cannot be told")
    kind: StorageKind | None = Field(None, description="sd (an SD card), emmc, usb, nvme, ssd, hdd, or virtual (a "
                                                       "VM's disk: the host's speed); None: not known")
    key: str | None = Field(None, description="The device's id in storage.json: its name and serial")
    read_mb_s: float | None = Field(None, description="Measured sequential read, MB/s (10^6 bytes); None: never "
                                                      "measured on this device")
    measured_at: float | None = Field(None, description="When (Unix time)")
    method: str | None = Field(None, description="How: which file, how many bytes, how the page cache was kept out")


class HardwareInfo(_Frozen):
    os: str = Field(description="'linux' or 'darwin'")
    os_release: str | None = None
    arch: str = Field(description="'x86_64', 'arm64' or 'aarch64'")
    cpu_model: str | None = None
    cpu_features: list[str] = Field(default_factory=list,
                                    description="SIMD features that change how llama.cpp lays out weights "
                                                "(avx2, avx512, amx, neon, dotprod, i8mm, sve)")
    cores_logical: int
    cores_physical: int | None = None
    ram_total_bytes: int
    ram_available_bytes: int
    swap_total_bytes: int = 0
    swap_free_bytes: int = 0
    cgroup: CgroupLimits | None = None
    disk_path: str | None = None
    disk_free_bytes: int | None = None
    storage: Storage | None = Field(None, description="disk_path's device, its kind, and its measured read speed")
    apple: AppleSilicon | None = None
    raspberry_pi: RaspberryPi | None = None
    gpus: list[GpuInfo] = Field(default_factory=list)
    llama_cpp: LlamaCppSupport = LlamaCppSupport(installed=False)

    @property
    def memory_limit_bytes(self) -> int:
        """RAM this process may use: the smaller of RAM and the cgroup limit."""
        if self.cgroup and self.cgroup.memory_max_bytes is not None:
            return min(self.ram_total_bytes, self.cgroup.memory_max_bytes)
        return self.ram_total_bytes

    @property
    def memory_available_bytes(self) -> int:
        """MemAvailable, or what the cgroup still allows when that is less."""
        avail = self.ram_available_bytes
        cg = self.cgroup
        if cg and cg.memory_max_bytes is not None:
            avail = min(avail, cg.memory_max_bytes - (cg.memory_current_bytes or 0))
        return max(0, avail)
