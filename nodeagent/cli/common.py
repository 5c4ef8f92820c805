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
from nodeagent.errors import UsageError
from nodeagent.node import Device, Node, resolve_device

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout instead of a table.")


def binding_options(fn: Any) -> Any:
    """What a server (`serve`, `gateway`) may be told to accept off loopback that it otherwise refuses."""
    fn = click.option("--insecure-token-on-command-line", "insecure_token_argv", is_flag=True,
                      help="Accept a --token given on the command line off loopback (every user of the machine reads "
                           "it with ps): give --token-file or NODEAGENT_TOKEN instead.")(fn)
    return click.option("--insecure", is_flag=True,
                        help="Allow a non-loopback address without a token (logged as a warning).")(fn)

# the settings whose flags commands share, by what they are about (each flag generated from its setting)
PLANNER_FLAGS = tuple(s.name for s in cfg.SETTINGS if s.plan and s.flag)
FLEET_FLAGS = ("broker", "types", "lease_s", "heartbeat_s", "task_timeout_s", "max_attempts")
SERVER_FLAGS = ("host", "port", "token", "ui_admin")


# what `run` and `submit` take of a task alike
task_input_options = [
    click.option("--text", help="The input text."),
    click.option("--file", "file", type=click.Path(dir_okay=False), help="Read the input text from a file."),
    click.option("--instructions", help="Extra instructions for the model."),
    click.option("--id", "task_id", help="Task id (default: a new one)."),
]


def options(*decorators: Any) -> Any:
    """Apply click options (or decorators) in the order they are listed."""
    def apply(fn: Any) -> Any:
        for decorator in reversed(decorators):
            fn = decorator(fn)
        return fn

    return apply


def setting_option(name: str) -> Any:
    """The click option of a setting, from its one declaration: its flag, a type checking the same bounds as
    its variable, and its description and variable as the help. Unset, it is None: the setting resolves as
    if the flag were not there."""
    s = cfg.SETTINGS_BY_NAME[name]
    assert s.flag, f"setting {name} has no flag"
    help_text = f"{s.description} ({s.env})"
    if s.parse is cfg.parse_bool:
        return click.option(f"{s.flag}/--no-{s.flag.removeprefix('--')}", name, default=None, help=help_text)
    if hasattr(s.parse, "choices"):
        kind: Any = click.Choice(s.parse.choices)
    elif hasattr(s.parse, "low"):
        kind = click.IntRange(min=s.parse.low, max=s.parse.high)
    elif s.parse.__name__ == "_positive_float":
        kind = click.FloatRange(min=0, min_open=True)
    else:
        kind = str
    return click.option(s.flag, name, type=kind, default=None, help=help_text)


def model_options(what: str) -> Any:
    """``--model`` (repeatable: a model set) and ``--pin``, as worker, serve and service install take them;
    ``what``: what each model of a set is loaded at the first of (task, request)."""
    return options(
        click.option("--model", "models", multiple=True,
                     help="Catalog name, .gguf file, mlx-lm directory, or fake[:options]. Several: a model set under "
                          f"one memory budget, each loaded at its first {what} and kept for --keep-alive. None: the "
                          "config file's [[models]]."),
        click.option("--pin", "pins", multiple=True, help="With several --model: keep this one loaded (repeatable)."))


def setting_options(*names: str) -> Any:
    return options(*(setting_option(n) for n in names))


def setting_argv(values: dict[str, Any]) -> list[str]:
    """The flags that give these settings (the inverse of setting_option, for a service's command line)."""
    argv: list[str] = []
    for name, value in values.items():
        flag = cfg.SETTINGS_BY_NAME[name].flag
        if value is None or flag is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag.removeprefix('--')}")
        else:
            argv += [flag, str(value)]
    return argv


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

    def model_nodes(self, models: tuple[str, ...], pins: tuple[str, ...], **options: Any
                    ) -> tuple[list[Node], set[str], dict[str, list[str]]]:
        """The nodes of a command's --model values, or else of the config file's ``[[models]]`` (each with its
        own settings where no flag gives one); the pinned ones and each one's aliases."""
        if models:
            return [self.node(m, **options) for m in models], set(pins), {}
        entries = cfg.load_config_file(self.config.config_file).get("models", [])
        if not entries:
            raise UsageError("no model to serve: give --model (several for a model set), or [[models]] in the "
                             "config file", hint="see 'nodeagent config show' for the config file's path")
        nodes = []
        for e in entries:
            own = {k: v for k, v in e.items() if k in cfg.SETTINGS_BY_NAME}
            given = {k: v for k, v in options.items() if v is not None}
            nodes.append(self.node(e["model"], **{**options, **own, **given}))
        return nodes, set(pins) | {e["model"] for e in entries if e.get("pin")}, \
            {e["model"]: list(e.get("aliases", [])) for e in entries}

    def loadable_nodes(self, models: tuple[str, ...], pins: tuple[str, ...], **options: Any
                       ) -> tuple[list[Node], set[str], dict[str, list[str]]]:
        """``model_nodes``, each model's plan checked before anything starts (``Node.check_loadable``): a model set
        whose member this machine cannot load is refused at once with that member's one-line error, as one model
        is, not with an error at each request once it runs."""
        nodes, pinned, aliases = self.model_nodes(models, pins, **options)
        for n in nodes:
            n.check_loadable()
        return nodes, pinned, aliases

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
                 "msg": record.getMessage(), **getattr(record, "fields", {})}
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


def page_line(config: Any) -> str | None:
    """Where the operator's page is: with the token as a sign-in link when a person reads the terminal (never into
    a service's journal: there it says to sign in with the token)."""
    if not config.ui:
        return None
    import sys

    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    url = f"http://{host}:{config.port}/ui"
    if config.token:
        url = f"{url}?token={config.token}" if sys.stderr.isatty() else f"{url} (sign in with the bearer token)"
    return f"operator's page: {url}, {'with its controls (--ui-admin)' if config.ui_admin else 'read-only'}"


def say(message: str, level: str = "info") -> None:
    """A line for the person or the service manager on stderr: a JSON line like every log line when logs are
    JSON (under systemd or launchd), else plain text."""
    handlers = logging.getLogger().handlers
    if handlers and isinstance(handlers[0].formatter, JsonLines):
        record = logging.LogRecord("nodeagent.cli", getattr(logging, level.upper()), "", 0, message, None, None)
        click.echo(handlers[0].formatter.format(record), err=True)
    else:
        click.echo(message, err=True)


def setup_logging(level: str, log_format: str, access_log: bool) -> None:
    """Logs on stderr at ``level``; the HTTP access log (one line a request) at info whatever the level, when
    it is on (NODEAGENT_ACCESS_LOG)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if wants_json(log_format) else
                         logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING), handlers=[handler], force=True)
    logging.getLogger("nodeagent.access").setLevel(logging.INFO if access_log else logging.WARNING)


broker_option = setting_option("broker")  # the fleet's queue, for the commands that read or write it


def open_queue(app: App, url: str | None, check: bool = True):  # type: ignore[no-untyped-def]
    """The fleet's queue a command names (--broker) or the config does."""
    from nodeagent.broker.open import open_broker

    config = app.config.with_flags({"broker": url})
    return open_broker(config.broker, config.state_dir, check, config=config)


def operator() -> str:
    """Who took an action from the shell, as the fleet's event log records it."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = "?"
    return f"cli {user}@{socket.gethostname()}"
