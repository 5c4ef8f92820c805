"""`nodeagent broker setup`: how to set up the fleet's queue host (Redis), printed for the operator to run, with a
password kept in a file (``broker/recipe.py`` says what and why)."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

import click

from nodeagent.cli.common import App, json_option
from nodeagent.errors import UsageError
from nodeagent.output import print_json


@click.group("broker")
def command() -> None:
    """The fleet's queue host."""


@command.command("setup")
@click.option("--host", "host", default=None, help="The queue host's name or address as the nodes reach it "
                                                   "(default: this machine's name).")
@click.option("--bind", default="0.0.0.0", show_default=True, help="The address Redis listens on (the fleet's "
                                                                   "interface, or all of them).")
@click.option("--port", default=6379, show_default=True, type=click.IntRange(1, 65535))
@click.option("--network", help="The fleet's network (a CIDR such as 192.168.1.0/24): the firewall lets only it in.")
@click.option("--user", "user", default="nodeagent", show_default=True, help="The Redis user the fleet connects as.")
@click.option("--password-file", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("~/.config/nodeagent/broker.password"), show_default=True,
              help="The user's password: read from this file, or made and written to it (0600) when it is missing. "
                   "Copy it to each node, where NODEAGENT_BROKER_PASSWORD_FILE names it.")
@json_option
@click.pass_obj
def setup(app: App, host: str | None, bind: str, port: int, network: str | None, user: str, password_file: Path,
          as_json: bool) -> None:
    """Print the queue host's set-up: install Redis, reachable from the fleet's network only through a user limited
    to nodeagent's keys, with the append-only file and no eviction; the firewall; and what each node sets. Run the
    steps on the queue host, then `nodeagent doctor` on each node."""
    from nodeagent.broker.recipe import recipe
    from nodeagent.config import read_secret

    path = password_file.expanduser()
    made = not path.exists()
    if made:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
    password = read_secret(path, "--password-file")
    try:
        plan = recipe(host or socket.gethostname(), password, user=user, bind=bind, port=port, network=network,
                      password_file=str(password_file))
    except ValueError as exc:
        raise UsageError(f"--network {network!r} is not a network: {exc}", hint="write it as 192.168.1.0/24") from None
    if as_json:
        print_json({**plan.model_dump(), "password_file": str(path), "password_made": made})
        return
    if made:
        click.echo(f"made a password for the user {user} in {path} (0600)", err=True)
    click.echo("# On the queue host:")
    for step in plan.steps:
        click.echo(step)
    if not network:
        click.echo("# (give --network CIDR for the firewall lines that let only the fleet's network in)")
    click.echo(f"\n# On each node, gateway and orchestrator (copy {path} there first, mode 0600):")
    for key, value in plan.node_env.items():
        click.echo(f"export {key}={value}")
    click.echo("nodeagent doctor   # the connection, persistence, eviction: each checked")
