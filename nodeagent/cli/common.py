"""What every command shares: the resolved settings, the node core, and --json."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import click

from nodeagent import config as cfg
from nodeagent.config import NodeConfig
from nodeagent.node import Device, Node, resolve_device

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout instead of a table.")


@dataclass
class App:
    """The global flags and the environment; settings are resolved once, the device lazily
    (`nodeagent inspect` never probes the machine)."""

    flags: dict[str, Any]
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))

    @functools.cached_property
    def config(self) -> NodeConfig:
        return cfg.load(self.flags, self.env)

    @functools.cached_property
    def device(self) -> Device:
        return resolve_device(self.config)

    def node(self, model: str | None, **options: Any) -> Node:
        """The core for one command: the global settings with this command's own flags on top."""
        settings = {k: options.pop(k) for k in list(options) if k in cfg.SETTINGS_BY_NAME}
        config = self.config.with_flags(settings)
        same_device = config.profile == self.config.profile  # then probed once per process
        return Node(model, config=config, device=self.device if same_device else None, **options)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s", force=True)
