"""The fleet from the shell: `worker`, `submit`, `tasks show`, `dlq list|replay`, `status [--fit MODEL] [--watch]`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import click

from nodeagent.broker.urls import shown
from nodeagent.cli.common import (
    FLEET_FLAGS,
    PLANNER_FLAGS,
    App,
    json_option,
    model_options,
    options,
    say,
    setting_option,
    setting_options,
    task_input_options,
)
from nodeagent.cli.run_cmd import classify_fields, classify_options, read_text
from nodeagent.errors import NotFoundError, UsageError
from nodeagent.node import make_task
from nodeagent.output import console, format_bytes, print_json, print_json_line, print_lines, print_table, table
from nodeagent.service.signals import on_signals

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 2.0  # `status --watch` refreshes this often unless --interval says


def _broker(app: App, url: str | None, check: bool = True):  # type: ignore[no-untyped-def]
    from nodeagent.broker.open import open_broker

    config = app.config.with_flags({"broker": url})
    return open_broker(config.broker, config.state_dir, check, config=config)


def _operator() -> str:
    """Who took an action from the shell, as the fleet's event log records it."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = "?"
    return f"cli {user}@{socket.gethostname()}"


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
    nodes, pinned, aliases = app.model_nodes(models, pins, **settings)
    node = nodes[0]
    config = node.config
    q = _broker(app, config.broker, check=False)  # a broker that is not up yet is waited for, as any outage
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
    q = _broker(app, config.broker, check=False)

    def make_node(model: str, _planned: dict[str, Any]) -> Any:
        return app.node(model, **dict(settings))  # planned here, by this node's own planner (the arbiter)

    w, held = build_follow_worker(base.device, make_node, q, config, nodes, set(pins), parse_types(config.types),
                                  burst=burst)
    _serve(w, held, q, "following the scheduler's assignments"
           + (f" (holding {', '.join(models)} to begin with)" if models else "")
           + f", serving {', '.join(w.config.queues)} from {shown(q.url)}"
           + ("; this worker runs the scheduler's rounds while no other process leads" if q.url.startswith("sqlite")
              else ""), as_json)


broker_option = setting_option("broker")
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

    client = Client(_broker(app, broker))
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
    view = _broker(app, broker).get(task_id)
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


def _jsonable(out: Any) -> Any:
    return out.model_dump() if hasattr(out, "model_dump") else out


@click.group("dlq")
def dlq() -> None:
    """The dead-letter queue: tasks that failed for good, with their attempt history."""


@dlq.command("list")
@click.option("--queue", help="Only this task type, e.g. classify.v1.")
@broker_option
@json_option
@click.pass_obj
def dlq_list(app: App, queue: str | None, broker: str | None, as_json: bool) -> None:
    dead = _broker(app, broker).dead(queue)
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
    q = _broker(app, broker)
    by = _operator()
    done = {i: controls.replay_task(q, i, by) for i in task_ids}
    if replay_all:
        done.update({i: True for i in controls.replay_dead(q, by, queue=queue)})
    if as_json:
        print_json({"replayed": [i for i, ok in done.items() if ok],
                    "not_dead": [i for i, ok in done.items() if not ok]})
    else:
        print_lines([f"{i}: {'replayed' if ok else 'not a dead letter'}" for i, ok in done.items()])


@click.command("status")
@broker_option
@click.option("--fit", "fit_model", help="Plan MODEL on every registered node's recorded hardware.")
@click.option("--watch", is_flag=True, help="Refresh the view every --interval seconds until Ctrl-C; with --json, "
                                            "one JSON document per line (NDJSON) at each refresh.")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.1), metavar="SECONDS",
              help=f"Seconds between refreshes with --watch (default {WATCH_INTERVAL_S:g}).")
@json_option
@click.pass_obj
def status(app: App, broker: str | None, fit_model: str | None, watch: bool, interval_s: float | None,
           as_json: bool) -> None:
    """The fleet: each node (model, context, slots, in flight, memory, guard, last heartbeat, lost or not) and
    each queue (ready, leased, delayed, dead, done, and how its depth moves). --watch refreshes it."""
    if interval_s is not None and not watch:
        raise UsageError("--interval sets how often --watch refreshes", hint="nodeagent status --watch --interval 5")
    q = _broker(app, broker)
    if watch:
        _watch(lambda: status_data(app, q, fit_model), fit_model, interval_s or WATCH_INTERVAL_S, as_json)
        return
    data = status_data(app, q, fit_model)
    if as_json:
        print_json(data)
        return
    console().print(status_view(data, fit_model))
    for alert in data["alerts"]:
        click.echo(f"alert: {alert}", err=True)


def status_data(app: App, q: Any, fit_model: str | None) -> dict[str, Any]:
    """What `status` shows, read now: the fleet from the broker, this host's memory ledger, and where
    ``fit_model`` fits."""
    from nodeagent.broker.base import lost_after
    from nodeagent.fleet.status import fit_rows, fleet_status
    from nodeagent.ledger import Ledger

    data = fleet_status(q, lost_after(app.config.heartbeat_s), app.config.clock_warn_s)
    data["ledger"] = Ledger(app.config.state_dir).entries()  # this host's planned memory, by process
    if fit_model:
        data["fit"] = fit_rows(q.nodes(), fit_model, app.config)
    return data


def status_view(data: dict[str, Any], fit_model: str | None) -> Any:
    """The tables of `status` (a rich Group): printed once, or re-rendered at each refresh by --watch. The alerts
    are not in it (they go to stderr, or under the tables of a watch)."""
    from rich.console import Group

    skew = len(data.get("versions") or {}) > 1  # a fleet mid-upgrade: each node's version is marked

    def version(row: dict[str, Any]) -> str:
        return f"{row.get('agent_version') or '?'}/{row.get('contract') or '1.0'}" + (" *" if skew else "")

    tables = [table(("node", "version", "model", "quant", "ctx", "slots", "types", "in flight", "done/failed",
                     "RAM free", "state", "guard", "heartbeat"),
                    [(n["id"], version(n), n["model"], n["quant"], n["ctx_tokens"], n["slots"],
                      ",".join(n["task_types"]), n["in_flight"],
                      f"{n['completed']}/{n['failed']}" + (f" (+{n['deferred']} given back)" if n.get("deferred")
                                                          else ""),
                      format_bytes(n["ram_available_bytes"]), "LOST" if n["lost"] else n["state"], n["guard"],
                      f"{n['heartbeat_age_s']:.0f} s ago") for n in data["nodes"]],
                    title="Nodes" + (" (* more than one version: see the alert)" if skew else ""))]
    if data["gateways"]:
        tables.append(table(("gateway", "version", "endpoint", "state", "heartbeat"),
                            [(g["id"], version(g), g["endpoint"], "LOST" if g["lost"] else g["state"],
                              f"{g['heartbeat_age_s']:.0f} s ago") for g in data["gateways"]], title="Gateways"))
    if any(any(v is not None for v in n["health"].values()) for n in data["nodes"]):
        tables.append(table(("node", "paused for", "temperature", "throttling", "CPU clock", "power",
                             "memory pressure"), [health_row(n) for n in data["nodes"]],
                            title="Node health (at each node's last heartbeat)"))
    tables.append(table(("queue", "ready", "leased", "delayed", "dead", "done", "trend"),
                        [(s["queue"], s["ready"], s["leased"], s["delayed"], s["dead"], s["done"], s["trend"])
                         for s in data["queues"]], title="Queues"))
    if data["ledger"]:
        tables.append(table(("pid", "model", "host", "GPU"),
                            [(e["pid"], e["model"], format_bytes(e["host_bytes"]), format_bytes(e["gpu_bytes"]))
                             for e in data["ledger"]], title="This host's memory ledger"))
    if data["batches"]:
        tables.append(table(("batch", "status", "endpoint", "done", "failed", "total"),
                            [(b["id"], b["status"], b["endpoint"], b["request_counts"]["completed"],
                              b["request_counts"]["failed"], b["request_counts"]["total"]) for b in data["batches"]],
                            title="Batches"))
    if data["assignments"]:
        lead = data["scheduler"]
        tables.append(table(
            ("node", "assigned", "generation", "followed", "holds", "refused"),
            [(a["node"], ", ".join(a["models"]) or "-", a["generation"],
              "never" if a["followed_age_s"] is None else
              f"gen {a['followed_generation']}, {a['followed_age_s']:.0f} s ago", ", ".join(a["held"]) or "-",
              "; ".join(f"{m}: {why}" for m, why in a["refused"].items()) or "-")
             for a in data["assignments"]],
            title="Assignments (scheduler: " + (f"{lead['owner']}, leading {lead['leading_for_s']:.0f} s"
                                                 if lead else "none leading: nodes keep what they hold") + ")"))
    if fit_model:
        tables.append(table(("node", "profile", "fits", "quant", "ctx", "memory", "why"),
                            [(f["node"], f["profile"], "yes" if f["fits"] else "no", f["quant"], f["ctx_tokens"],
                              format_bytes(f["total_bytes"]), f["why"]) for f in data["fit"]],
                            title=f"Where {fit_model} fits"))
    return Group(*tables)


def _watch(read: Callable[[], dict[str, Any]], fit_model: str | None, interval_s: float, as_json: bool) -> None:
    """`status --watch`: read and show the view every ``interval_s`` until SIGINT (Ctrl-C) or SIGTERM, which end
    it normally (exit 0). On a terminal the tables are redrawn in place (rich's Live); piped, each refresh is
    printed after the last (Live would print only the final one); with --json, one JSON line each. A read that
    fails after the first (the broker restarting) is said (under the tables on a terminal, else on stderr) and
    tried again at the next refresh."""
    import threading
    import time

    from nodeagent.broker.open import broker_errors
    from nodeagent.errors import NodeAgentError

    stop = threading.Event()
    on_signals(stop.set)
    out = console()
    live: Any = None

    def frame(data: dict[str, Any], problem: str | None = None) -> Any:
        from rich.console import Group
        from rich.text import Text

        head = Text(f"nodeagent status at {time.strftime('%H:%M:%S')}, every {interval_s:g} s (Ctrl-C stops)",
                    style="dim")
        return Group(head, status_view(data, fit_model),
                     *(Text(f"alert: {alert}", style="bold red") for alert in data["alerts"]),
                     *([Text(problem, style="bold yellow")] if problem else []))

    def show(data: dict[str, Any]) -> None:
        if as_json:
            print_json_line(data)
        elif live is None:
            out.print(frame(data))
        else:
            live.update(frame(data), refresh=True)

    data = read()  # the first read fails as `status` does: one line, and a non-zero exit
    if not as_json and out.is_terminal:
        from rich.live import Live

        live = Live(frame(data), console=out, auto_refresh=False)
        live.start(refresh=True)
    else:
        show(data)
    try:
        while not stop.wait(interval_s):
            try:
                data = read()
            except (NodeAgentError, *broker_errors()) as exc:
                problem = (f"cannot read the fleet now ({' '.join(str(exc).split())[:300]}); "
                           f"trying again in {interval_s:g} s")
                if live is not None:  # in the view: a log line would tear the redrawn tables
                    live.update(frame(data, problem), refresh=True)
                else:
                    log.warning("status --watch: %s", problem)
                continue
            show(data)
    finally:
        if live is not None:
            live.stop()


def health_row(n: dict[str, Any]) -> tuple[Any, ...]:
    """One node's health for the status table: what it is paused for and why, its temperature (and how close it
    runs to its limit), throttling, the CPU's clock against its maximum, power, memory pressure."""
    h = n["health"]
    paused = (h["reason"] or h["pause"]) if h["pause"] else "-"  # the reason starts with what it is paused for
    temp = "-" if h["temperature_c"] is None else f"{h['temperature_c']:g} °C"
    if h["thermal"] not in (None, "cool"):
        temp += f" ({h['thermal']})"
    throttling = ", ".join(h["throttled"] or []) or "-"
    if h["undervolted"]:
        throttling = "UNDER-VOLTAGE" + ("" if throttling == "-" else f", {throttling}")
    clock = "-" if h["freq_ratio"] is None else f"{h['freq_ratio']:.0%}"
    power = {True: "battery", False: "mains", None: "-"}[h["on_battery"]]
    if h["battery_pct"] is not None:
        power += f" {h['battery_pct']:g} %"
    pressure = h["memory_pressure"] or "-"
    if h["hold_models"]:
        pressure += " (no model loads)"
    return (n["id"], paused, temp, throttling, clock, power, pressure)
