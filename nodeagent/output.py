"""One output layer: tables for people, JSON for programs.

Data goes to stdout; logs, hints and errors go to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from pydantic import BaseModel

from nodeagent.units import format_bytes  # noqa: F401  (printing sizes is part of the output layer)


def to_jsonable(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(to_jsonable(obj), indent=2, sort_keys=False) + "\n")


def print_json_line(obj: Any) -> None:
    """One JSON document on one line, flushed at once: a stream a program follows line by line (NDJSON)."""
    sys.stdout.write(json.dumps(to_jsonable(obj), sort_keys=False) + "\n")
    sys.stdout.flush()


def console() -> Any:
    """The rich Console on stdout that tables print to."""
    from rich.console import Console  # imported lazily: keeps `--help` fast

    out = Console(file=sys.stdout, highlight=False)
    if not out.is_terminal:  # piped: do not squeeze tables into 80 columns
        out.width = max(out.width, 160)
    return out


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None) -> Any:
    """A rich Table of ``rows`` (data, never markup), for a view of several tables; print_table prints one."""
    from rich.markup import escape
    from rich.table import Table

    out = Table(title=title, title_justify="left", show_lines=False, header_style="bold")
    for h in headers:
        out.add_column(h, overflow="fold")
    for row in rows:
        out.add_row(*("-" if v is None else escape(str(v)) for v in row))  # data, never markup
    return out


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None) -> None:
    console().print(table(headers, rows, title))


def print_pairs(pairs: Iterable[tuple[str, Any]], title: str | None = None) -> None:
    print_table(("field", "value"), pairs, title=title)


def print_lines(lines: Iterable[str]) -> None:
    for line in lines:
        sys.stdout.write(line + "\n")
