"""probe(): what machine this is. One module per platform, all reading through a SystemSource. How the machine
is doing now (heat, power, pressure) is ``health.py``'s reading, not the probe's."""

from __future__ import annotations

from pathlib import Path

from nodeagent.hardware.apple import apple_cpu_features, probe_apple
from nodeagent.hardware.cgroup import probe_cgroup
from nodeagent.hardware.linux import cpu_features, cpu_model
from nodeagent.hardware.raspberrypi import probe_raspberry_pi
from nodeagent.hardware.system import LiveSystem, RecordedSystem, SystemSource
from nodeagent.hardware.types import HardwareInfo

__all__ = ["HardwareInfo", "LiveSystem", "RecordedSystem", "SystemSource", "probe"]


def probe(sys: SystemSource | None = None, disk_path: str | None = None, state_dir: Path | None = None) -> HardwareInfo:
    """``disk_path``: the model folder, whose free space and storage (device, kind, and the read speed measured
    before, kept in ``state_dir``'s storage.json) are reported; nothing is measured here."""
    from nodeagent.hardware.storage import storage_info

    sys = sys or LiveSystem()
    os_name = sys.system()
    mem = sys.memory()
    apple = probe_apple(sys)
    linux = os_name == "linux"
    return HardwareInfo(
        os=os_name,
        os_release=sys.release(),
        arch=sys.machine(),
        cpu_model=apple.chip if apple else (cpu_model(sys) if linux else None),
        cpu_features=apple_cpu_features(sys) if apple else (cpu_features(sys, sys.machine()) if linux else []),
        cores_logical=sys.cpu_count(True) or 1,
        cores_physical=sys.cpu_count(False),
        ram_total_bytes=apple.unified_memory_bytes if apple else mem.total_bytes,
        ram_available_bytes=mem.available_bytes,
        swap_total_bytes=mem.swap_total_bytes,
        swap_free_bytes=mem.swap_free_bytes,
        cgroup=probe_cgroup(sys) if linux else None,
        disk_path=disk_path,
        disk_free_bytes=sys.disk_free(disk_path) if disk_path else None,
        storage=storage_info(sys, disk_path, state_dir) if disk_path else None,
        apple=apple,
        raspberry_pi=probe_raspberry_pi(sys) if linux else None,
        gpus=sys.nvidia_gpus(),
        llama_cpp=sys.llama_cpp(),
    )
