"""Check 6: nodeagent's services (one per role: a node, a worker, the gateway, the scheduler; user or system; systemd or
launchd): installed, running, and holding no secret in clear.

The service manager is asked through ``Edges.services`` (what `nodeagent service status` asks, and each file's
text); its answer is read here: systemd's ``Active: active``, launchd's ``state = running``.
"""

from __future__ import annotations

import re

from nodeagent.doctor.edges import Edges, InstalledService
from nodeagent.doctor.types import Check, fail, ok, warn
from nodeagent.service.units import Manager, holds_secret, log_path, unit_dir

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


def _look(manager: str, s: InstalledService) -> str:
    if manager == "systemd":
        scope = "--user " if s.user else ""
        sudo = "" if s.user else "sudo "
        name = s.file.removesuffix(".service")
        return f"{sudo}systemctl {scope}status {name}; {sudo}journalctl {scope}-u {name} -n 50"
    label = s.file.removesuffix(".plist")
    if s.user:
        from nodeagent.service.units import Unit

        unit = Unit.of_file(s.file) or Unit()
        return f"launchctl print gui/$(id -u)/{label}; tail -n 50 {log_path(unit, '~')}"
    return f"sudo launchctl print system/{label}"


def _where(manager: str, s: InstalledService) -> str:
    return f"the {'user' if s.user else 'system'} {manager} service ({unit_dir(manager, s.user) / s.file})"


def service_check(e: Edges) -> Check:
    manager: Manager = "launchd" if e.system.system() == "darwin" else "systemd"
    found = e.services(manager)
    if not found:
        return warn(SERVICE, f"not installed (no nodeagent {manager} file in {unit_dir(manager, True)} or "
                             f"{unit_dir(manager, False)})", "nodeagent service install --model MODEL")
    for s in found:
        secret = holds_secret(s.text)
        if secret:
            return fail(SERVICE, f"{_where(manager, s)} holds a secret in clear ({secret}...): any local user may read "
                                 "its file, and `systemctl show` prints it",
                        "install it again with nodeagent service install (it keeps secrets in a 0600 file the "
                        "service reads), then check the file")
    down = [s for s in found if not running(manager, s.status)]
    if down:
        s = down[0]
        return fail(SERVICE, f"{_where(manager, s)} is installed but not running: {_state(manager, s.status)}" +
                    (f" ({len(down) - 1} more not running)" if len(down) > 1 else ""), _look(manager, s))
    if len(found) == 1:
        s = found[0]
        return ok(SERVICE, f"{_where(manager, s)} is running: {_state(manager, s.status)}")
    return ok(SERVICE, f"{len(found)} services running: " +
              ", ".join(f"{s.file} ({'user' if s.user else 'system'})" for s in found))
