"""Linux facts from /proc: the CPU model name."""

from __future__ import annotations

from nodeagent.hardware.system import SystemSource

# ARM "CPU part" codes (implementer 0x41, Arm Ltd) seen on Pis and Arm servers
ARM_PARTS = {
    "0xd03": "Cortex-A53", "0xd04": "Cortex-A35", "0xd05": "Cortex-A55", "0xd07": "Cortex-A57",
    "0xd08": "Cortex-A72", "0xd09": "Cortex-A73", "0xd0a": "Cortex-A75", "0xd0b": "Cortex-A76",
    "0xd0c": "Neoverse-N1", "0xd0d": "Cortex-A77", "0xd40": "Neoverse-V1", "0xd41": "Cortex-A78",
    "0xd44": "Cortex-X1", "0xd46": "Cortex-A510", "0xd47": "Cortex-A710", "0xd49": "Neoverse-N2",
    "0xd4f": "Neoverse-V2",
}


def cpuinfo_fields(text: str) -> dict[str, str]:
    """The first value of each key in /proc/cpuinfo."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line:
            key, _, value = line.partition(":")
            out.setdefault(key.strip(), value.strip())
    return out


def cpu_model(sys: SystemSource) -> str | None:
    text = sys.read_text("/proc/cpuinfo")
    if not text:
        return None
    fields = cpuinfo_fields(text)
    if fields.get("model name"):
        return fields["model name"]
    part = fields.get("CPU part", "").lower()
    if part in ARM_PARTS and fields.get("CPU implementer", "").lower() == "0x41":
        return f"ARM {ARM_PARTS[part]}"
    return fields.get("Hardware") or fields.get("cpu model") or None


# /proc/cpuinfo flag (x86 "flags", ARM "Features") -> the name llama.cpp's CPU backend uses
_FEATURES = {"avx2": "avx2", "avx512f": "avx512", "amx_int8": "amx", "asimd": "neon", "asimddp": "dotprod",
             "i8mm": "i8mm", "sve": "sve"}


def cpu_features(sys: SystemSource, machine: str) -> list[str]:
    text = sys.read_text("/proc/cpuinfo") or ""
    fields = cpuinfo_fields(text)
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    found = {name for flag, name in _FEATURES.items() if flag in flags}
    if machine in ("aarch64", "arm64"):
        found.add("neon")  # Advanced SIMD is mandatory on AArch64
    return sorted(found)
