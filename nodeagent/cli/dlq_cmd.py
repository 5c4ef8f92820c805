"""`nodeagent dlq list|replay`: the dead letters, and sending them back (the operator API the page uses too)."""

from __future__ import annotations

import click

from nodeagent.cli.common import App, broker_option, json_option, open_queue, operator
from nodeagent.errors import UsageError
from nodeagent.output import print_json, print_lines, print_table


@click.group("dlq")
def dlq() -> None:
    """The dead-letter queue: tasks that failed for good, with their attempt history."""


@dlq.command("list")
@click.option("--queue", help="Only this task type, e.g. classify.v1.")
@broker_option
@json_option
@click.pass_obj
def dlq_list(app: App, queue: str | None, broker: str | None, as_json: bool) -> None:
    dead = open_queue(app, broker).dead(queue)
    if as_json:
        print_json(dead)
        return
    print_table(("task", "queue", "attempts", "last error"),
                [(v.id, v.queue, v.attempts, f"{v.last_error.code}: {v.last_error.message}" if v.last_error else "-")
                 for v in dead], title="Dead letters")


@dlq.command("replay")
@click.argument("task_ids", nargs=-1)
@click.option("--all", "replay_all", is_flag=True, help="Every dead letter (of --queue).")
@click.option("--queue", help="With --all: only this task type.")
@broker_option
@json_option
@click.pass_obj
def dlq_replay(app: App, task_ids: tuple[str, ...], replay_all: bool, queue: str | None, broker: str | None,
               as_json: bool) -> None:
    """Send dead tasks back to their queue with fresh attempts (their history is kept)."""
    from nodeagent.fleet import controls

    if not task_ids and not replay_all:
        raise UsageError("name the tasks to replay, or pass --all")
    q = open_queue(app, broker)
    by = operator()
    done = {i: controls.replay_task(q, i, by) for i in task_ids}
    if replay_all:
        done.update({i: True for i in controls.replay_dead(q, by, queue=queue)})
    if as_json:
        print_json({"replayed": [i for i, ok in done.items() if ok],
                    "not_dead": [i for i, ok in done.items() if not ok]})
    else:
        print_lines([f"{i}: {'replayed' if ok else 'not a dead letter'}" for i, ok in done.items()])
