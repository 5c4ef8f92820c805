"""Device profiles (``profiles/*.toml``) and matching a probe to one.

A profile says how to recognise a machine and what to assume there: memory
kept for the OS, the margin, which budget the GPU is held to, the backends,
threads, flash attention and offload, default and maximum context, KV types
and parallel slots.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Literal

from pydantic import Field, ValidationError

from nodeagent.datafiles import toml_entries
from nodeagent.errors import ConfigError, NotFoundError
from nodeagent.hardware.types import HardwareInfo
from nodeagent.kv_types import KvType
from nodeagent.tomlfile import parse_toml
from nodeagent.units import GIB, MIB
from nodeagent.values import Frozen, Strict


class Match(Strict):
    os: Literal["linux", "darwin"] | None = None
    arch: str | None = None
    chip: str | None = Field(None, description="Regular expression over the Apple chip name")
    pi_board: str | None = Field(None, description="Raspberry Pi board type, e.g. '4B', '5'")
    gpu_vendor: str | None = None
    ram_min_gib: float | None = None
    ram_max_gib: float | None = None


class MemoryPolicy(Strict):
    """How a device's memory is budgeted (a profile's ``memory``): the limit the plan must fit, what is kept free
    for the rest of the machine, and the margin on the estimate. (The plan's own breakdown is ``planner``'s
    ``Memory``.)"""

    budget: Literal["host-available", "metal-working-set", "gpu-free"]
    reserve_mib: int = Field(ge=0, description="Kept free for the OS and other processes")
    margin_mib: int = Field(ge=0, description="Safety margin on top of the estimate")

    @property
    def reserve_bytes(self) -> int:
        return self.reserve_mib * MIB

    @property
    def margin_bytes(self) -> int:
        return self.margin_mib * MIB


class Runtime(Strict):
    backends: list[Literal["llamacpp", "mlx"]]
    threads: int = Field(ge=0, description="0: decided from the probe")
    gpu_offload: bool
    flash_attn: bool
    n_batch: int = Field(gt=0)
    n_ubatch: int = Field(gt=0)
    slots: int = Field(gt=0)


class Context(Strict):
    default_ctx_tokens: int = Field(gt=0)
    extract_ctx_tokens: int = Field(gt=0)
    classify_ctx_tokens: int = Field(gt=0)
    max_ctx_tokens: int = Field(gt=0)
    type_k: KvType
    type_v: KvType


# The serving process before any model (Python, nodeagent and llama.cpp's libraries imported), charged when
# planning for a device other than this machine. Linux: 60 MiB measured (x86-64, CPython 3.11,
# llama-cpp-python 0.3.36, CPU build), rounded up to 64. macOS: an estimate, not measured here: the same plus
# the Metal framework and its shader library, taken as 128 MiB. A profile may give its own figure.
NOMINAL_OVERHEAD_MIB = {"linux": 64, "darwin": 128}


class Nominal(Strict):
    """The typical device, for planning on another machine."""

    ram_bytes: int = Field(gt=0)
    process_overhead_mib: int | None = Field(None, gt=0, description="The serving process before any model; "
                                                                      "default: the per-OS figure")
    metal_working_set_bytes: int | None = None
    gpu_memory_bytes: int | None = None
    cpu_features: list[str] = Field(default_factory=list)
    arch: str
    memory_bandwidth_gb_s: float | None = Field(None, gt=0, description="The memory's peak bandwidth by its "
                                                                      "spec: what bounds decoding speed")
    disk_read_mb_s: float | None = Field(None, gt=0, description="The typical disk's sequential read: what a cold "
                                                                 "start reads the weights at")
    prefill_gflop_s: float | None = Field(None, gt=0, description="llama.cpp's prompt reading on the device, in "
                                                                  "effective GFLOP/s (2 a parameter a token), from a "
                                                                  "published measurement: a prefill's time")


class DeviceProfile(Strict):
    id: str
    description: str
    match: Match
    memory: MemoryPolicy
    runtime: Runtime
    context: Context
    nominal: Nominal

    def nominal_hardware(self) -> HardwareInfo:
        """A freshly booted device of this profile: for planning when it is not the machine we run on."""
        from nodeagent.hardware.apple import estimated_working_set
        from nodeagent.hardware.types import AppleSilicon, GpuInfo, LlamaCppSupport

        n = self.nominal
        apple = None
        if self.match.os == "darwin":
            ws = n.metal_working_set_bytes
            apple = AppleSilicon(chip=(self.match.chip or "Apple Silicon").strip("^$"), unified_memory_bytes=n.ram_bytes,
                                 metal_working_set_bytes=ws or estimated_working_set(n.ram_bytes),
                                 metal_working_set_source="profile" if ws else "estimate")
        gpus = [GpuInfo(vendor="nvidia", name="nominal GPU", memory_total_bytes=n.gpu_memory_bytes,
                        memory_free_bytes=n.gpu_memory_bytes)] if n.gpu_memory_bytes else []
        return HardwareInfo(os=self.match.os or "linux", arch=n.arch, cpu_features=n.cpu_features,
                            cores_logical=self.runtime.threads or 4, ram_total_bytes=n.ram_bytes,
                            ram_available_bytes=n.ram_bytes, apple=apple, gpus=gpus,
                            llama_cpp=LlamaCppSupport(installed=True, gpu_offload=self.runtime.gpu_offload,
                                                      mmap=True, mlock=True))

    def nominal_overhead_bytes(self) -> int:
        mib = self.nominal.process_overhead_mib or NOMINAL_OVERHEAD_MIB[self.match.os or "linux"]
        return mib * MIB

    def ctx_for_task(self, task: str | None) -> int:
        return {"extract": self.context.extract_ctx_tokens,
                "classify": self.context.classify_ctx_tokens}.get(task or "", self.context.default_ctx_tokens)

    def threads_for(self, hw: HardwareInfo) -> int:
        if self.runtime.threads:
            return self.runtime.threads
        if hw.apple and hw.apple.performance_cores:
            cores = hw.apple.performance_cores
        else:
            cores = hw.cores_physical or hw.cores_logical
        if hw.cgroup and hw.cgroup.cpu_max_cores:
            cores = min(cores, max(1, int(hw.cgroup.cpu_max_cores)))
        return max(1, cores)


@lru_cache(maxsize=1)
def load_profiles() -> dict[str, DeviceProfile]:
    out: dict[str, DeviceProfile] = {}
    for entry in toml_entries("profiles"):
        try:
            profile = DeviceProfile.model_validate(parse_toml(entry.read_bytes(), f"device profile {entry.name}"))
        except ValidationError as exc:
            raise ConfigError(f"device profile {entry.name} is invalid: {exc}") from None
        if profile.id != entry.name.removesuffix(".toml"):
            raise ConfigError(f"device profile {entry.name} has id {profile.id!r}; they must agree")
        out[profile.id] = profile
    return out


def get_profile(profile_id: str) -> DeviceProfile:
    profiles = load_profiles()
    if profile_id not in profiles:
        raise NotFoundError(f"unknown device profile {profile_id!r}",
                            hint=f"known profiles: {', '.join(profiles)} (see 'nodeagent profiles')")
    return profiles[profile_id]


class ProfileMatch(Frozen):
    profile_id: str
    reasons: list[str]
    score: int
    fell_back: str | None = Field(None, description="Why a board or chip with no profile of its own got a generic one, "
                                                    "and what that one assumes")


def check_match(profile: DeviceProfile, hw: HardwareInfo) -> tuple[bool, list[str]]:
    m = profile.match
    reasons: list[str] = []
    if m.os is not None:
        if hw.os != m.os:
            return False, [f"os is {hw.os}, not {m.os}"]
        reasons.append(f"os {hw.os}")
    if m.arch is not None:
        if hw.arch != m.arch:
            return False, [f"arch is {hw.arch}, not {m.arch}"]
        reasons.append(f"arch {hw.arch}")
    if m.chip is not None:
        chip = hw.apple.chip if hw.apple else None
        if chip is None or not re.search(m.chip, chip):
            return False, [f"chip {chip!r} does not match {m.chip!r}"]
        reasons.append(f"chip {chip}")
    if m.pi_board is not None:
        board = hw.raspberry_pi.board if hw.raspberry_pi else None
        if board != m.pi_board:
            return False, [f"Raspberry Pi board {board!r} is not {m.pi_board!r}"]
        reasons.append(f"Raspberry Pi {board} ({hw.raspberry_pi.model})")  # type: ignore[union-attr]
    if m.gpu_vendor is not None:
        if not any(g.vendor == m.gpu_vendor for g in hw.gpus):
            return False, [f"no {m.gpu_vendor} GPU"]
        reasons.append(f"{m.gpu_vendor} GPU")
    if m.ram_min_gib is not None or m.ram_max_gib is not None:
        ram = hw.memory_limit_bytes / GIB
        lo, hi = m.ram_min_gib or 0, m.ram_max_gib or float("inf")
        if not lo <= ram <= hi:
            return False, [f"memory {ram:.1f} GiB outside {lo:g}-{hi:g} GiB"]
        reasons.append(f"memory {ram:.1f} GiB within {lo:g}-{hi:g} GiB")
    return True, reasons


def match_profile(hw: HardwareInfo) -> ProfileMatch:
    """The most specific profile whose every criterion holds for this machine. A Raspberry Pi or an Apple chip that
    none of its family's profiles fits gets the generic one, and the match says so (``fell_back``): which profiles
    of its family missed it and why, and what the generic profile assumes instead."""
    best: ProfileMatch | None = None
    missed: list[str] = []
    profiles = load_profiles()
    for profile in profiles.values():
        ok, reasons = check_match(profile, hw)
        if ok and (best is None or len(reasons) > best.score):
            best = ProfileMatch(profile_id=profile.id, reasons=reasons, score=len(reasons))
        elif not ok and _same_family(profile, hw):
            missed.append(f"{profile.id}: {reasons[0]}")
    if best is None:
        raise NotFoundError(f"no device profile matches this {hw.os}/{hw.arch} machine",
                            hint="pass --profile ID (see 'nodeagent profiles')")
    chosen = profiles[best.profile_id]
    family = _family(hw)
    if family and not (chosen.match.pi_board or chosen.match.chip):
        said = "; ".join(missed) if missed else "no profile is for this board or chip"
        disk = chosen.nominal.disk_read_mb_s
        assumes = (f"a {chosen.memory.reserve_mib} MiB memory reserve, {chosen.runtime.threads or 'every core as'} "
                   f"threads, contexts up to {chosen.context.max_ctx_tokens} tokens"
                   + (f", a {disk:g} MB/s disk until this one is measured" if disk else ""))
        best = best.model_copy(update={"fell_back": f"{family} has no profile of its own ({said}): planned with "
                                                     f"{chosen.id}, the generic one ({assumes}); give --profile ID "
                                                     "for a closer one"})
    return best


def _family(hw: HardwareInfo) -> str | None:
    """The board or chip family a specific profile could be for: a Raspberry Pi's model, an Apple chip."""
    if hw.raspberry_pi:
        return f"this {hw.raspberry_pi.model} ({hw.memory_limit_bytes / GIB:.1f} GiB)"
    if hw.apple:
        return f"this {hw.apple.chip} ({hw.memory_limit_bytes / GIB:.1f} GiB)"
    return None


def _same_family(profile: DeviceProfile, hw: HardwareInfo) -> bool:
    """Whether a profile is for this machine's board or chip (whatever its memory)."""
    m = profile.match
    if m.pi_board is not None:
        return hw.raspberry_pi is not None and hw.raspberry_pi.board == m.pi_board
    if m.chip is not None:
        return hw.apple is not None and bool(re.search(m.chip, hw.apple.chip or ""))
    return False
