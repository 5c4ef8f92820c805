"""cgroup v2 memory and CPU limits of this process."""

from __future__ import annotations

from nodeagent.hardware.system import SystemSource
from nodeagent.hardware.types import CgroupLimits

ROOT = "/sys/fs/cgroup"


def _int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_dirs(sys: SystemSource) -> list[str]:
    """This process's cgroup directory, then the namespace root (inside containers)."""
    dirs = []
    for line in (sys.read_text("/proc/self/cgroup") or "").splitlines():
        if line.startswith("0::"):
            path = line[3:].strip().rstrip("/")
            if path and path != "/":
                dirs.append(ROOT + path)
    dirs.append(ROOT)
    return dirs


def probe_cgroup(sys: SystemSource) -> CgroupLimits | None:
    """Limits from cgroup v2, or None when no limit is set anywhere we can see."""
    for d in _cgroup_dirs(sys):
        mem_max_text = sys.read_text(f"{d}/memory.max")
        cpu_text = sys.read_text(f"{d}/cpu.max")
        if mem_max_text is None and cpu_text is None:
            continue
        mem_max = _int_or_none(mem_max_text)
        cpu_cores = None
        if cpu_text:
            parts = cpu_text.split()
            quota = _int_or_none(parts[0]) if parts else None
            period = _int_or_none(parts[1]) if len(parts) > 1 else 100000
            if quota and period:
                cpu_cores = quota / period
        if mem_max is None and cpu_cores is None:
            continue
        return CgroupLimits(memory_max_bytes=mem_max,
                            memory_current_bytes=_int_or_none(sys.read_text(f"{d}/memory.current")),
                            cpu_max_cores=cpu_cores)
    return None
