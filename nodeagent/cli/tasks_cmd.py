"""`nodeagent submit extract|classify` and `nodeagent tasks show`: a task onto the fleet's queue, and how one went."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from nodeagent.cli.common import App, broker_option, json_option, open_queue, operator, options, task_input_options
from nodeagent.cli.run_cmd import classify_fields, classify_options, read_text
from nodeagent.errors import NotFoundError, UsageError
from nodeagent.node import make_task
from nodeagent.output import print_json, print_lines, print_table

submit_options = options(
    click.option("--model", "model", help="Only nodes serving this model (catalog name or sha256) take it."),
    *task_input_options,
    click.option("--idempotency-key", help="The same key returns the first task's id and enqueues nothing."),
    click.option("--deadline", type=float, help="Seconds from now after which the task is not started."),
    click.option("--wait", "wait_s", type=float, help="Wait up to this many seconds for the Result and print it."),
    broker_option,
    json_option,
)


@click.group("submit")
def submit() -> None:
    """Queue a typed task (the same inputs as `nodeagent run`) for the fleet's workers."""


def _submit(app: App, task: Any, model: str | None, idempotency_key: str | None, deadline: float | None,
            wait_s: float | None, broker: str | None, as_json: bool) -> None:
    from datetime import timedelta

    from nodeagent.cli.run_cmd import show
    from nodeagent.client import Client

    client = Client(open_queue(app, broker))
    task_id = client.submit(task, model=model, idempotency_key=idempotency_key,
                            deadline=timedelta(seconds=deadline) if deadline else None)
    if wait_s is None:
        if as_json:
            print_json({"task_id": task_id, "queue": task.type})
        else:
            click.echo(task_id)
        return
    result = client.wait(task_id, timeout=wait_s)
    if as_json:
        print_json({"task_id": task_id, "result": result})
    else:
        show(result, False)


@submit.command("extract")
@submit_options
@click.option("--schema", "schema_file", required=True, type=click.Path(dir_okay=False),
              help="JSON Schema file of the object to extract.")
@click.pass_obj
def submit_extract(app: App, model: str | None, text: str | None, file: str | None, instructions: str | None,
                   task_id: str | None, idempotency_key: str | None, deadline: float | None, wait_s: float | None,
                   broker: str | None, as_json: bool, schema_file: str) -> None:
    """Queue an extraction."""
    try:
        schema = json.loads(Path(schema_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read the schema {schema_file}: {exc}") from None
    task = make_task("extract", input=read_text(app, text, file), schema=schema, instructions=instructions,
                     id=task_id, idempotency_key=idempotency_key)
    _submit(app, task, model, idempotency_key, deadline, wait_s, broker, as_json)


@submit.command("classify")
@submit_options
@classify_options
@click.pass_obj
def submit_classify(app: App, model: str | None, text: str | None, file: str | None, instructions: str | None,
                    task_id: str | None, idempotency_key: str | None, deadline: float | None, wait_s: float | None,
                    broker: str | None, as_json: bool, labels: str, multi_label: bool, threshold: str | None,
                    calibrate: str | None, answer: str | None, length_norm: bool,
                    examples_file: str | None) -> None:
    """Queue a classification."""
    task = make_task("classify", input=read_text(app, text, file), instructions=instructions, id=task_id,
                     idempotency_key=idempotency_key,
                     **classify_fields(labels, multi_label, threshold, calibrate, answer, length_norm, examples_file))
    _submit(app, task, model, idempotency_key, deadline, wait_s, broker, as_json)


@click.group("tasks")
def tasks() -> None:
    """Tasks in the queue."""


@tasks.command("show")
@click.argument("task_id")
@broker_option
@json_option
@click.pass_obj
def tasks_show(app: App, task_id: str, broker: str | None, as_json: bool) -> None:
    """A task's state, attempts and history, and its Result once it has one."""
    view = open_queue(app, broker).get(task_id)
    if view is None:
        raise NotFoundError(f"no task {task_id}", hint="check the id and the broker (--broker)")
    if as_json:
        print_json(view)
        return
    rows: list[tuple[str, Any]] = [("task", f"{view.id} ({view.queue})"), ("state", view.state),
                                   ("attempts", f"{view.attempts} of {view.max_attempts}")]
    if view.model:
        rows.append(("model", view.model))
    for h in view.history:
        rows.append((f"attempt {h.attempt}", f"{h.node or '-'}: " + (f"{h.error.code}: {h.error.message}"
                                                                    if h.error else "ok" if h.ended_at else "running")))
    if view.result is not None:
        out = view.result.output
        rows.append(("result", view.result.status + ("" if out is None else f": {json.dumps(_jsonable(out))}")))
    print_table(("field", "value"), rows, title="Task")


@tasks.command("cancel")
@click.argument("task_ids", nargs=-1, required=True)
@broker_option
@json_option
@click.pass_obj
def tasks_cancel(app: App, task_ids: tuple[str, ...], broker: str | None, as_json: bool) -> None:
    """Cancel tasks that wait or run (a running one's node stops it at its next token); recorded in the fleet's
    event log."""
    from nodeagent.fleet import controls

    q = open_queue(app, broker)
    by = operator()
    done = {i: controls.cancel_task(q, i, by) for i in task_ids}
    if as_json:
        print_json({"cancelled": [i for i, ok in done.items() if ok],
                    "not_cancelled": [i for i, ok in done.items() if not ok]})
    else:
        print_lines([f"{i}: {'cancelled' if ok else 'neither waiting nor running'}" for i, ok in done.items()])


def _jsonable(out: Any) -> Any:
    return out.model_dump() if hasattr(out, "model_dump") else out
