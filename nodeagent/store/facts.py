"""Header facts: what the planner needs from a GGUF header, stored as JSON.

Two uses, one format:
- the catalog records the facts of each file it can (``models/facts/<model id>/<file name>.json``), so a catalog
  model can be planned with no network: a Pi on an isolated network, a person choosing hardware on a plane.
  ``scripts/catalog-facts`` regenerates them from the real headers whenever the network is there;
- a header read over the network is cached (``<cache_dir>/headers/<repo>/<file>.json``), so the next plan of
  that file reads nothing.

The facts are a ``ModelInfo`` (shapes, types and bytes of every tensor, heads, KV heads, head sizes, the
sliding-window pattern, vocabulary and trained context) without the tokenizer and chat template.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from nodeagent.datafiles import data_dir
from nodeagent.modelfile.info import ModelInfo, TensorSpec

log = logging.getLogger(__name__)
FACTS_VERSION = 2  # 2: merges_count (the planner charges BPE merges apart)


def to_facts(info: ModelInfo) -> dict[str, Any]:
    """The facts of a header, compact: tensors as [name, shape, type, bytes] rows."""
    data = info.model_dump(mode="json")
    data["tensors"] = [[t.name, list(t.shape), t.type, t.n_bytes] for t in info.tensors]
    return {"facts_version": FACTS_VERSION, **data}


def from_facts(data: dict[str, Any], source: str) -> ModelInfo:
    body = {k: v for k, v in data.items() if k != "facts_version"}
    body["tensors"] = [TensorSpec(name=n, shape=tuple(s), type=t, n_bytes=b) for n, s, t, b in body["tensors"]]
    body["source"] = source
    return ModelInfo(**body)


def _read(path: Path | Any, source: str) -> ModelInfo | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("facts_version") != FACTS_VERSION:
            return None
        return from_facts(data, source)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
        log.warning("ignoring unreadable header facts %s: %s", path, exc)
        return None


def catalog_facts_path(model_id: str, file_name: str) -> Any:
    return data_dir("models") / "facts" / model_id / f"{file_name}.json"


def catalog_facts(model_id: str, file_name: str, source: str) -> ModelInfo | None:
    """The facts the catalog recorded for this file, or None."""
    return _read(catalog_facts_path(model_id, file_name), source)


def _cache_path(cache_dir: Path, repo: str, file_name: str) -> Path:
    return cache_dir / "headers" / repo / f"{file_name}.json"


def cached_facts(cache_dir: Path, repo: str, file_name: str, source: str) -> ModelInfo | None:
    return _read(_cache_path(cache_dir, repo, file_name), source)


def write_facts(path: Path, info: ModelInfo) -> None:
    """Write atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".facts-")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(to_facts(info), fh, separators=(",", ":"))
        fh.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def cache_facts(cache_dir: Path, repo: str, file_name: str, info: ModelInfo) -> None:
    try:
        write_facts(_cache_path(cache_dir, repo, file_name), info)
    except OSError as exc:  # a read-only cache costs a network read next time, nothing more
        log.warning("could not cache the header of %s/%s: %s", repo, file_name, exc)
