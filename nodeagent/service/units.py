"""The service files `nodeagent service install` writes: a systemd unit (Linux) or a launchd plist (macOS).

Both run ``nodeagent serve --model M`` with the agent's own config file and environment, restart it when it
fails, and log JSON lines. The systemd unit is ``Type=notify`` (the agent sends READY=1 once loaded and
WATCHDOG=1 at half of WatchdogSec), sandboxed, and held to the plan's memory plus its margin. The launchd job is
a user LaunchAgent (or a LaunchDaemon with UserName), kept alive after failures, never of the throttled
Background process type. Rendering is pure, so a Linux box can render a Mac's plist (``--dry-run``).
"""

from __future__ import annotations

import getpass
import os
import plistlib
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field

from nodeagent.errors import UsageError
from nodeagent.units import MIB
from nodeagent.values import Frozen

Manager = Literal["systemd", "launchd"]
LABEL = "io.nodeagent.node"
UNIT = "nodeagent.service"


class ServiceSpec(Frozen):
    model: str
    argv: list[str] = Field(description="The command: the interpreter, -m nodeagent serve, its options")
    user: bool = True
    env: dict[str, str] = Field(default_factory=dict)
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


def spec_for(models: list[str], argv_tail: list[str], config_file: Path, env: dict[str, str], user: bool,
             planned_bytes: int | None, margin_bytes: int, readable: list[Path], drain_s: float,
             state_dir: Path | None = None, cache_dir: Path | None = None, command: str = "serve") -> ServiceSpec:
    """The service for these models (one, or a model set) and settings: memory limits from the plan plus its
    margin. ``command``: serve, or gateway (the fleet's endpoint: no model)."""
    high = planned_bytes + margin_bytes if planned_bytes else None
    cap = high + max(margin_bytes, high // 10) if high else None
    flags = [a for m in models for a in ("--model", m)]  # none: serve reads the config file's [[models]]
    what = "the fleet's gateway" if command == "gateway" else ", ".join(models) or "the config file's models"
    return ServiceSpec(model=what, argv=[sys.executable, "-m", "nodeagent", command, *flags, *argv_tail],
                       user=user, env={"NODEAGENT_CONFIG": str(config_file), "NODEAGENT_LOG_FORMAT": "json", **env},
                       readable_paths=sorted({str(p) for p in readable}), memory_high_bytes=high,
                       memory_max_bytes=cap, stop_timeout_s=int(drain_s) + 30,
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
    lines = ["[Unit]", f"Description=nodeagent: local-inference node ({spec.model})",
             "After=network-online.target", "Wants=network-online.target",
             "StartLimitIntervalSec=600", "StartLimitBurst=5", "",
             "[Service]", "Type=notify", "NotifyAccess=main",
             "ExecStart=" + " ".join(_quote(a, command=True) for a in spec.argv),
             "Restart=on-failure", "RestartSec=5", f"WatchdogSec={spec.watchdog_s}",
             f"TimeoutStopSec={spec.stop_timeout_s}", "KillSignal=SIGTERM"]
    if spec.run_as and spec.run_as != "root":
        lines.append(f"User={spec.run_as}")
    lines += ["StateDirectory=nodeagent", "CacheDirectory=nodeagent"]
    if spec.state_dir and spec.user:  # the user's own queue and node id, shared with their shell
        lines += [f"Environment={_quote(f'NODEAGENT_HOME={spec.state_dir}')}",
                  "ReadWritePaths=" + " ".join(f"-{_quote(p)}" for p in (spec.state_dir, spec.cache_dir) if p)]
    else:  # a system service keeps its state in /var/lib/nodeagent and its cache in /var/cache/nodeagent
        lines += ["Environment=NODEAGENT_HOME=%S/nodeagent", "Environment=NODEAGENT_CACHE_DIR=%C/nodeagent"]
    lines += [f"Environment={_quote(f'{k}={v}')}" for k, v in sorted(spec.env.items())]
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
    """The files the unit needs (its interpreter, the model files named, the config file) that its sandbox would
    hide from it, as given and as they resolve. launchd has no such sandbox."""
    if manager != "systemd":
        return []
    argv = spec.argv
    needed = [argv[0], *(argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--model")]
    needed.append(spec.env.get("NODEAGENT_CONFIG", ""))
    found = []
    for given in filter(None, needed):
        path = Path(given).expanduser()
        if not path.exists():
            continue  # a catalog name (not a path), or a config file that is not there (none is read)
        for p in dict.fromkeys((path.absolute(), path.resolve())):
            if any(p == Path(d) or Path(d) in p.parents for d in HIDDEN_BY_SANDBOX):
                found.append(str(p))
    return list(dict.fromkeys(found))


def render_launchd(spec: ServiceSpec) -> bytes:
    logs = Path(spec.home) / "Library" / "Logs" / "nodeagent"
    job: dict = {
        "Label": LABEL,
        "ProgramArguments": spec.argv,
        "EnvironmentVariables": spec.env,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restarted after a failure, not after a clean stop
        "ThrottleInterval": 30,
        "ProcessType": "Standard",  # not Background: macOS throttles those
        "StandardOutPath": str(logs / "nodeagent.log"),
        "StandardErrorPath": str(logs / "nodeagent.log"),
        "ExitTimeOut": spec.stop_timeout_s,
    }
    if not spec.user and spec.run_as:
        job["UserName"] = spec.run_as
    return plistlib.dumps(job, sort_keys=True)


def unit_path(manager: Manager, user: bool, home: Path | None = None) -> Path:
    home = home or Path.home()
    if manager == "systemd":
        return (home / ".config" / "systemd" / "user" / UNIT) if user else Path("/etc/systemd/system") / UNIT
    return (home / "Library" / "LaunchAgents" / f"{LABEL}.plist") if user else \
        Path("/Library/LaunchDaemons") / f"{LABEL}.plist"


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
    """Tell the service manager: load and start, restart with the file as it is now, stop and unload, or report
    (its status, whether it runs, its last log lines)."""
    if manager == "systemd":
        ctl = ["systemctl", *(["--user"] if user else [])]
        if action == "install":
            _run([*ctl, "daemon-reload"])
            return _run([*ctl, "enable", "--now", UNIT])
        if action == "restart":
            _run([*ctl, "daemon-reload"])
            return _run([*ctl, "restart", UNIT])
        if action == "uninstall":
            out = _run([*ctl, "disable", "--now", UNIT])
            path.unlink(missing_ok=True)
            subprocess.run([*ctl, "daemon-reload"], capture_output=True)
            return out
        if action == "running":
            return subprocess.run([*ctl, "is-active", UNIT], capture_output=True, text=True).stdout.strip()
        if action == "log":
            journal = ["journalctl", *(["--user"] if user else []), "-u", UNIT, "-n", "8", "--no-pager", "-o", "cat"]
            got = subprocess.run(journal, capture_output=True, text=True)
            return got.stdout or subprocess.run([*ctl, "status", "--no-pager", "-n", "8", UNIT], capture_output=True,
                                                text=True).stdout
        return subprocess.run([*ctl, "status", "--no-pager", UNIT], capture_output=True, text=True).stdout
    domain = f"gui/{os.getuid()}" if user else "system"
    if action == "install":
        return _run(["launchctl", "bootstrap", domain, str(path)])
    if action == "restart":  # a job's plist is read at bootstrap: out, and in again
        subprocess.run(["launchctl", "bootout", f"{domain}/{LABEL}"], capture_output=True)
        return _run(["launchctl", "bootstrap", domain, str(path)])
    if action == "uninstall":
        out = _run(["launchctl", "bootout", f"{domain}/{LABEL}"])
        path.unlink(missing_ok=True)
        return out
    printed = subprocess.run(["launchctl", "print", f"{domain}/{LABEL}"], capture_output=True, text=True).stdout
    if action == "running":
        return "active" if "state = running" in printed else "inactive"
    return printed
