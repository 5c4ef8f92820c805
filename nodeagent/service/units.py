"""The service files `nodeagent service install` writes: a systemd unit (Linux) or a launchd plist (macOS), one per
role and instance, so that the roles of a fleet live side by side on one machine.

- **Roles.** ``node`` runs ``nodeagent serve`` (HTTP, and with a broker the worker loop; ``--follow`` holds what the
  scheduler assigns), ``worker`` runs ``nodeagent worker`` (no HTTP), ``gateway`` runs ``nodeagent gateway`` and
  ``scheduler`` runs ``nodeagent scheduler``. Each is its own unit: ``nodeagent-<role>.service`` (with an instance
  name, ``nodeagent-<role>-<name>.service``) or the launchd job ``io.nodeagent.<role>[.<name>]``; installing one
  never touches another. An install of this version replaces the single ``nodeagent.service`` of earlier ones when
  it held the same role.
- **Secrets stay out of the file's text.** A token, a Redis password and a hub token are each kept in a file of
  their own, 0600 (``secrets_dir``), which the service reads: systemd hands a system service its copy with
  ``LoadCredential=`` (the unit names ``%d/<name>``); a user service and launchd are given the file's path. The
  unit, ``systemctl show`` and the plist hold paths, never the secrets.
- **The same for every role:** the agent's own config file and ``NODEAGENT_*``/``HF_*`` environment, restarted when
  it fails, JSON logs, ``Type=notify`` (READY=1 once started, WATCHDOG=1 at half of WatchdogSec), sandboxed; a node
  or a worker is held to its plan's memory plus its margin. The launchd job is a user LaunchAgent (or a
  LaunchDaemon with UserName), kept alive after failures, never of the throttled Background process type.

Rendering is pure, so a Linux box can render a Mac's plist (``--dry-run``).
"""

from __future__ import annotations

import getpass
import os
import plistlib
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Literal, get_args

from pydantic import Field

from nodeagent.errors import UsageError
from nodeagent.units import MIB
from nodeagent.values import Frozen

Manager = Literal["systemd", "launchd"]
Role = Literal["node", "worker", "gateway", "scheduler"]
ROLES: tuple[Role, ...] = get_args(Role)
COMMANDS: dict[Role, str] = {"node": "serve", "worker": "worker", "gateway": "gateway", "scheduler": "scheduler"}
PREFIX = "nodeagent"  # systemd units: nodeagent-<role>[-<name>].service
LABEL_PREFIX = "io.nodeagent"  # launchd jobs: io.nodeagent.<role>[.<name>]
LEGACY_UNIT, LEGACY_LABEL = "nodeagent.service", "io.nodeagent.node"  # the one unit of nodeagent 0.1
# the service's own variables for its secrets: each names a file that holds one (config.read_secret reads it)
SECRET_VARIABLES = {"token": "NODEAGENT_TOKEN_FILE", "broker-password": "NODEAGENT_BROKER_PASSWORD_FILE",
                    "broker-sentinel-password": "NODEAGENT_BROKER_SENTINEL_PASSWORD_FILE", "hf-token": "HF_TOKEN_PATH"}


class Unit(Frozen):
    """Which service: a role, and an instance name when one machine runs that role more than once."""

    role: Role = "node"
    name: str | None = None

    @property
    def stem(self) -> str:
        return f"{PREFIX}-{self.role}" + (f"-{self.name}" if self.name else "")

    @property
    def systemd(self) -> str:
        return f"{self.stem}.service"

    @property
    def label(self) -> str:
        return f"{LABEL_PREFIX}.{self.role}" + (f".{self.name}" if self.name else "")

    def file_name(self, manager: Manager) -> str:
        return self.systemd if manager == "systemd" else f"{self.label}.plist"

    @classmethod
    def named(cls, role: str, name: str | None) -> "Unit":
        if name is not None and not re.fullmatch(r"[a-z0-9][a-z0-9_]{0,31}", name):
            raise UsageError(f"the instance name {name!r} is not a short lowercase name",
                             hint="use letters, digits and _ (e.g. --name pi3), up to 32")
        return cls(role=role, name=name)  # type: ignore[arg-type]

    @classmethod
    def of_file(cls, file_name: str) -> "Unit | None":
        """The unit a service file's name says (None for one that is not nodeagent's; the legacy file is a node)."""
        if file_name in (LEGACY_UNIT, f"{LEGACY_LABEL}.plist"):
            return cls()
        found = re.fullmatch(rf"{PREFIX}-({'|'.join(ROLES)})(?:-([a-z0-9_]+))?\.service", file_name) or \
            re.fullmatch(rf"{re.escape(LABEL_PREFIX)}\.({'|'.join(ROLES)})(?:\.([a-z0-9_]+))?\.plist", file_name)
        return cls(role=found.group(1), name=found.group(2)) if found else None  # type: ignore[arg-type]


class ServiceSpec(Frozen):
    model: str
    argv: list[str] = Field(description="The command: the interpreter, -m nodeagent <role's command>, its options")
    unit: Unit = Unit()
    user: bool = True
    env: dict[str, str] = Field(default_factory=dict)
    secrets: dict[str, str] = Field(default_factory=dict, description="Secret name -> the 0600 file that holds it")
    readable_paths: list[str] = Field(default_factory=list, description="Model folders the service must read")
    memory_high_bytes: int | None = None
    memory_max_bytes: int | None = None
    watchdog_s: int = 60
    stop_timeout_s: int = 60
    run_as: str | None = Field(None, description="System services: the account that runs the agent")
    state_dir: str | None = Field(None, description="User services: NODEAGENT_HOME (queue, node id), writable")
    cache_dir: str | None = None
    home: str = Field(default_factory=lambda: str(Path.home()))


def default_manager() -> Manager:
    return "launchd" if sys.platform == "darwin" else "systemd"


def spec_for(unit: Unit, models: list[str], argv_tail: list[str], config_file: Path, env: dict[str, str],
             user: bool, planned_bytes: int | None, margin_bytes: int, readable: list[Path], drain_s: float,
             state_dir: Path | None = None, cache_dir: Path | None = None,
             secrets: dict[str, str] | None = None) -> ServiceSpec:
    """The service of this role for these models (a node's or a worker's: one, or a model set) and settings: memory
    limits from the plan plus its margin. ``secrets``: name -> the file that holds it."""
    high = planned_bytes + margin_bytes if planned_bytes else None
    cap = high + max(margin_bytes, high // 10) if high else None
    flags = [a for m in models for a in ("--model", m)]  # none: serve and worker read the config file's [[models]]
    what = {"gateway": "the fleet's gateway", "scheduler": "the fleet's scheduler"}.get(unit.role) or \
        ", ".join(models) or ("the scheduler's assignments" if "--follow" in argv_tail else "the config file's models")
    return ServiceSpec(model=what, unit=unit,
                       argv=[sys.executable, "-m", "nodeagent", COMMANDS[unit.role], *flags, *argv_tail],
                       user=user, env={"NODEAGENT_CONFIG": str(config_file), "NODEAGENT_LOG_FORMAT": "json", **env},
                       secrets=secrets or {}, readable_paths=sorted({str(p) for p in readable}),
                       memory_high_bytes=high, memory_max_bytes=cap, stop_timeout_s=int(drain_s) + 30,
                       run_as=None if user else (os.environ.get("SUDO_USER") or getpass.getuser()),
                       state_dir=str(state_dir) if state_dir else None, cache_dir=str(cache_dir) if cache_dir else None)


def _quote(arg: str, command: bool = False) -> str:
    """One word of a unit file line: ``%`` (a specifier) doubled, and on a command line ``$`` (a variable)
    too; quoted with C escapes when it holds anything else than plain characters. A control character (a
    newline would start a line of its own: ``ExecStartPre=...``) is refused."""
    bad = next((c for c in arg if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise UsageError(f"a value for the service unit holds a control character ({bad!r}): {arg[:60]!r}",
                         hint="remove the newline or control character from that setting or argument")
    arg = arg.replace("%", "%%")
    if command:
        arg = arg.replace("$", "$$")
    if arg and all(c.isalnum() or c in "-_./:=@%+," for c in arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_systemd(spec: ServiceSpec) -> str:
    lines = ["[Unit]", f"Description=nodeagent {spec.unit.role}: {spec.model}",
             "After=network-online.target", "Wants=network-online.target",
             "StartLimitIntervalSec=600", "StartLimitBurst=5", "",
             "[Service]", "Type=notify", "NotifyAccess=main",
             "ExecStart=" + " ".join(_quote(a, command=True) for a in spec.argv),
             "Restart=on-failure", "RestartSec=5", f"WatchdogSec={spec.watchdog_s}",
             f"TimeoutStopSec={spec.stop_timeout_s}", "KillSignal=SIGTERM"]
    if spec.run_as and spec.run_as != "root":
        lines.append(f"User={spec.run_as}")
    # what the service writes (its queue, node id, ledger) is its user's only
    lines += ["StateDirectory=nodeagent", "StateDirectoryMode=0700", "CacheDirectory=nodeagent", "UMask=0077"]
    if spec.state_dir and spec.user:  # the user's own queue and node id, shared with their shell
        lines += [f"Environment={_quote(f'NODEAGENT_HOME={spec.state_dir}')}",
                  "ReadWritePaths=" + " ".join(f"-{_quote(p)}" for p in (spec.state_dir, spec.cache_dir) if p)]
    else:  # a system service keeps its state in /var/lib/nodeagent and its cache in /var/cache/nodeagent
        lines += ["Environment=NODEAGENT_HOME=%S/nodeagent", "Environment=NODEAGENT_CACHE_DIR=%C/nodeagent"]
    lines += [f"Environment={_quote(f'{k}={v}')}" for k, v in sorted(spec.env.items())]
    for name, path in sorted(spec.secrets.items()):
        if spec.user:  # a user manager's service reads the user's own 0600 file
            lines.append(f"Environment={_quote(f'{SECRET_VARIABLES[name]}={path}')}")
        else:  # systemd reads the root-owned file and hands the service a copy only it may read
            lines += [f"LoadCredential={name}:{_quote(path)}", f"Environment={SECRET_VARIABLES[name]}=%d/{name}"]
    lines += ["NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=read-only", "PrivateTmp=yes",
              "ProtectKernelTunables=yes", "ProtectControlGroups=yes", "RestrictSUIDSGID=yes"]
    if spec.readable_paths:  # the model folders stay readable under the sandbox
        lines.append("ReadOnlyPaths=" + " ".join(f"-{_quote(p)}" for p in spec.readable_paths))
    if spec.memory_high_bytes:
        lines.append(f"MemoryHigh={spec.memory_high_bytes // MIB}M")
    if spec.memory_max_bytes:
        lines.append(f"MemoryMax={spec.memory_max_bytes // MIB}M")
    lines += ["", "[Install]", f"WantedBy={'default.target' if spec.user else 'multi-user.target'}", ""]
    return "\n".join(lines)


# PrivateTmp=yes gives the service empty /tmp and /var/tmp of its own: what lies under the host's is not there
HIDDEN_BY_SANDBOX = ("/tmp", "/var/tmp")


def hidden_paths(spec: ServiceSpec, manager: Manager) -> list[str]:
    """The files the unit needs (its interpreter, the model files named, the config file, a user service's secret
    files) that its sandbox would hide from it, as given and as they resolve. launchd has no such sandbox."""
    if manager != "systemd":
        return []
    argv = spec.argv
    needed = [argv[0], *(argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--model")]
    needed.append(spec.env.get("NODEAGENT_CONFIG", ""))
    if spec.user:  # a system service's are read by systemd itself (LoadCredential), outside the sandbox
        needed += list(spec.secrets.values())
    found = []
    for given in filter(None, needed):
        path = Path(given).expanduser()
        if not path.exists():
            continue  # a catalog name (not a path), or a config file that is not there (none is read)
        for p in dict.fromkeys((path.absolute(), path.resolve())):
            if any(p == Path(d) or Path(d) in p.parents for d in HIDDEN_BY_SANDBOX):
                found.append(str(p))
    return list(dict.fromkeys(found))


def log_path(unit: Unit, home: str | Path) -> Path:
    """Where a launchd job's output goes (one log a service)."""
    return Path(home) / "Library" / "Logs" / "nodeagent" / f"{unit.stem}.log"


def render_launchd(spec: ServiceSpec) -> bytes:
    env = dict(spec.env)
    if spec.state_dir:
        env.setdefault("NODEAGENT_HOME", spec.state_dir)
    if spec.cache_dir:
        env.setdefault("NODEAGENT_CACHE_DIR", spec.cache_dir)
    env.update({SECRET_VARIABLES[name]: path for name, path in spec.secrets.items()})
    logs = str(log_path(spec.unit, spec.home))
    job: dict = {
        "Label": spec.unit.label,
        "ProgramArguments": spec.argv,
        "EnvironmentVariables": env,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restarted after a failure, not after a clean stop
        "ThrottleInterval": 30,
        "ProcessType": "Standard",  # not Background: macOS throttles those
        "StandardOutPath": logs,
        "StandardErrorPath": logs,
        "ExitTimeOut": spec.stop_timeout_s,
        "Umask": 0o077,  # what the job writes (its queue, node id, log) is its user's only
    }
    if not spec.user and spec.run_as:
        job["UserName"] = spec.run_as
    return plistlib.dumps(job, sort_keys=True)


def unit_dir(manager: Manager, user: bool, home: Path | None = None) -> Path:
    home = home or Path.home()
    if manager == "systemd":
        return (home / ".config" / "systemd" / "user") if user else Path("/etc/systemd/system")
    return (home / "Library" / "LaunchAgents") if user else Path("/Library/LaunchDaemons")


def unit_path(manager: Manager, user: bool, unit: Unit | None = None, home: Path | None = None) -> Path:
    return unit_dir(manager, user, home) / (unit or Unit()).file_name(manager)


def legacy_path(manager: Manager, user: bool, home: Path | None = None) -> Path:
    """The one service file of nodeagent 0.1 (a node, or a gateway installed with --gateway)."""
    return unit_dir(manager, user, home) / (LEGACY_UNIT if manager == "systemd" else f"{LEGACY_LABEL}.plist")


def installed(manager: Manager, user: bool, home: Path | None = None) -> list[tuple[Unit, Path]]:
    """Every nodeagent service file in this scope's folder, by the unit its name says (the legacy one too)."""
    folder = unit_dir(manager, user, home)
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.iterdir()):
        unit = Unit.of_file(path.name)
        if unit is not None and path.is_file():
            out.append((unit, path))
    return out


def legacy_role(text: str) -> Role:
    """The role the legacy unit ran: a gateway's command says so, anything else was a node's `serve`."""
    return "gateway" if re.search(r"-m nodeagent gateway\b|<string>gateway</string>", text) else "node"


def secrets_dir(manager: Manager, user: bool, home: Path | None = None) -> Path:
    """Where the installer keeps a service's secrets: one 0600 file each, in a 0700 folder (root's for a system
    systemd service, which reads them through LoadCredential; the run-as user's for launchd and user services)."""
    home = home or Path.home()
    if manager == "systemd":
        return (home / ".config" / "nodeagent" / "secrets") if user else Path("/etc/nodeagent/secrets")
    return (home / "Library" / "Application Support" / "nodeagent" / "secrets") if user else \
        Path("/Library/Application Support/nodeagent/secrets")


# what a service file must never hold: a secret's variable with its value, a token on the command line, or a broker
# URL with a secret in it (read as redis-py reads it: ``urls.UrlParts``)
_HOLDS_SECRET = re.compile(r"(NODEAGENT_TOKEN|HF_TOKEN|HUGGING_FACE_HUB_TOKEN)(=|</key>\s*<string>)(?!\s*<)"
                           r"|--token[ =]")
_BROKER_URL = re.compile(r"rediss?(?:\+sentinel)?://[^\s\"'<>]+|unix://[^\s\"'<>]+")


def holds_secret(text: str) -> str | None:
    """What kind of secret a service file's text holds in clear (None when none): named, never quoted. A broker URL
    that a raw '/', '?' or '#' in its password cut short holds it too, as written or as an earlier version wrote it
    into a unit (the rest of the password percent-encoded as an option, each ``%`` doubled)."""
    from urllib.parse import unquote

    from nodeagent.urls import UrlParts, raw_secret

    found = _HOLDS_SECRET.search(text)
    if found is not None:
        return found.group(1) or "--token"
    for url in _BROKER_URL.findall(text.replace("%%", "%")):
        if raw_secret(url) or raw_secret(unquote(url)):
            return "a broker URL with its password"
        try:
            kinds = UrlParts.of(url).secrets()
        except ValueError:
            continue
        if kinds:
            return "a broker URL with its " + ("Sentinels' password" if "broker-password" not in kinds else "password")
    return None


def render(spec: ServiceSpec, manager: Manager) -> bytes:
    return render_systemd(spec).encode() if manager == "systemd" else render_launchd(spec)


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        raise UsageError(f"{argv[0]} is not on this machine", hint="use --dry-run to render the file") from None
    if done.returncode != 0:
        raise UsageError(f"{shlex.join(argv)} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}",
                         hint="see the manager's own log")
    return done.stdout


Action = Literal["install", "restart", "uninstall", "status", "running", "log"]


def control(manager: Manager, user: bool, action: Action, path: Path) -> str:
    """Tell the service manager about the service of this file: load and start, restart with the file as it is
    now, stop and unload, or report (its status, whether it runs, its last log lines)."""
    if manager == "systemd":
        name = path.name
        ctl = ["systemctl", *(["--user"] if user else [])]
        if action == "install":
            _run([*ctl, "daemon-reload"])
            return _run([*ctl, "enable", "--now", name])
        if action == "restart":
            _run([*ctl, "daemon-reload"])
            return _run([*ctl, "restart", name])
        if action == "uninstall":
            out = _run([*ctl, "disable", "--now", name])
            path.unlink(missing_ok=True)
            subprocess.run([*ctl, "daemon-reload"], capture_output=True)
            return out
        if action == "running":
            return subprocess.run([*ctl, "is-active", name], capture_output=True, text=True).stdout.strip()
        if action == "log":
            journal = ["journalctl", *(["--user"] if user else []), "-u", name, "-n", "8", "--no-pager", "-o", "cat"]
            got = subprocess.run(journal, capture_output=True, text=True)
            return got.stdout or subprocess.run([*ctl, "status", "--no-pager", "-n", "8", name], capture_output=True,
                                                text=True).stdout
        return subprocess.run([*ctl, "status", "--no-pager", name], capture_output=True, text=True).stdout
    label = path.name.removesuffix(".plist")
    domain = f"gui/{os.getuid()}" if user else "system"
    if action == "install":
        return _run(["launchctl", "bootstrap", domain, str(path)])
    if action == "restart":  # a job's plist is read at bootstrap: out, and in again
        subprocess.run(["launchctl", "bootout", f"{domain}/{label}"], capture_output=True)
        return _run(["launchctl", "bootstrap", domain, str(path)])
    if action == "uninstall":
        out = _run(["launchctl", "bootout", f"{domain}/{label}"])
        path.unlink(missing_ok=True)
        return out
    printed = subprocess.run(["launchctl", "print", f"{domain}/{label}"], capture_output=True, text=True).stdout
    if action == "running":
        return "active" if "state = running" in printed else "inactive"
    return printed
