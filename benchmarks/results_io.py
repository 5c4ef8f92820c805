"""The one place benchmark results are written: benchmarks/results/<name>.json (the data) and <name>.md (the
summary for people), which the README's generated section reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, data: Any, markdown: str, folder: Path = RESULTS) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (folder / f"{name}.md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")
