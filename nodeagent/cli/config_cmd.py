"""`nodeagent config show`: every setting, its value and where it came from."""

from __future__ import annotations

import click

from nodeagent.cli.common import App, json_option
from nodeagent.output import print_json, print_table


@click.group("config")
def command() -> None:
    """Configuration: flags > environment > config file > device profile > default."""


@command.command("show")
@json_option
@click.pass_obj
def show(app: App, as_json: bool) -> None:
    """Show each setting with its value, its source and its environment variable."""
    data = app.config().as_dict()
    if as_json:
        print_json({"profile": app.profile_match().profile_id, "settings": data})
        return
    print_table(("setting", "value", "source", "variable"),
                [(k, v["value"], v["source"], v["env"]) for k, v in data.items()],
                title=f"Configuration (profile {app.profile_match().profile_id})")
