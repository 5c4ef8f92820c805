"""Raspberry Pi model, SoC and RAM from the device tree and the revision code.

Revision code layout (new style, bit 23 set), as documented in Raspberry Pi's
"Raspberry Pi revision codes" page: bits 0-3 revision, 4-11 type, 12-15
processor, 16-19 manufacturer, 20-22 memory size.
"""

from __future__ import annotations

from nodeagent.hardware.linux import cpuinfo_fields
from nodeagent.hardware.system import SystemSource
from nodeagent.hardware.types import RaspberryPi

BOARD_TYPES = {
    0x00: "A", 0x01: "B", 0x02: "A+", 0x03: "B+", 0x04: "2B", 0x06: "CM1", 0x08: "3B", 0x09: "Zero",
    0x0A: "CM3", 0x0C: "Zero W", 0x0D: "3B+", 0x0E: "3A+", 0x10: "CM3+", 0x11: "4B", 0x12: "Zero 2 W",
    0x13: "400", 0x14: "CM4", 0x15: "CM4S", 0x17: "5", 0x18: "CM5", 0x19: "500", 0x1A: "CM5 Lite",
}
SOCS = {0: "BCM2835", 1: "BCM2836", 2: "BCM2837", 3: "BCM2711", 4: "BCM2712"}
MEMORY_MB = {0: 256, 1: 512, 2: 1024, 3: 2048, 4: 4096, 5: 8192, 6: 16384}


def decode_revision(code: str) -> tuple[str | None, str | None, int | None]:
    """(board, soc, ram_bytes) from a new-style revision code such as 'c03114'."""
    try:
        value = int(code, 16)
    except ValueError:
        return None, None, None
    if not value & (1 << 23):  # old-style codes: boards from before 2016
        return None, None, None
    board = BOARD_TYPES.get((value >> 4) & 0xFF)
    soc = SOCS.get((value >> 12) & 0xF)
    mem = MEMORY_MB.get((value >> 20) & 0x7)
    return board, soc, mem * (1 << 20) if mem else None


def probe_raspberry_pi(sys: SystemSource) -> RaspberryPi | None:
    model = sys.read_text("/proc/device-tree/model") or sys.read_text("/sys/firmware/devicetree/base/model")
    model = (model or "").replace("\x00", "").strip()
    if not model.startswith("Raspberry Pi"):
        return None
    revision = cpuinfo_fields(sys.read_text("/proc/cpuinfo") or "").get("Revision")
    board, soc, ram = decode_revision(revision) if revision else (None, None, None)
    return RaspberryPi(model=model, revision=revision, board=board, soc=soc, ram_bytes=ram)
