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


class JsonLines(logging.Formatter):
    """One JSON object a line: what journald, launchd's log files and log shippers want."""

    def format(self, record: logging.LogRecord) -> str:
        import json

        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def wants_json(log_format: str, env: dict[str, str] | None = None) -> bool:
    """JSON lines when asked, or (auto) when stderr is not a terminal or a service manager started us."""
    import sys

    env = dict(os.environ) if env is None else env
    if log_format != "auto":
        return log_format == "json"
    # systemd sets these; the launchd plist sets NODEAGENT_LOG_FORMAT=json (XPC_SERVICE_NAME is in Terminal too)
    managed = any(k in env for k in ("INVOCATION_ID", "NOTIFY_SOCKET", "JOURNAL_STREAM"))
    return managed or not sys.stderr.isatty()


def say(message: str, level: str = "info") -> None:
    """A line for the person or the service manager on stderr: a JSON line like every log line when logs are
    JSON (under systemd or launchd), else plain text."""
    handlers = logging.getLogger().handlers
    if handlers and isinstance(handlers[0].formatter, JsonLines):
        record = logging.LogRecord("nodeagent.cli", getattr(logging, level.upper()), "", 0, message, None, None)
        click.echo(handlers[0].formatter.format(record), err=True)
    else:
        click.echo(message, err=True)


def setup_logging(level: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if wants_json(log_format) else
                         logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING), handlers=[handler], force=True)
