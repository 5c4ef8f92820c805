"""`nodeagent worker`: a node serving the fleet's queue (its models fixed, or those the scheduler assigns it)."""

from __future__ import annotations

from typing import Any

import click

from nodeagent.cli.common import (
    FLEET_FLAGS,
    PLANNER_FLAGS,
    App,
    json_option,
    model_options,
    open_queue,
    say,
    setting_options,
)
from nodeagent.output import print_json
from nodeagent.service.signals import on_signals
from nodeagent.urls import shown


@click.command("worker")
@model_options("task")
@setting_options(*FLEET_FLAGS, "keep_alive_s")
@click.option("--burst", is_flag=True, help="Exit once no task of these types is ready, delayed or leased.")
@click.option("--follow", is_flag=True, help="Hold the models the scheduler assigns this node (and any --model to "
                                             "begin with); on SQLite, run the scheduler's rounds too while no other "
                                             "process leads.")
@setting_options("allow_pull")
@setting_options(*PLANNER_FLAGS)
@json_option
@click.pass_obj
def worker(app: App, models: tuple[str, ...], pins: tuple[str, ...], burst: bool, follow: bool, as_json: bool,
           **settings: Any) -> None:
    """Serve tasks from the queue on MODEL: register, heartbeat, claim, run, write results. SIGTERM drains."""
    from nodeagent.fleet.registration import build_set_worker, build_worker, parse_types

    if follow:
        _follow(app, models, pins, burst, as_json, settings)
        return
    nodes, pinned, aliases = app.loadable_nodes(models, pins, **settings)
    node = nodes[0]
    config = node.config
    q = open_queue(app, config.broker, check=False)  # a broker that is not up yet is waited for, as any outage
    if len(nodes) == 1 and not pinned:
        w, held = build_worker(node, q, config, parse_types(config.types), burst=burst), node
        what = f"{node.model} ({node.plan.quant}, {node.plan.backend})"
    else:
        from nodeagent.fleet.registration import model_set

        mset = model_set(nodes, pinned, config, aliases)
        w, held = build_set_worker(nodes, pinned, q, config, parse_types(config.types), burst=burst, models=mset)
        what = "the model set " + ", ".join(f"{n.model}{' (pinned)' if n.model in pinned else ''}" for n in nodes)
    _serve(w, held, q, f"{what} serving {', '.join(w.config.queues)} from {shown(q.url)}", as_json)


def _serve(w: Any, held: Any, q: Any, what: str, as_json: bool) -> None:
    """Say what the worker serves, run it until drained (SIGTERM), close what it held, say how it went. Under systemd
    (a `service install --role worker`): READY=1 once its model is loaded, WATCHDOG=1 while its loop runs,
    STOPPING=1 when it drains."""
    from nodeagent.service.notify import Notifier

    notifier = Notifier()
    on_signals(w.stop, also=notifier.stopping)
    say(f"worker {w.config.node_id}: {what}")
    notifier.ready(f"worker {w.config.node_id}: {what}")
    notifier.start_watchdog(lambda: not w.stopped.is_set())
    summary = w.run()
    held.close()
    q.close()
    if as_json:
        print_json({"node": w.config.node_id, **summary})
    else:
        say(f"worker {w.config.node_id} stopped: {summary['completed']} completed, {summary['failed']} failed")


def _follow(app: App, models: tuple[str, ...], pins: tuple[str, ...], burst: bool, as_json: bool,
            settings: dict[str, Any]) -> None:
    from nodeagent.fleet.registration import build_follow_worker, parse_types

    base = app.node(None, **dict(settings))  # this command's settings and device, no model yet
    config = base.config
    nodes = [app.node(m, **dict(settings)) for m in models]
    for n in nodes:  # (as loadable_nodes: refused at start, not at their first task)
        n.check_loadable()
    q = open_queue(app, config.broker, check=False)

    def make_node(model: str, _planned: dict[str, Any]) -> Any:
        return app.node(model, **dict(settings))  # planned here, by this node's own planner (the arbiter)

    w, held = build_follow_worker(base.device, make_node, q, config, nodes, set(pins), parse_types(config.types),
                                  burst=burst)
    _serve(w, held, q, "following the scheduler's assignments"
           + (f" (holding {', '.join(models)} to begin with)" if models else "")
           + f", serving {', '.join(w.config.queues)} from {shown(q.url)}"
           + ("; this worker runs the scheduler's rounds while no other process leads" if q.url.startswith("sqlite")
              else ""), as_json)
