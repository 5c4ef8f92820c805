"""`nodeagent service install|uninstall|status`: run each role of a fleet (a node, a worker, the gateway, the
scheduler) as a systemd or launchd service of its own, its secrets kept in files the service reads, never in the
unit's text (``nodeagent/service/units.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from nodeagent.cli.common import PLANNER_FLAGS, App, json_option, model_options, setting_argv, setting_options
from nodeagent.errors import UsageError
from nodeagent.output import print_json
from nodeagent.service.units import ROLES

manager_option = click.option("--manager", type=click.Choice(["systemd", "launchd"]),
                              help="The service manager (default: this OS's).")
scope_option = click.option("--user/--system", "user", default=True,
                            help="A user service (default) or a system one (needs root).")
role_option = click.option("--role", type=click.Choice(ROLES), default="node", show_default=True,
                           help="node: serve (HTTP, and the queue's tasks with --broker); worker: the queue's tasks, "
                                "no HTTP; gateway: the fleet as one endpoint; scheduler: places models on following "
                                "nodes. Each role is a service of its own.")
name_option = click.option("--name", "instance", help="An instance name, for a second service of the same role on "
                                                      "this machine (nodeagent-<role>-<name>).")


@click.group("service")
def command() -> None:
    """Install nodeagent as services that survive reboots and crashes (systemd on Linux, launchd on macOS): one per
    role, side by side."""


# what the service's command line carries; its secrets (a token, a Redis password) go into files it reads
SERVICE_FLAGS = ("host", "port", "broker", "types", *PLANNER_FLAGS)
HTTP_ROLES = ("node", "gateway")
MODEL_ROLES = ("node", "worker")
# the flags each role's command takes (the rest of what the installer is given is its own)
ROLE_FLAGS = {"node": ("host", "port", "types", "keep_alive_s", "allow_pull", *PLANNER_FLAGS),
              "worker": ("types", "keep_alive_s", "allow_pull", *PLANNER_FLAGS),
              "gateway": ("host", "port"), "scheduler": ()}


@command.command("install")
@role_option
@name_option
@model_options("request")
@click.option("--follow", is_flag=True, help="node, worker: hold the models the scheduler assigns this node (the "
                                             "--model values to begin with); needs --broker for a node.")
@setting_options(*SERVICE_FLAGS, "keep_alive_s", "allow_pull", "token_file", "broker_password_file",
                 "broker_sentinel_password_file")
@click.option("--generate-token", is_flag=True, help="node, gateway: make a new random bearer token, kept in the "
                                                    "service's own secret file (its path is printed).")
@click.option("--gateway", is_flag=True, hidden=True, help="The same as --role gateway (nodeagent 0.1's spelling).")
@manager_option
@scope_option
@click.option("--dry-run", is_flag=True, help="Print what would be written, and where; change nothing.")
@json_option
@click.pass_obj
def install(app: App, role: str, instance: str | None, models: tuple[str, ...], pins: tuple[str, ...],
            follow: bool, generate_token: bool, gateway: bool, manager: str | None, user: bool, dry_run: bool,
            as_json: bool, **settings: Any) -> None:
    """Write the role's unit (or plist) and its secret files, then enable and start it. Installing again applies a
    changed unit; another role's service is never touched."""
    from nodeagent.service.units import Unit, default_manager

    manager = manager or default_manager()
    unit = Unit.named("gateway" if gateway else role, instance)
    config = app.config.with_flags({k: v for k, v in settings.items() if v is not None})
    if unit.role not in MODEL_ROLES and (models or pins or follow):
        raise UsageError(f"a {unit.role} holds no model: --model, --pin and --follow are for a node or a worker")
    if unit.role in ("gateway", "scheduler") or (follow and unit.role == "node"):
        if not config.broker:
            raise UsageError(f"the {unit.role if not follow else 'following node'} needs the fleet's queue: give "
                             "--broker URL (or NODEAGENT_BROKER)", hint="e.g. --broker redis://queue-host:6379/0")
    if follow and unit.role == "node" and not models:
        raise UsageError("a following node serves HTTP from a model it holds to begin with: give --model (the "
                         "scheduler adds and removes others)",
                         hint="or --role worker --follow: the queue's tasks only, holding what the scheduler assigns")
    given = {k: v for k, v in settings.items() if v is not None}
    secrets, writes = _secrets(app, unit, config, manager, user, generate_token)
    tail = setting_argv({k: v for k, v in given.items() if k in ROLE_FLAGS[unit.role]})
    if config.broker:  # the URL as the service gets it: the secrets it held are in its secret files instead
        from nodeagent.urls import without_secrets

        tail += ["--broker", without_secrets(config.broker)]
    if follow:
        tail.append("--follow")
    tail += [a for p in pins for a in ("--pin", p)]
    planned = margin = None
    readable: list[Path] = []
    if unit.role in MODEL_ROLES and (models or not follow):
        planned, margin, readable = _plan(app, models, pins, given)
    spec = _spec(unit, list(models), tail, config, user, planned, margin, readable, secrets)
    _write_unit(spec, manager, user, dry_run, as_json, writes)


def _plan(app: App, models: tuple[str, ...], pins: tuple[str, ...], given: dict[str, Any]
          ) -> tuple[int | None, int, list[Path]]:
    """The memory a node's or a worker's models take (the set's at its fullest), its margin, and the folders its
    models are read from."""
    from nodeagent.planner.modelset import plan_set

    nodes, pinned, _ = app.model_nodes(models, pins, **{k: v for k, v in given.items()
                                                        if k not in ("broker_password_file",
                                                                     "broker_sentinel_password_file")})
    node, names = nodes[0], [str(n.model) for n in nodes]
    unknown = pinned - set(names)
    if unknown:
        raise UsageError(f"--pin {sorted(unknown)[0]!r} is not one of the --model values")
    config = node.config
    readable = [config.model_dir, config.test_models_dir, Path.home() / ".cache" / "huggingface"]
    readable += [Path(m).expanduser().resolve().parent for m in names if Path(m).expanduser().exists()]
    if not node.device.here:  # memory limits only from plans made for this machine
        return None, 0, readable
    whole = plan_set(names, [n.plan for n in nodes])
    planned = whole.total_bytes if whole.fits_together else \
        whole.overhead_bytes + sum(whole.added_bytes[m] for m in whole.largest_together)
    return planned, node.plan.budget.margin_bytes, readable


def _spec(unit: Any, models: list[str], tail: list[str], config: Any, user: bool, planned: int | None,
          margin: int | None, readable: list[Path], secrets: dict[str, str]) -> Any:
    from nodeagent.service.units import spec_for

    return spec_for(unit, models, tail, config.config_file, _passed_env(), user, planned, margin or 0, readable,
                    config.drain_s, config.state_dir, config.cache_dir, secrets=secrets)


def _secrets(app: App, unit: Any, config: Any, manager: str, user: bool, generate: bool
             ) -> tuple[dict[str, str], list[tuple[Path, str]]]:
    """The service's secrets: name -> the file it reads (an operator's own file, or one this install writes), and
    the files to write (path, content). Installing a non-loopback HTTP service without a token is refused here."""
    import secrets as random_secrets

    from nodeagent.server.served import is_loopback
    from nodeagent.service.units import SECRET_VARIABLES, secrets_dir
    from nodeagent.urls import UrlParts

    folder = secrets_dir(manager, user)  # type: ignore[arg-type]
    found: dict[str, str] = {}
    writes: list[tuple[Path, str]] = []

    def keep(name: str, value: str) -> None:
        path = folder / f"{unit.stem}.{name}"
        found[name] = str(path)
        writes.append((path, value + "\n"))

    if unit.role in HTTP_ROLES:
        if config.token_file is not None:
            found["token"] = str(_checked_secret(Path(config.token_file), "--token-file"))
        elif generate:
            keep("token", random_secrets.token_urlsafe(32))
        elif config.token:
            keep("token", config.token)  # from NODEAGENT_TOKEN or the config file: into a file, not the unit
        elif not is_loopback(config.host):
            raise UsageError(f"a {unit.role} on {config.host} needs a bearer token, and none is given: anyone who "
                             "reaches the port could use it",
                             hint="give --token-file PATH (a 0600 file holding it) or --generate-token, or serve on "
                                  "127.0.0.1")
    carried = UrlParts.of(config.broker).secrets() if config.broker and "://" in config.broker else {}
    for name, value in carried.items():  # what the URL carries goes into files of their own, never into the unit
        if name in SECRET_VARIABLES:
            keep(name, value)
    for name, path, flag in (("broker-password", config.broker_password_file, "--broker-password-file"),
                             ("broker-sentinel-password", config.broker_sentinel_password_file,
                              "--broker-sentinel-password-file")):
        if name not in carried and path is not None:
            found[name] = str(_checked_secret(Path(path), flag))
    hub = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if hub and unit.role in MODEL_ROLES:
        keep("hf-token", hub)
    return found, writes


def _checked_secret(path: Path, flag: str) -> Path:
    """An operator's own secret file: it exists, holds something, and only its owner may read it (the test a
    starting service warns by, ``private.exposed_secret``: refused here, before the service is built on it)."""
    from nodeagent.config import read_secret
    from nodeagent.private import exposed_secret

    path = path.expanduser().resolve()
    read_secret(path, flag)
    exposed = exposed_secret(path, f"a secret ({flag})")
    if exposed is not None:
        raise UsageError(exposed.detail, hint=f"{exposed.fix}, then install again")
    return path


def _write_secrets(writes: list[tuple[Path, str]], user: bool, owner: str | None) -> None:
    """Each secret file 0600 in a 0700 folder: root's for a system service (systemd hands the service its copy), the
    run-as user's otherwise."""
    for path, content in writes:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(content)
        os.chmod(path, 0o600)
        if owner and not user and os.geteuid() == 0:
            import pwd

            who = pwd.getpwnam(owner)
            for p in (path.parent, path):
                os.chown(p, who.pw_uid, who.pw_gid)


def _write_unit(spec: Any, manager: str, user: bool, dry_run: bool, as_json: bool,
                secrets: list[tuple[Path, str]]) -> None:
    """Write the secrets and the unit, start it, and say what changed (see the module's docstring)."""
    from nodeagent.service.units import control, hidden_paths, legacy_path, legacy_role, render, unit_path

    text = render(spec, manager)  # type: ignore[arg-type]
    path = unit_path(manager, user, spec.unit)  # type: ignore[arg-type]
    hidden = hidden_paths(spec, manager)  # type: ignore[arg-type]
    if hidden:  # refused before anything is written: the service would fail to start (203/EXEC), in a loop
        raise UsageError(f"the service could not see {hidden[0]}: its unit has PrivateTmp=yes, which gives it a "
                         "/tmp and /var/tmp of its own", hint="move it (the virtual environment, the model, the "
                         "config file) out of /tmp and /var/tmp, e.g. to /opt or your home, then install again")
    if dry_run:
        files = [str(p) for p, _ in secrets]
        if as_json:
            print_json({"manager": manager, "unit": spec.unit.systemd if manager == "systemd" else spec.unit.label,
                        "path": str(path), "content": text.decode(), "secret_files": files})
        else:
            click.echo(f"# would write {path}" + (f" and the secret files {', '.join(files)}" if files else ""),
                       err=True)
            click.echo(text.decode(), nl=False)
        return
    legacy = legacy_path(manager, user)  # type: ignore[arg-type]
    replaced = None
    if spec.unit.name is None and legacy.exists() and legacy != path and \
            legacy_role(legacy.read_text(errors="replace")) == spec.unit.role:
        _remove(manager, user, legacy)  # the one unit of nodeagent 0.1, for this role: this one takes its place
        replaced = legacy
    _write_secrets(secrets, user, spec.run_as)
    if manager == "launchd" and user:  # its log (what the service logs): made its owner's before launchd opens it
        from nodeagent.private import private_dir, private_file
        from nodeagent.service.units import log_path

        logs = log_path(spec.unit, spec.home)
        private_file(private_dir(logs.parent) / logs.name)
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
    token = next((str(p) for p, _ in secrets if p.name.endswith(".token")), None)
    if as_json:
        print_json({"manager": manager, "path": str(path), "output": out, "change": said.split(" ")[0],
                    "replaced": str(replaced) if replaced else None, "token_file": token or spec.secrets.get("token")})
    else:
        if replaced:
            click.echo(f"replaced {replaced} (an earlier version's unit for the {spec.unit.role})", err=True)
        click.echo(f"{said}: {path}, {control(manager, user, 'running', path) or 'started'}", err=True)
        if token:
            click.echo(f"its bearer token is in {token} (give it to clients: "
                       f"{'sudo ' if not user else ''}cat {token})", err=True)


def _remove(manager: str, user: bool, path: Path) -> None:
    """Stop, disable and remove the unit, whatever state it is in."""
    from nodeagent.service.units import control

    try:
        control(manager, user, "uninstall", path)  # type: ignore[arg-type]
    except UsageError:
        path.unlink(missing_ok=True)


SECRET_ENV = {"NODEAGENT_TOKEN", "NODEAGENT_TOKEN_FILE", "NODEAGENT_BROKER", "NODEAGENT_BROKER_PASSWORD_FILE",
              "NODEAGENT_BROKER_SENTINEL_PASSWORD_FILE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}


def _passed_env() -> dict[str, str]:
    """The NODEAGENT_* and HF_* variables of this shell (the service runs with the agent's own environment), less
    the secrets and the broker's URL, which the unit carries its own way."""
    keep = {"NODEAGENT_CONFIG", "NODEAGENT_LOG_FORMAT", "NODEAGENT_HOME", "NODEAGENT_CACHE_DIR", *SECRET_ENV}
    return {k: v for k, v in os.environ.items() if k.startswith(("NODEAGENT_", "HF_")) and k not in keep}


def _chosen(manager: str, user: bool, role: str | None, instance: str | None, every: bool) -> list[tuple[Any, Path]]:
    """The installed services a command names: one role (and instance), or every one (--all or no --role)."""
    from nodeagent.service.units import installed

    units = installed(manager, user)  # type: ignore[arg-type]
    if every or role is None:
        return units
    return [(u, p) for u, p in units if u.role == role and u.name == instance]


@command.command("uninstall")
@click.option("--role", type=click.Choice(ROLES), help="The role to remove (default: node).")
@name_option
@click.option("--all", "every", is_flag=True, help="Every nodeagent service of this scope.")
@manager_option
@scope_option
@click.option("--dry-run", is_flag=True, help="Say what would be removed; change nothing.")
@json_option
@click.pass_obj
def uninstall(app: App, role: str | None, instance: str | None, every: bool, manager: str | None, user: bool,
              dry_run: bool, as_json: bool) -> None:
    """Stop and disable a role's service, and remove its file and its secret files (the others stay)."""
    from nodeagent.service.units import default_manager, secrets_dir

    manager = manager or default_manager()
    chosen = _chosen(manager, user, role or "node", instance, every)
    removed = []
    for unit, path in chosen:
        if not dry_run:
            _remove(manager, user, path)
            for secret in secrets_dir(manager, user).glob(f"{unit.stem}.*"):  # type: ignore[arg-type]
                secret.unlink(missing_ok=True)
        removed.append(str(path))
    if as_json:
        print_json({"manager": manager, "removed": removed, "dry_run": dry_run})
        return
    if not removed:
        click.echo(f"no {role or 'node'} service installed" + (f" named {instance}" if instance else ""), err=True)
    for path in removed:
        click.echo(f"{'would stop and remove' if dry_run else 'removed'} {path}", err=True)


@command.command("status")
@click.option("--role", type=click.Choice(ROLES), help="Only this role's service (default: every one).")
@name_option
@manager_option
@scope_option
@json_option
@click.pass_obj
def status(app: App, role: str | None, instance: str | None, manager: str | None, user: bool, as_json: bool) -> None:
    """Each installed nodeagent service of this scope (one per role and instance), and what the service manager
    says of it."""
    from nodeagent.service.units import control, default_manager

    manager = manager or default_manager()
    rows = []
    for unit, path in _chosen(manager, user, role, instance, False):
        rows.append({"role": unit.role, "name": unit.name, "path": str(path),
                     "running": control(manager, user, "running", path),  # type: ignore[arg-type]
                     "manager_says": control(manager, user, "status", path)})  # type: ignore[arg-type]
    if as_json:
        print_json({"manager": manager, "services": rows})
        return
    if not rows:
        click.echo(f"no nodeagent {manager} service installed ({'user' if user else 'system'} scope)")
    for row in rows:
        click.echo(f"{row['role']}{' ' + row['name'] if row['name'] else ''}: {row['path']}: {row['running']}")
        if row["manager_says"]:
            click.echo(row["manager_says"].rstrip())
