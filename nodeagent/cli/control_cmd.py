"""`nodeagent node hold|resume` and `nodeagent queue pause|resume`: an operator's hand on the fleet from the shell,
through the operator API the page uses (fleet/controls.py), each action recorded with who took it."""

from __future__ import annotations

from typing import Any, Callable

import click

from nodeagent.cli.common import App, broker_option, json_option, open_queue, operator
from nodeagent.output import print_json, print_lines


@click.group("node")
def node() -> None:
    """Hold a node (it claims no new task; what it runs finishes) or let it work again."""


@click.group("queue")
def queue() -> None:
    """Pause a queue (no node claims from it; tasks may still be queued) or resume it."""


def _command(group: click.Group, name: str, argument: str, act: Callable[[Any, str, str], None], done: str,
             doc: str) -> None:
    """``group name ARGUMENT``: ``act(broker, ARGUMENT, who)`` through the operator API, and what it did."""

    @group.command(name, help=doc)
    @click.argument(argument)
    @broker_option
    @json_option
    @click.pass_obj
    def command(app: App, broker: str | None, as_json: bool, **args: str) -> None:
        target = args[argument]
        act(open_queue(app, broker), target, operator())
        print_json({argument: target, "done": done}) if as_json else print_lines([f"{target}: {done}"])


def _controls() -> Any:
    from nodeagent.fleet import controls

    return controls


_command(node, "hold", "node_id", lambda q, n, by: _controls().hold_node(q, n, True, by), "held",
         "NODE_ID claims no new task until resumed (see `nodeagent status` for the ids).")
_command(node, "resume", "node_id", lambda q, n, by: _controls().hold_node(q, n, False, by), "resumed",
         "NODE_ID claims tasks again.")
_command(queue, "pause", "queue", lambda q, n, by: _controls().pause_queue(q, n, True, by), "paused",
         "No node claims from QUEUE (a task type, e.g. extract.v1; its batches pause with it) until resumed.")
_command(queue, "resume", "queue", lambda q, n, by: _controls().pause_queue(q, n, False, by), "resumed",
         "Nodes claim from QUEUE again.")
