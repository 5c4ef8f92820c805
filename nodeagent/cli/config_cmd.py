"""`nodeagent config show`: every setting, its value and where it came from."""

from __future__ import annotations

import click

from nodeagent.cli.common import App, json_option
from nodeagent.config import PLAN_SETTINGS
from nodeagent.output import print_json, print_table


@click.group("config")
def command() -> None:
    """Configuration: flags > environment > config file > default. Planner settings left unset take the device
    profile's value for the task."""


@command.command("show")
@json_option
@click.pass_obj
def show(app: App, as_json: bool) -> None:
    """Show each setting with its value, its source and its environment variable."""
    data = app.config.as_dict()
    profile = app.device.profile.id
    if as_json:
        print_json({"profile": profile, "settings": data})
        return
    print_table(("setting", "value", "source", "variable"),
                [(k, "(the profile's)" if v["value"] is None and k in PLAN_SETTINGS else v["value"], v["source"],
                  v["env"]) for k, v in data.items()],
                title=f"Configuration (profile {profile})")
