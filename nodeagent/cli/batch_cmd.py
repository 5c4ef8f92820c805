"""`nodeagent batch create|show|list|cancel|results`: the OpenAI Batch API from the shell, on the broker itself
(the same files and batches any node's /v1/batches serves; no server needed)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from nodeagent.cli.common import App, json_option, setting_option
from nodeagent.output import print_json, print_table

broker_option = setting_option("broker")
DONE = ("completed", "failed", "expired", "cancelled")


def _service(app: App, broker: str | None) -> Any:
    from nodeagent.broker.open import open_broker
    from nodeagent.fleet.batches import Batches

    config = app.config.with_flags({"broker": broker})
    return Batches(open_broker(config.broker, config.state_dir, config=config), max_bytes=config.max_batch_bytes,
                   keep_s=config.result_retention_s, takeover_s=config.batch_takeover_s)


def _show(batch: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(batch)
        return
    c = batch["request_counts"]
    rows = [("batch", batch["id"]), ("status", batch["status"]), ("endpoint", batch["endpoint"]),
            ("requests", f"{c['completed']} completed, {c['failed']} failed of {c['total']}"),
            ("input file", batch["input_file_id"]), ("output file", batch["output_file_id"] or "-"),
            ("error file", batch["error_file_id"] or "-"),
            ("expires", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(batch["expires_at"])))]
    for e in ((batch.get("errors") or {}).get("data") or [])[:10]:
        rows.append((f"line {e['line']}", f"{e['code']}: {e['message']}"))
    print_table(("field", "value"), rows, title="Batch")


def _wait(service: Any, batch: dict[str, Any], quiet: bool) -> dict[str, Any]:
    """Poll until the batch ends, with a progress bar on stderr (none with --json)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), disable=quiet) as bar:
        shown = bar.add_task(batch["status"], total=batch["request_counts"]["total"] or None)
        while batch["status"] not in DONE:
            time.sleep(0.5)
            batch = service.get(batch["id"])
            c = batch["request_counts"]
            bar.update(shown, description=batch["status"], total=c["total"] or None,
                       completed=c["completed"] + c["failed"])
    return batch


@click.group("batch")
def batch() -> None:
    """Batches of requests on the fleet's queue (OpenAI's Batch API): a JSONL of {custom_id, method, url, body}."""


@batch.command("create")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--endpoint", required=True, help="The route every line calls: /v1/chat/completions, "
              "/v1/completions, /v1/extract or /v1/classify.")
@click.option("--model", help="Run every line on nodes serving this model (a chat line's own model wins).")
@click.option("--window", "completion_window", default="24h", show_default=True,
              help="The completion window: 24h, or <n>s|m|h|d up to 7d.")
@click.option("--metadata", "metadata", multiple=True, metavar="KEY=VALUE", help="Metadata, repeatable.")
@click.option("--wait", is_flag=True, help="Wait for the batch to end, with a progress bar.")
@broker_option
@json_option
@click.pass_obj
def create(app: App, file: Path, endpoint: str, model: str | None, completion_window: str,
           metadata: tuple[str, ...], wait: bool, broker: str | None, as_json: bool) -> None:
    """Upload FILE and start a batch of its requests."""
    from nodeagent.errors import UsageError

    meta = {}
    for item in metadata:
        if "=" not in item:
            raise UsageError(f"--metadata {item!r} is not KEY=VALUE")
        key, value = item.split("=", 1)
        meta[key] = value
    service = _service(app, broker)
    service.check(endpoint, completion_window)
    data = file.read_bytes()
    if len(data) > service.max_bytes:
        raise UsageError(f"{file} is {len(data)} bytes, over the limit of {service.max_bytes}",
                         hint="split it, or raise NODEAGENT_MAX_BATCH_BYTES")
    uploaded = service.put_file(data, file.name, "batch")
    made = service.create(uploaded["id"], endpoint, completion_window, meta or None, model=model)
    if wait and made["status"] not in DONE:
        made = _wait(service, made, as_json)
    _show(made, as_json)
    if made["status"] == "failed":
        sys.exit(1)


@batch.command("show")
@click.argument("batch_id")
@broker_option
@json_option
@click.pass_obj
def show(app: App, batch_id: str, broker: str | None, as_json: bool) -> None:
    """A batch: its status, counts, files and, for a failed one, its bad lines."""
    _show(_service(app, broker).get(batch_id), as_json)


@batch.command("list")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 100))
@click.option("--after", help="The batch id the previous page ended with.")
@broker_option
@json_option
@click.pass_obj
def list_batches(app: App, limit: int, after: str | None, broker: str | None, as_json: bool) -> None:
    """Batches, newest first."""
    rows = _service(app, broker).list(after, limit)
    if as_json:
        print_json(rows)
        return
    print_table(("batch", "status", "endpoint", "completed", "failed", "total", "created"),
                [(b["id"], b["status"], b["endpoint"], b["request_counts"]["completed"],
                  b["request_counts"]["failed"], b["request_counts"]["total"],
                  time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b["created_at"]))) for b in rows],
                title="Batches")


@batch.command("cancel")
@click.argument("batch_id")
@broker_option
@json_option
@click.pass_obj
def cancel(app: App, batch_id: str, broker: str | None, as_json: bool) -> None:
    """Stop a batch's unstarted requests; running ones finish (recorded in the fleet's event log)."""
    from nodeagent.cli.common import operator
    from nodeagent.fleet import controls

    service = _service(app, broker)
    _show(controls.cancel_batch(service.broker, batch_id, operator(), service), as_json)


@batch.command("results")
@click.argument("batch_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write to this file.")
@click.option("--errors", is_flag=True, help="The error file instead of the output file.")
@broker_option
@json_option
@click.pass_obj
def results(app: App, batch_id: str, output: Path | None, errors: bool, broker: str | None, as_json: bool) -> None:
    """The output (or error) file of an ended batch, as JSONL in input order."""
    from nodeagent.errors import UsageError

    service = _service(app, broker)
    b = service.get(batch_id)
    file_id = b["error_file_id" if errors else "output_file_id"]
    if file_id is None:
        what = "error" if errors else "output"
        raise UsageError(f"batch {batch_id} ({b['status']}) has no {what} file" +
                         ("" if b["status"] in DONE else " yet: it has not ended"),
                         hint=f"see 'nodeagent batch show {batch_id}'")
    if output:  # every answer of the batch: its owner's only, as the queue it came from
        from nodeagent.private import private_file

        out = private_file(output).open("wb")
    else:
        out = sys.stdout.buffer
    n = 0
    try:
        for chunk in service.content(file_id):
            out.write(chunk)
            n += chunk.count(b"\n")
    finally:
        if output:
            out.close()
    if output and as_json:
        print_json({"file": str(output), "lines": n, "file_id": file_id})
    elif output:
        print(f"{n} lines written to {output}", file=sys.stderr)
