"""The memory a plan is held to, per device kind."""

from __future__ import annotations

from nodeagent.hardware.types import HardwareInfo
from nodeagent.planner.types import Budget
from nodeagent.profiles import DeviceProfile


def budget_for(hw: HardwareInfo, profile: DeviceProfile) -> Budget:
    """Host: MemAvailable (or the cgroup's room) less the profile's reserve. GPU: Metal's working
    set on Apple Silicon (unified memory, so the host limit applies too), free VRAM on NVIDIA."""
    mem = profile.memory
    available = hw.memory_available_bytes
    source = "MemAvailable"
    if hw.cgroup and hw.cgroup.memory_max_bytes is not None and available < hw.ram_available_bytes:
        source = "cgroup memory.max - memory.current"
    host_limit = max(0, available - mem.reserve_bytes)
    gpu_limit = None
    kind = mem.budget
    if kind == "metal-working-set" and hw.apple:
        gpu_limit = hw.apple.metal_working_set_bytes
        source += f"; Metal working set ({hw.apple.metal_working_set_source})"
    elif kind == "gpu-free" and hw.gpus:
        gpu_limit = sum(g.memory_free_bytes or g.memory_total_bytes for g in hw.gpus)
        source += "; free GPU memory"
    elif kind != "host-available":
        kind = "host-available"  # the profile expects a GPU this machine does not have
    return Budget(kind=kind, host_limit_bytes=host_limit, gpu_limit_bytes=gpu_limit,
                  ram_total_bytes=hw.memory_limit_bytes, reserve_bytes=mem.reserve_bytes,
                  margin_bytes=mem.margin_bytes, source=source)
