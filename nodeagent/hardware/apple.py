"""Apple Silicon: chip, performance/efficiency cores, unified memory, Metal working set.

The GPU may use up to Metal's ``recommendedMaxWorkingSetSize``. We read it from
MLX when installed; else ``iogpu.wired_limit_mb`` when an admin set it; else
the documented fraction (about 2/3 of RAM up to 36 GiB, 3/4 above), labelled
as an estimate.
"""

from __future__ import annotations

from nodeagent.hardware.system import SystemSource
from nodeagent.hardware.types import AppleSilicon

GIB = 1 << 30


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def estimated_working_set(ram_bytes: int) -> int:
    return ram_bytes * 2 // 3 if ram_bytes <= 36 * GIB else ram_bytes * 3 // 4


def probe_apple(sys: SystemSource) -> AppleSilicon | None:
    if sys.system() != "darwin" or sys.machine() != "arm64":
        return None
    chip = sys.sysctl("machdep.cpu.brand_string") or "Apple Silicon"
    ram = _int(sys.sysctl("hw.memsize")) or sys.memory().total_bytes
    perf = eff = None
    levels = _int(sys.sysctl("hw.nperflevels")) or 0
    if levels >= 1:
        perf = _int(sys.sysctl("hw.perflevel0.physicalcpu"))
    if levels >= 2:
        eff = _int(sys.sysctl("hw.perflevel1.physicalcpu"))
    working_set = sys.metal_working_set()
    source = "mlx"
    if not working_set:
        wired_mb = _int(sys.sysctl("iogpu.wired_limit_mb"))
        if wired_mb:
            working_set, source = wired_mb << 20, "sysctl iogpu.wired_limit_mb"
        else:
            working_set, source = estimated_working_set(ram), "estimate"
    return AppleSilicon(chip=chip, unified_memory_bytes=ram, performance_cores=perf, efficiency_cores=eff,
                        metal_working_set_bytes=working_set, metal_working_set_source=source)


def apple_cpu_features(sys: SystemSource) -> list[str]:
    found = {"neon"}
    if sys.sysctl("hw.optional.arm.FEAT_DotProd") == "1":
        found.add("dotprod")
    if sys.sysctl("hw.optional.arm.FEAT_I8MM") == "1":
        found.add("i8mm")
    return sorted(found)
