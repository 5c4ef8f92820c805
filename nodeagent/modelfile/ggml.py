"""ggml tensor types: block sizes, type sizes and names (from the gguf package)."""

from __future__ import annotations

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

# type id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    int(t): (t.name, block, size) for t, (block, size) in GGML_QUANT_SIZES.items()
}


def type_name(type_id: int) -> str:
    return GGML_TYPES[type_id][0] if type_id in GGML_TYPES else f"type{type_id}"


def type_id(name: str) -> int:
    return int(GGMLQuantizationType[name.upper()])


def file_type_label(file_type: int | None) -> str | None:
    """``general.file_type`` as a quant label, e.g. 15 -> ``Q4_K_M``."""
    if file_type is None:
        return None
    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return f"unknown({file_type})"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")
