"""Units for people: sizes stay integers in bytes until they are printed, here."""

from __future__ import annotations

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


def format_bytes(n: int | None) -> str:
    """Binary units, as llama.cpp and the OS report them."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"  # unreachable
