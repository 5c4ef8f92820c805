"""`nodeagent doctor`: check this machine's setup for nodeagent; exit 1 when a check fails."""

from __future__ import annotations

import sys

import click

from nodeagent.cli.common import App, json_option
from nodeagent.output import print_json, print_table


@click.command("doctor")
@json_option
@click.pass_obj
def command(app: App, as_json: bool) -> None:
    """Check the llama.cpp build against this CPU, the build tools, the directories, the broker and its clock,
    the model hub and the service: ok, warn or fail for each, with the fix. Exits 1 when a check fails."""
    from nodeagent.doctor import live_edges, passed, run_checks

    checks = run_checks(live_edges(app.config))
    good = passed(checks)
    if as_json:
        print_json({"checks": checks, "ok": good})
    else:
        print_table(("check", "status", "detail", "fix"), [(c.name, c.status, c.detail, c.fix) for c in checks],
                    title="nodeagent doctor")
        counts = {s: sum(c.status == s for c in checks) for s in ("fail", "warn")}
        click.echo(f"{counts['fail']} failed, {counts['warn']} warned, {len(checks) - sum(counts.values())} ok",
                   err=True)
    if not good:
        sys.exit(1)
