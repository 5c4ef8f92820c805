"""Check 6: whether nodeagent's systemd unit (user or system) or launchd job is installed and running.

The service manager is asked through ``Edges.service_status`` (the commands `nodeagent service status` runs);
its answer is read here: systemd's ``Active: active``, launchd's ``state = running``.
"""

from __future__ import annotations

import re

from nodeagent.doctor.edges import Edges
from nodeagent.doctor.types import Check, fail, ok, warn
from nodeagent.service.units import LABEL, Manager, unit_path

SERVICE = "service"
_RUNNING = {"systemd": re.compile(r"^\s*Active:\s+active\b", re.M),
            "launchd": re.compile(r"^\s*state = running\b", re.M)}
_STATE = {"systemd": re.compile(r"^\s*(Active:.*)$", re.M), "launchd": re.compile(r"^\s*(state = .*)$", re.M)}


def running(manager: str, status: str) -> bool:
    return bool(_RUNNING[manager].search(status))


def _state(manager: str, status: str) -> str:
    found = _STATE[manager].search(status)
    if found:
        return found.group(1).strip()
    return next((line.strip() for line in status.splitlines() if line.strip()), "no status")


def _look(manager: str, user: bool) -> str:
    if manager == "systemd":
        scope = "--user " if user else ""
        sudo = "" if user else "sudo "
        return f"{sudo}systemctl {scope}status nodeagent; {sudo}journalctl {scope}-u nodeagent -n 50"
    if user:
        return f"launchctl print gui/$(id -u)/{LABEL}; tail -n 50 ~/Library/Logs/nodeagent/nodeagent.log"
    return f"sudo launchctl print system/{LABEL}"


def service_check(e: Edges) -> Check:
    manager: Manager = "launchd" if e.system.system() == "darwin" else "systemd"
    found = [(user, status) for user in (True, False) if (status := e.service_status(manager, user)) is not None]
    if not found:
        return warn(SERVICE, f"not installed (no {manager} file at {unit_path(manager, True)} or "
                             f"{unit_path(manager, False)})", "nodeagent service install --model MODEL")
    for user, status in found:
        if running(manager, status):
            where = f"the {'user' if user else 'system'} {manager} service ({unit_path(manager, user)})"
            return ok(SERVICE, f"{where} is running: {_state(manager, status)}")
    user, status = found[0]
    where = f"the {'user' if user else 'system'} {manager} service ({unit_path(manager, user)})"
    return fail(SERVICE, f"{where} is installed but not running: {_state(manager, status)}", _look(manager, user))
