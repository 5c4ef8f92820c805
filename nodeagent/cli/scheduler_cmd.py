"""`nodeagent scheduler` (place models on the fleet's following nodes, as leader or standby) and
`nodeagent schedule --dry-run` (the placement the policy would make now, or for a file of recorded nodes)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import click

from nodeagent.cli.common import App, json_option, open_queue, say, setting_option
from nodeagent.errors import UsageError
from nodeagent.output import print_json, print_lines, print_table
from nodeagent.service.signals import on_signals
from nodeagent.urls import shown


@click.command("scheduler")
@setting_option("broker")
@click.option("--once", is_flag=True, help="One round (if this process can lead), printed, then exit.")
@json_option
@click.pass_obj
def scheduler(app: App, broker: str | None, once: bool, as_json: bool) -> None:
    """Place models on the nodes that follow (`worker --follow`) by fit and queue demand. Holds the leader lease in
    the broker: a second scheduler waits as a standby and takes over when the first stops. SIGTERM stops it."""
    from nodeagent.fleet.scheduler import Scheduler

    config = app.config.with_flags({"broker": broker})
    q = open_queue(app, config.broker, check=once)  # a running scheduler waits out an outage
    owner = f"{socket.gethostname()}:{os.getpid()}"
    s = Scheduler(q, config, owner)
    if once:
        placement = s.step()
        if placement is None:
            holder = s.lease.holder()
            raise UsageError(f"another scheduler leads ({holder.owner if holder else '?'}): this one would only wait",
                             hint="stop it, or wait for its lease to expire")
        _show(placement, as_json)
        s.lease.release()
        return
    from nodeagent.service.notify import Notifier

    stop = threading.Event()
    notifier = Notifier()  # under systemd (`service install --role scheduler`): READY=1, WATCHDOG=1, STOPPING=1
    # leaving: a broker outage is not waited out (one try each), so a stop during one is prompt
    on_signals(lambda: (q.hurry(), stop.set()), also=notifier.stopping)
    say(f"scheduler {owner}: placing models from {shown(q.url)} every {config.schedule_s:g} s "
        f"(leader lease {config.scheduler_lease_s:g} s)")
    notifier.ready(f"scheduler {owner}")
    notifier.start_watchdog(lambda: not stop.is_set())
    s.run(stop)
    q.close()
    if as_json:
        print_json({"scheduler": owner, "rounds": s.rounds})
    else:
        say(f"scheduler {owner} stopped after {s.rounds} rounds as leader")


@click.command("schedule")
@click.option("--dry-run", "dry", is_flag=True, help="Print the placement; change nothing (the only mode).")
@click.option("--nodes", "nodes_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="A JSON file of nodes (hardware fixtures and profiles) instead of the broker's registered ones.")
@click.option("--demand", "demand_args", multiple=True, metavar="MODEL=N",
              help="Tasks waiting for MODEL (repeatable), instead of the broker's queue.")
@setting_option("broker")
@json_option
@click.pass_obj
def schedule(app: App, dry: bool, nodes_file: Path | None, demand_args: tuple[str, ...], broker: str | None,
             as_json: bool) -> None:
    """The placement the scheduler's policy would make now, with its reasons: for the broker's nodes and queue,
    or for a file of recorded nodes and a demand given here."""
    from nodeagent.fleet.placement import ModelDemand
    from nodeagent.fleet.scheduler import DemandTracker, dry_run, read_assignments

    if not dry:
        raise UsageError("schedule only prints what the policy would do (--dry-run)",
                         hint="run 'nodeagent scheduler' to place models")
    config = app.config.with_flags({"broker": broker})
    demand = [_demand(arg) for arg in demand_args]
    assigned = {}
    q = None
    if nodes_file is None or not demand:
        q = open_queue(app, config.broker)
    if nodes_file is not None:
        from nodeagent.fleet.scheduler import Assigned, Assignment

        records = read_nodes_file(nodes_file)
        assigned = {r.id: Assignment(node=r.id, models=[Assigned(model=m, since=0.0) for m in r.following["held"]])
                    for r in records if r.following.get("held")}
    else:
        assert q is not None
        records = q.nodes()
        assigned = {k: v[0] for k, v in read_assignments(q).items()}
        if not records:
            raise UsageError(f"no node is registered at {shown(q.url)}", hint="give --nodes FILE, or start workers")
    if not demand:
        assert q is not None
        demand = DemandTracker().update(q.demand(), q.now())
    if not any(isinstance(d, ModelDemand) and d.waiting for d in demand):
        say("no task waits for a model: the policy keeps what each node holds", "warning")
    _show(dry_run(records, demand, config, q.now() if q is not None else time.time(), assigned), as_json)


def _demand(arg: str) -> Any:
    from nodeagent.fleet.placement import ModelDemand

    model, sep, n = arg.rpartition("=")
    if not sep or not model or not n.isdigit():
        raise UsageError(f"--demand {arg!r} is not MODEL=N", hint="for example --demand gemma-3-4b-it=1200")
    return ModelDemand(model=model, waiting=int(n))


def read_nodes_file(path: Path) -> list[Any]:
    """A JSON list of nodes: each a registered record (``status --json`` of a node, with ``hardware``), or
    ``{"id", "fixture": "<hardware JSON, relative to the file>", "profile"?, "held"?, "on_disk"?,
    "allow_pull"?, "host"?, "count"?}`` (``count`` copies of it, numbered)."""
    from nodeagent.broker.base import NodeRecord
    from nodeagent.hardware import probe
    from nodeagent.hardware.system import RecordedSystem
    from nodeagent.profiles import match_profile

    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read the nodes file {path}: {exc}") from None
    if not isinstance(entries, list):
        raise UsageError(f"the nodes file {path} must hold a JSON list of nodes")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or "id" not in e:
            raise UsageError(f"node {i} of {path} is not an object with an id")
        if "hardware" in e:
            out.append(NodeRecord.model_validate({"hostname": e["id"], "agent_version": "?", "os": "?", "arch": "?",
                                                  "backend": "?", **e}))
            continue
        try:
            hw = probe(RecordedSystem.load(path.parent / e["fixture"]))
        except (KeyError, OSError, ValueError) as exc:
            raise UsageError(f"node {e['id']} of {path}: cannot read its hardware fixture: {exc}") from None
        profile = e.get("profile") or match_profile(hw).profile_id
        for k in range(int(e.get("count", 1))):
            ident = e["id"] if int(e.get("count", 1)) == 1 else f"{e['id']}-{k + 1}"
            out.append(NodeRecord(id=ident, hostname=e.get("host", ident), agent_version="?", os=hw.os, arch=hw.arch,
                                  backend="?", follow=True, state="ready", allow_pull=bool(e.get("allow_pull", True)),
                                  on_disk=list(e.get("on_disk", [])), hardware=hw.model_dump(mode="json"),
                                  labels={"profile": profile, "host": e.get("host", ident)},
                                  following={"held": list(e.get("held", []))}))
    return out


def _show(placement: Any, as_json: bool) -> None:
    if as_json:
        print_json(placement)
        return
    rows = [(node, ", ".join(sorted(held)) or "-") for node, held in sorted(placement.assignments.items())]
    print_table(("node", "models"), rows, title="Placement")
    print_lines(placement.reasons)
    click.echo(f"{placement.loads} loads, {placement.unloads} unloads", err=True)

