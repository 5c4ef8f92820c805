"""The edges the doctor's checks read through, and this machine's live ones.

Every check is a pure function of an ``Edges``: the machine (a ``SystemSource``, live or recorded), what the
installed llama.cpp reports, the environment, PATH lookups, free disk space, the broker, an HTTP HEAD to the
hub and the service manager's status. Tests pass recorded values; ``live_edges`` wires this machine's. Nothing
here runs a process or opens a connection until a check asks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from nodeagent.config import NodeConfig
from nodeagent.errors import ConfigError, NodeAgentError, ProbeError
from nodeagent.hardware import probe
from nodeagent.hardware.system import LiveSystem, RecordedSystem, SystemSource
from nodeagent.hardware.types import HardwareInfo, LlamaCppSupport

HUB_TIMEOUT_S = 3.0  # the HEAD to the hub: a check never waits longer than this (plus a moment)


def _none(*_: Any) -> None:
    return None


def _no_answer(url: str, timeout_s: float) -> None:
    raise OSError("no HTTP client was given")


@dataclass(frozen=True)
class InstalledService:
    """One of nodeagent's service files, as the doctor sees it: its file name, its scope, what the service manager
    says of it, and the file's text."""

    file: str
    user: bool
    status: str
    text: str = ""


def _no_services(manager: str) -> list[InstalledService]:
    return []


@dataclass
class Edges:
    """What the checks read. ``llama`` returns what the installed llama.cpp reports and raises a
    NodeAgentError when its library fails to load; ``head(url, timeout_s)`` returns when the server answers and
    raises otherwise; ``services(manager)`` are nodeagent's installed services (each role's, user and system)."""

    system: SystemSource
    config: NodeConfig
    llama: Callable[[], LlamaCppSupport]
    env: Mapping[str, str] = field(default_factory=dict)
    which: Callable[[str], str | None] = _none
    disk_free: Callable[[Path], int | None] = _none
    open_broker: Callable[[], Any] | None = None
    head: Callable[[str, float], Any] = _no_answer
    services: Callable[[str], list[InstalledService]] = _no_services
    wall: Callable[[], float] = time.time
    hub_timeout_s: float = HUB_TIMEOUT_S
    memo: dict[str, Any] = field(default_factory=dict)

    def once(self, key: str, read: Callable[[], Any]) -> Any:
        """``read()`` the first time ``key`` is asked for, the same answer after (two checks, one reading)."""
        if key not in self.memo:
            self.memo[key] = read()
        return self.memo[key]

    @property
    def llama_error(self) -> str | None:
        """Why the installed llama.cpp failed to load, or None."""
        return self._llama()[1]

    @property
    def hardware(self) -> HardwareInfo:
        """The probe of this machine, with what its llama.cpp build reports."""
        return self.once("hardware", lambda: probe(_WithLlama(self.system, self._llama()[0])))

    def _llama(self) -> tuple[LlamaCppSupport, str | None]:
        def read() -> tuple[LlamaCppSupport, str | None]:
            try:
                return self.llama(), None
            except NodeAgentError as exc:
                return LlamaCppSupport(installed=True), str(exc)

        return self.once("llama", read)


class _WithLlama:
    """A SystemSource whose llama.cpp facts were read already (in a child process, see ``read_llama``)."""

    def __init__(self, system: SystemSource, support: LlamaCppSupport) -> None:
        self._system, self._support = system, support

    def __getattr__(self, name: str) -> Any:
        return getattr(self._system, name)

    def llama_cpp(self) -> LlamaCppSupport:
        return self._support


# The child that loads llama.cpp: a build that uses an instruction this CPU lacks can die with SIGILL as it
# loads, and that must end the child, not the doctor.
_CHILD = """\
import json
from nodeagent.hardware.system import LiveSystem
try:
    print(LiveSystem().llama_cpp().model_dump_json())
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""


def read_llama(timeout_s: float = 120.0) -> LlamaCppSupport:
    """What the installed llama.cpp reports, read in a child process of this interpreter."""
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ProbeError(f"loading llama-cpp-python took over {timeout_s:.0f} s") from None
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        why = " (an illegal instruction: the build uses one this CPU lacks)" if name == "SIGILL" else ""
        raise ProbeError(f"loading llama-cpp-python killed the process with {name}{why}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ProbeError(f"loading llama-cpp-python failed: {last}")
    data = json.loads(lines[-1])
    if "error" in data:
        raise ProbeError(f"llama-cpp-python is installed but its library failed to load: {data['error']}")
    return LlamaCppSupport.model_validate(data)


def which(name: str) -> str | None:
    """``name`` on PATH, or in this interpreter's own bin folder (where pip puts cmake in a virtual
    environment that is not activated)."""
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), str(Path(sys.executable).parent)])
    return shutil.which(name, path=path)


def http_head(url: str, timeout_s: float) -> int:
    """HEAD ``url``: the status when the server answers (any status: it was reached), an OSError when not."""
    import urllib.error
    import urllib.request

    from nodeagent import __version__

    request = urllib.request.Request(url, method="HEAD", headers={"User-Agent": f"nodeagent/{__version__} doctor"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:  # noqa: S310 (an https URL we chose)
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def services(manager: str) -> list[InstalledService]:
    """nodeagent's installed services (every role's, user and system), with what systemd or launchd says of each (the
    commands `nodeagent service status` runs, bounded in time) and each file's text."""
    from nodeagent.service.units import installed

    out = []
    for user in (True, False):
        for _unit, path in installed(manager, user):  # type: ignore[arg-type]
            if manager == "systemd":
                argv = ["systemctl", *(["--user"] if user else []), "status", "--no-pager", path.name]
            else:
                argv = ["launchctl", "print", f"{f'gui/{os.getuid()}' if user else 'system'}/{path.stem}"]
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
                status = done.stdout or done.stderr
            except FileNotFoundError:
                status = f"{argv[0]} is not on this machine"
            except subprocess.TimeoutExpired:
                status = f"{' '.join(argv)} gave no answer in 10 s"
            try:
                text = path.read_text(errors="replace")
            except OSError:
                text = ""
            out.append(InstalledService(file=path.name, user=user, status=status, text=text))
    return out


def live_edges(config: NodeConfig, env: Mapping[str, str] | None = None) -> Edges:
    """This machine's edges; its hardware from NODEAGENT_HARDWARE_FIXTURE when that names a recorded machine
    (then llama.cpp's facts are the recording's too; the rest is this machine's)."""
    from nodeagent.broker.open import open_broker

    fixture = config.hardware_fixture
    try:
        system: SystemSource = RecordedSystem.load(fixture) if fixture else LiveSystem()
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read the recorded machine {fixture}: {exc}",
                          hint="check NODEAGENT_HARDWARE_FIXTURE (a JSON file like tests/fixtures/hardware/*.json)"
                          ) from None
    return Edges(system=system, config=config, llama=system.llama_cpp if fixture else read_llama,
                 env=dict(os.environ) if env is None else env, which=which,
                 disk_free=lambda path: LiveSystem().disk_free(str(path)),
                 open_broker=lambda: open_broker(config.broker, config.state_dir, config=config), head=http_head,
                 services=services)
