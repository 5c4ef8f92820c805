"""GGUF model files: header reading over any byte source, and ``ModelInfo``."""

from __future__ import annotations

import os

from nodeagent.modelfile.header import GGUFHeader, read_header
from nodeagent.modelfile.info import ModelInfo, model_info
from nodeagent.modelfile.source import ByteSource, BytesSource, FileSource, RangeSource

__all__ = ["ByteSource", "BytesSource", "FileSource", "GGUFHeader", "ModelInfo", "RangeSource",
           "inspect_file", "inspect_source", "model_info", "read_header"]


def inspect_source(source: ByteSource) -> ModelInfo:
    return model_info(read_header(source))


def inspect_file(path: str | os.PathLike[str]) -> ModelInfo:
    with FileSource(path) as source:
        return inspect_source(source)
