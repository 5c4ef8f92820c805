"""The one place benchmark results are written and read back: benchmarks/results/<name>.json (the data) and,
for the summaries people read, <name>.md, which the README's generated section quotes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, data: Any, markdown: str | None = None, folder: Path = RESULTS,
                  indent: int = 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(data, indent=indent) + "\n")
    if markdown is not None:
        (folder / f"{name}.md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")


def read_results(name: str, folder: Path = RESULTS) -> Any:
    return json.loads((folder / f"{name}.json").read_text())


def rewrite_markdown(name: str, render: Callable[[Any], str], folder: Path = RESULTS) -> None:
    """The summary rendered again from the saved data (no new measurement)."""
    (folder / f"{name}.md").write_text(render(read_results(name, folder)))
