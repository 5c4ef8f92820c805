"""`nodeagent service install|uninstall|status`: run the agent as a systemd or launchd service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from nodeagent.cli.common import PLANNER_FLAGS, App, json_option, model_options, setting_argv, setting_options
from nodeagent.errors import UsageError
from nodeagent.output import print_json

manager_option = click.option("--manager", type=click.Choice(["systemd", "launchd"]),
                              help="The service manager (default: this OS's).")
scope_option = click.option("--user/--system", "user", default=True,
                            help="A user service (default) or a system one (needs root).")


@click.group("service")
def command() -> None:
    """Install nodeagent as a service that survives reboots and crashes (systemd on Linux, launchd on macOS)."""


# what the service's `serve` command line carries (a token goes by the environment, not into the unit's text)
SERVICE_FLAGS = ("host", "port", "broker", "types", *PLANNER_FLAGS)


@command.command("install")
@model_options("request")
@setting_options(*SERVICE_FLAGS, "keep_alive_s")
@manager_option
@scope_option
@click.option("--gateway", is_flag=True, help="Install `nodeagent gateway` (the fleet as one endpoint; it holds no "
              "model) instead of `serve`: give --broker.")
@click.option("--dry-run", is_flag=True, help="Print what would be written, and where; change nothing.")
@json_option
@click.pass_obj
def install(app: App, models: tuple[str, ...], pins: tuple[str, ...], manager: str | None, user: bool,
            gateway: bool, dry_run: bool, as_json: bool, **settings: Any) -> None:
    """Write the unit (or plist), then enable and start it."""
    from nodeagent.planner.modelset import plan_set
    from nodeagent.service.units import default_manager, spec_for

    manager = manager or default_manager()
    if gateway:
        _install_gateway(app, manager, user, dry_run, as_json, settings)
        return
    nodes, pinned, _ = app.model_nodes(models, pins, **settings)
    node = nodes[0]
    config = node.config
    names = [str(n.model) for n in nodes]
    unknown = pinned - set(names)
    if unknown:
        raise UsageError(f"--pin {sorted(unknown)[0]!r} is not one of the --model values")
    tail = setting_argv(settings) + [a for p in pins for a in ("--pin", p)]  # the service's own flags
    planned = None  # memory limits from the plans, when they are for this machine: the set's at its fullest
    if node.device.here:
        whole = plan_set(names, [n.plan for n in nodes])
        planned = whole.total_bytes if whole.fits_together else \
            whole.overhead_bytes + sum(whole.added_bytes[m] for m in whole.largest_together)
    readable = [config.model_dir, config.test_models_dir, Path.home() / ".cache" / "huggingface"]
    readable += [Path(m).expanduser().resolve().parent for m in names if Path(m).expanduser().exists()]
    spec = spec_for(list(models), tail, config.config_file, _passed_env(), user, planned,
                    node.plan.budget.margin_bytes if planned else 0, readable, config.drain_s, config.state_dir,
                    config.cache_dir)
    _write_unit(spec, manager, user, dry_run, as_json)


def _install_gateway(app: App, manager: str, user: bool, dry_run: bool, as_json: bool,
                     settings: dict[str, Any]) -> None:
    """The gateway as the service: no model, no plan, its broker required."""
    from nodeagent.service.units import spec_for

    config = app.config.with_flags({k: v for k, v in settings.items() if v is not None})
    if not config.broker:
        raise UsageError("the gateway service needs the fleet's queue: give --broker URL (or NODEAGENT_BROKER)")
    tail = setting_argv({k: v for k, v in settings.items() if k in ("host", "port", "broker")})
    spec = spec_for([], tail, config.config_file, _passed_env(), user, None, 0, [], config.drain_s,
                    config.state_dir, config.cache_dir, command="gateway")
    _write_unit(spec, manager, user, dry_run, as_json)


def _write_unit(spec: Any, manager: str, user: bool, dry_run: bool, as_json: bool) -> None:
    """Write the unit, start it, and say what changed (see the module's docstring)."""
    from nodeagent.service.units import control, hidden_paths, render, unit_path

    text = render(spec, manager)  # type: ignore[arg-type]
    path = unit_path(manager, user)  # type: ignore[arg-type]
    hidden = hidden_paths(spec, manager)  # type: ignore[arg-type]
    if hidden:  # refused before anything is written: the service would fail to start (203/EXEC), in a loop
        raise UsageError(f"the service could not see {hidden[0]}: its unit has PrivateTmp=yes, which gives it a "
                         "/tmp and /var/tmp of its own", hint="move it (the virtual environment, the model, the "
                         "config file) out of /tmp and /var/tmp, e.g. to /opt or your home, then install again")
    if dry_run:
        if as_json:
            print_json({"manager": manager, "path": str(path), "content": text.decode()})
        else:
            click.echo(f"# would write {path}", err=True)
            click.echo(text.decode(), nl=False)
        return
    before = path.read_bytes() if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    try:
        out = control(manager, user, "install", path)  # type: ignore[arg-type]
        if before is not None and before != text:  # running with the old file: a new one changes nothing until
            out += control(manager, user, "restart", path)  # type: ignore[arg-type]
    except UsageError as exc:  # it did not start: nothing is left installed, restarting in a loop
        log = control(manager, user, "log", path)  # type: ignore[arg-type]
        _remove(manager, user, path)
        last = " | ".join(line.strip() for line in log.strip().splitlines()[-3:]) or str(exc)
        raise UsageError(f"the service did not start, so it was not installed: {last}",
                         hint="run its command by hand to see why: " + " ".join(spec.argv)) from None
    said = ("installed" if before is None else "unchanged: already installed" if before == text else
            "reinstalled (the running service was restarted with the new unit)")
    if as_json:
        print_json({"manager": manager, "path": str(path), "output": out, "change": said.split(" ")[0]})
    else:
        click.echo(f"{said}: {path}, {control(manager, user, 'running', path) or 'started'}", err=True)


def _remove(manager: str, user: bool, path: Path) -> None:
    """Stop, disable and remove the unit, whatever state it is in."""
    from nodeagent.service.units import control

    try:
        control(manager, user, "uninstall", path)  # type: ignore[arg-type]
    except UsageError:
        path.unlink(missing_ok=True)


def _passed_env() -> dict[str, str]:
    """The NODEAGENT_* variables of this shell (the service runs with the agent's own environment)."""
    import os

    keep = {"NODEAGENT_CONFIG", "NODEAGENT_LOG_FORMAT", "NODEAGENT_HOME", "NODEAGENT_CACHE_DIR"}
    return {k: v for k, v in os.environ.items() if k.startswith(("NODEAGENT_", "HF_")) and k not in keep}


@command.command("uninstall")
@manager_option
@scope_option
@click.option("--dry-run", is_flag=True, help="Say what would be removed; change nothing.")
@click.pass_obj
def uninstall(app: App, manager: str | None, user: bool, dry_run: bool) -> None:
    """Stop and disable the service, and remove its file."""
    from nodeagent.service.units import control, default_manager, unit_path

    manager = manager or default_manager()
    path = unit_path(manager, user)  # type: ignore[arg-type]
    if dry_run:
        click.echo(f"would stop the service and remove {path}")
        return
    if path.exists():
        control(manager, user, "uninstall", path)  # type: ignore[arg-type]
    click.echo(f"removed {path}", err=True)


@command.command("status")
@manager_option
@scope_option
@json_option
@click.pass_obj
def status(app: App, manager: str | None, user: bool, as_json: bool) -> None:
    """Whether the service file is installed, and what the service manager says about it."""
    from nodeagent.service.units import control, default_manager, unit_path

    manager = manager or default_manager()
    path = unit_path(manager, user)  # type: ignore[arg-type]
    report: dict[str, Any] = {"manager": manager, "path": str(path), "installed": path.exists()}
    if path.exists():
        report["manager_says"] = control(manager, user, "status", path)  # type: ignore[arg-type]
    if as_json:
        print_json(report)
    else:
        click.echo(f"{path}: {'installed' if path.exists() else 'not installed'}")
        if report.get("manager_says"):
            click.echo(report["manager_says"].rstrip())
