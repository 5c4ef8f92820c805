"""`nodeagent models ...`: the catalog (and, later, local models)."""

from __future__ import annotations

import click

from nodeagent.catalog import load_catalog
from nodeagent.cli.common import App, json_option
from nodeagent.output import format_bytes, print_json, print_table


@click.group("models")
def command() -> None:
    """Models: the catalog of known families and their quant ladders."""


@command.command("catalog")
@click.option("--family", help="Only this family.")
@json_option
@click.pass_obj
def catalog(app: App, family: str | None, as_json: bool) -> None:
    """List catalog models with each quant file, its size and where the size comes from."""
    models = [m for m in load_catalog().values() if family is None or m.family == family]
    if as_json:
        print_json(models)
        return
    rows = []
    for m in models:
        for f in m.files:
            size = format_bytes(f.size_bytes) + (" (est.)" if f.size_source == "estimate" else "")
            where = f"{f.repo}/{f.file_name}" if f.source == "hub" else f"pypi: {', '.join(f.packages)}"
            rows.append((m.id, f.quant, size, where))
        if m.mlx:
            rows.append((m.id, "mlx", "", ", ".join(f"{k}: {v}" for k, v in m.mlx.items())))
    print_table(("model", "quant", "size", "source"), rows, title="Model catalog")
