"""`nodeagent status [--fit MODEL] [--watch]`: the fleet as its queue knows it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import click

from nodeagent.cli.common import App, broker_option, json_option, open_queue
from nodeagent.errors import UsageError
from nodeagent.output import console, format_bytes, print_json, print_json_line, table
from nodeagent.service.signals import on_signals

if TYPE_CHECKING:
    from nodeagent.fleet.status import FleetStatus, GatewayStatus, NodeStatus

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 2.0  # `status --watch` refreshes this often unless --interval says


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
    q = open_queue(app, broker)
    if watch:
        _watch(lambda: status_data(app, q, fit_model), fit_model, interval_s or WATCH_INTERVAL_S, as_json)
        return
    data = status_data(app, q, fit_model)
    if as_json:
        print_json(data.model_dump(mode="json"))
        return
    console().print(status_view(data, fit_model))
    for alert in data.alerts:
        click.echo(f"alert: {alert}", err=True)


def status_data(app: App, q: Any, fit_model: str | None) -> "FleetStatus":
    """What `status` shows, read now: the fleet from the broker, this host's memory ledger, and where
    ``fit_model`` fits."""
    from nodeagent.broker.base import lost_after
    from nodeagent.fleet.status import fit_rows, fleet_status
    from nodeagent.ledger import Ledger

    data = fleet_status(q, lost_after(app.config.heartbeat_s), app.config.clock_warn_s)
    return data.model_copy(update={"ledger": Ledger(app.config.state_dir).entries(),  # this host's, by process
                                   "fit": fit_rows(q.nodes(), fit_model, app.config) if fit_model else None})


def status_view(data: "FleetStatus", fit_model: str | None) -> Any:
    """The tables of `status` (a rich Group): printed once, or re-rendered at each refresh by --watch. The alerts
    are not in it (they go to stderr, or under the tables of a watch)."""
    from rich.console import Group

    skew = len(data.versions) > 1  # a fleet mid-upgrade: each node's version is marked

    def version(row: "NodeStatus | GatewayStatus") -> str:
        return f"{row.agent_version or '?'}/{row.contract or '1.0'}" + (" *" if skew else "")

    tables = [table(("node", "version", "model", "quant", "ctx", "slots", "types", "in flight", "done/failed",
                     "RAM free", "state", "guard", "heartbeat"),
                    [(n.id, version(n), n.model, n.quant, n.ctx_tokens, n.slots, ",".join(n.task_types), n.in_flight,
                      f"{n.completed}/{n.failed}" + (f" (+{n.deferred} given back)" if n.deferred else "")
                      + (f" (+{n.left_warm} left to warm nodes)" if n.left_warm else ""),
                      format_bytes(n.ram_available_bytes), "LOST" if n.lost else n.state, n.guard,
                      f"{n.heartbeat_age_s:.0f} s ago") for n in data.nodes],
                    title="Nodes" + (" (* more than one version: see the alert)" if skew else ""))]
    if data.gateways:
        tables.append(table(("gateway", "version", "endpoint", "state", "heartbeat"),
                            [(g.id, version(g), g.endpoint, "LOST" if g.lost else g.state,
                              f"{g.heartbeat_age_s:.0f} s ago") for g in data.gateways], title="Gateways"))
    if any(n.health.known() for n in data.nodes):
        tables.append(table(("node", "paused for", "temperature", "throttling", "CPU clock", "power",
                             "memory pressure"), [health_row(n) for n in data.nodes],
                            title="Node health (at each node's last heartbeat)"))
    warm = [(n.id, model, p) for n in data.nodes for model, p in sorted(n.prefixes.items())]
    if warm:
        tables.append(table(("node", "model", "prefixes", "on disk", "restored", "tokens restored", "prefill",
                             "prefill saved"),
                            [(node, model, "-" if p.prefixes is None else p.prefixes,
                              "-" if p.state_bytes is None else format_bytes(p.state_bytes), p.restored,
                              p.restored_tokens, "-" if p.prefill_tokens_per_s is None
                              else f"{p.prefill_tokens_per_s:g} tok/s",
                              "-" if p.saved_s is None else f"{p.saved_s:.1f} s") for node, model, p in warm],
                            title="Warm prefixes (since each node started; '-': not loaded, or no prompt read yet)"))
    tables.append(table(("queue", "ready", "leased", "delayed", "dead", "done", "trend"),
                        [(s.queue, s.ready, s.leased, s.delayed, s.dead, s.done, s.trend) for s in data.queues],
                        title="Queues"))
    if data.ledger:
        tables.append(table(("pid", "model", "host", "GPU"),
                            [(e["pid"], e["model"], format_bytes(e["host_bytes"]), format_bytes(e["gpu_bytes"]))
                             for e in data.ledger], title="This host's memory ledger"))
    if data.batches:
        tables.append(table(("batch", "status", "endpoint", "done", "failed", "total"),
                            [(b.id, b.status, b.endpoint, b.request_counts.get("completed", 0),
                              b.request_counts.get("failed", 0), b.request_counts.get("total", 0))
                             for b in data.batches], title="Batches"))
    if data.assignments:
        lead = data.scheduler
        tables.append(table(
            ("node", "assigned", "generation", "followed", "holds", "refused"),
            [(a.node, ", ".join(a.models) or "-", a.generation,
              "never" if a.followed_age_s is None else f"gen {a.followed_generation}, {a.followed_age_s:.0f} s ago",
              ", ".join(a.held) or "-", "; ".join(f"{m}: {why}" for m, why in a.refused.items()) or "-")
             for a in data.assignments],
            title="Assignments (scheduler: " + (f"{lead.owner}, leading {lead.leading_for_s:.0f} s"
                                                 if lead else "none leading: nodes keep what they hold") + ")"))
    if fit_model:
        tables.append(table(("node", "profile", "fits", "quant", "ctx", "memory", "why"),
                            [(f.node, f.profile, "yes" if f.fits else "no", f.quant, f.ctx_tokens,
                              format_bytes(f.total_bytes), f.why) for f in data.fit or []],
                            title=f"Where {fit_model} fits"))
    return Group(*tables)


def _watch(read: Callable[[], "FleetStatus"], fit_model: str | None, interval_s: float, as_json: bool) -> None:
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

    def frame(data: "FleetStatus", problem: str | None = None) -> Any:
        from rich.console import Group
        from rich.text import Text

        head = Text(f"nodeagent status at {time.strftime('%H:%M:%S')}, every {interval_s:g} s (Ctrl-C stops)",
                    style="dim")
        return Group(head, status_view(data, fit_model),
                     *(Text(f"alert: {alert}", style="bold red") for alert in data.alerts),
                     *([Text(problem, style="bold yellow")] if problem else []))

    def show(data: "FleetStatus") -> None:
        if as_json:
            print_json_line(data.model_dump(mode="json"))
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


def health_row(n: "NodeStatus") -> tuple[Any, ...]:
    """One node's health for the status table: what it is paused for and why, its temperature (and how close it
    runs to its limit), throttling, the CPU's clock against its maximum, power, memory pressure."""
    h = n.health
    paused = (h.reason or h.pause) if h.pause else "-"  # the reason starts with what it is paused for
    temp = "-" if h.temperature_c is None else f"{h.temperature_c:g} °C"
    if h.thermal not in (None, "cool"):
        temp += f" ({h.thermal})"
    throttling = ", ".join(h.throttled or []) or "-"
    if h.undervolted:
        throttling = "UNDER-VOLTAGE" + ("" if throttling == "-" else f", {throttling}")
    clock = "-" if h.freq_ratio is None else f"{h.freq_ratio:.0%}"
    power = {True: "battery", False: "mains", None: "-"}[h.on_battery]
    if h.battery_pct is not None:
        power += f" {h.battery_pct:g} %"
    pressure = h.memory_pressure or "-"
    if h.hold_models:
        pressure += " (no model loads)"
    return (n.id, paused, temp, throttling, clock, power, pressure)
