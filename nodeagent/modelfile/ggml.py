"""ggml tensor types: block sizes, type sizes and names (from the gguf package, imported when first asked: the
package imports numpy, which a command that reads no model need not pay for at its start)."""

from __future__ import annotations

import functools


@functools.cache
def ggml_types() -> dict[int, tuple[str, int, int]]:
    """Type id -> (name, elements per block, bytes per block)."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): (t.name, block, size) for t, (block, size) in GGML_QUANT_SIZES.items()}


def type_name(type_id: int) -> str:
    types = ggml_types()
    return types[type_id][0] if type_id in types else f"type{type_id}"


def type_id(name: str) -> int:
    from gguf.constants import GGMLQuantizationType

    return int(GGMLQuantizationType[name.upper()])


def file_type_label(file_type: int | None) -> str | None:
    """``general.file_type`` as a quant label, e.g. 15 -> ``Q4_K_M``."""
    if file_type is None:
        return None
    from gguf.constants import LlamaFileType

    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return f"unknown({file_type})"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")
