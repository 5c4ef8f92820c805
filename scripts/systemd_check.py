"""The service on a real systemd: a minimal Debian 12 booted with systemd inside systemd-nspawn on this machine,
nodeagent installed in it from the wheel built from this checkout, and `nodeagent service install --system` put
through what a service must survive. Run by scripts/systemd-check (as root); about 4 minutes, most of it the
watchdog's 60 s and the first debootstrap.

What it proves, each printed as a line and saved in benchmarks/results/systemd_check.json:
- the unit reaches active (running) through Type=notify, with its status line;
- kill -9 of the service restarts it; SIGSTOP trips the watchdog (WatchdogSec=60) and restarts it;
- `systemctl stop` exits 0, in the time it took;
- it is back, enabled, after the container reboots;
- a model under /tmp (which the unit's PrivateTmp=yes hides) is refused, naming it, and nothing is installed;
- installing again with a changed unit restarts the running service, and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORK = Path(os.environ.get("NODEAGENT_NSPAWN_DIR", "/var/lib/nodeagent-nspawn"))
ROOTFS = WORK / "bookworm"
MACHINE = "nodeagent-check"
PACKAGES = "systemd,systemd-sysv,dbus,python3,python3-venv,ca-certificates,procps,libgomp1,libstdc++6"
MODEL = "/opt/models/SmolLM2-135M-Instruct.Q4_1.gguf"
NA = "/opt/nodeagent/bin/nodeagent"


def say(what: str) -> None:
    print(what, flush=True)


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, **kw)  # type: ignore[call-overload]


def rootfs() -> None:
    """A minimal Debian 12 with systemd, made once (about 45 s) and kept under WORK."""
    if (ROOTFS / "usr" / "bin" / "systemctl").exists():
        return
    say(f"making {ROOTFS} with debootstrap (about 45 s)")
    ROOTFS.parent.mkdir(parents=True, exist_ok=True)
    done = run(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", "bookworm", str(ROOTFS),
                "http://deb.debian.org/debian"])
    if done.returncode != 0:
        shutil.rmtree(ROOTFS, ignore_errors=True)
        raise SystemExit(f"debootstrap failed: {done.stderr[-2000:]}")


def wheels(into: Path) -> None:
    """The nodeagent wheel built from this checkout, and a wheel of every dependency (from pip's cache and the
    package index, as this machine reaches them; llama-cpp-python's is the build pip cached here), so the
    container installs with no network of its own."""
    into.mkdir(parents=True, exist_ok=True)
    for old in into.glob("*.whl"):
        old.unlink()
    built = run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(into), str(ROOT)])
    if built.returncode != 0:
        raise SystemExit(f"building the wheel failed: {built.stderr[-2000:]}")
    wheel = next(into.glob("nodeagent-*.whl"))
    # Debian 12's Python is 3.11.2: redis wants async-timeout below 3.11.3, which this Python does not ask for
    got = run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(into), str(wheel), "async-timeout>=4.0.3"])
    if got.returncode != 0:
        raise SystemExit(f"the dependencies' wheels could not be had: {got.stderr[-2000:]}")


def install_nodeagent() -> None:
    """A fresh virtual environment in the container, nodeagent installed from the wheel (dependencies from PyPI,
    llama-cpp-python from the wheel beside it), and the test model where the service may read it."""
    wheels(ROOTFS / "opt" / "src")
    models = ROOTFS / "opt" / "models"
    models.mkdir(parents=True, exist_ok=True)
    from nodeagent.config import load
    from nodeagent.store.pkgindex import test_model_path

    shutil.copy(test_model_path("smollm2-135m-instruct", load().test_models_dir), models)
    shutil.rmtree(ROOTFS / "opt" / "nodeagent", ignore_errors=True)
    say("installing nodeagent from its wheel into /opt/nodeagent in the container")
    done = run(["systemd-nspawn", "-q", "-D", str(ROOTFS), "--register=no", "--keep-unit", "--pipe", "sh", "-c",
                "python3 -m venv /opt/nodeagent && /opt/nodeagent/bin/pip install -q --no-index --find-links "
                "/opt/src /opt/src/nodeagent-*.whl"])
    if done.returncode != 0:
        raise SystemExit(f"pip install in the container failed: {done.stderr[-3000:]}")


class Container:
    """The Debian root booted with its own systemd as PID 1; commands run in it through nsenter."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.pid = 0

    def boot(self) -> None:
        self.proc = subprocess.Popen(["systemd-nspawn", "-q", "-D", str(ROOTFS), "--boot", "-M", MACHINE,
                                      "--register=no", "--keep-unit", "--console=passive"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            children = run(["ps", "--ppid", str(self.proc.pid), "-o", "pid="]).stdout.split()
            if children:
                self.pid = int(children[0])
                state = self.sh("systemctl is-system-running").stdout.strip()
                if state in ("running", "degraded"):
                    return
            time.sleep(0.5)
        raise SystemExit("the container did not boot within 60 s")

    def sh(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return run(["nsenter", "-t", str(self.pid), "-a", "sh", "-c", command], timeout=timeout)

    def show(self, prop: str) -> str:
        return self.sh(f"systemctl show -p {prop} --value nodeagent").stdout.strip()

    def wait_for(self, test, timeout_s: float, every_s: float = 0.2) -> float | None:
        """Seconds until ``test()`` holds, or None past ``timeout_s``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if test():
                return time.monotonic() - start
            time.sleep(every_s)
        return None

    def running_with_new_pid(self, old: str) -> bool:
        return self.show("ActiveState") == "active" and self.show("MainPID") not in ("0", old)

    def poweroff(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.sh("systemctl poweroff", timeout=30)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("error: run as root (systemd-nspawn and debootstrap need it)")
    rootfs()
    install_nodeagent()
    c = Container()
    c.boot()
    results: dict[str, object] = {}

    def check(name: str, ok: bool, detail: str) -> None:
        results[name] = {"ok": ok, "detail": detail}
        say(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")

    try:
        # a model the unit's PrivateTmp would hide: refused, nothing installed
        c.sh(f"cp {MODEL} /tmp/hidden.gguf")
        got = c.sh(f"{NA} service install --system --model /tmp/hidden.gguf --port 8499")
        unit_there = c.sh("test -e /etc/systemd/system/nodeagent.service").returncode == 0
        check("hidden path refused", got.returncode != 0 and "/tmp/hidden.gguf" in got.stderr and not unit_there,
              f"exit {got.returncode}: {got.stderr.strip().splitlines()[0] if got.stderr.strip() else ''}; unit "
              f"{'written' if unit_there else 'not written'}")

        got = c.sh(f"{NA} service install --system --model {MODEL} --port 8499", timeout=180)
        state, kind, status = c.show("ActiveState"), c.show("Type"), c.show("StatusText")
        check("active through Type=notify", got.returncode == 0 and state == "active" and kind == "notify" and
              bool(status), f"{state}, Type={kind}, status line: {status!r}")

        pid = c.show("MainPID")
        c.sh(f"kill -9 {pid}")
        took = c.wait_for(lambda: c.running_with_new_pid(pid), 60)
        check("kill -9 restarts it", took is not None, f"active again with a new process after "
              f"{took:.1f} s" if took is not None else "not back within 60 s")

        pid = c.show("MainPID")
        c.sh(f"kill -STOP {pid}")
        took = c.wait_for(lambda: c.running_with_new_pid(pid), 120, every_s=0.5)
        said = c.sh("journalctl -u nodeagent --no-pager -o cat | grep -i watchdog | tail -1").stdout.strip()
        check("SIGSTOP trips the watchdog", took is not None and took >= 55 and "atchdog" in said,
              f"restarted {took:.1f} s after SIGSTOP (WatchdogSec=60); journal: {said!r}" if took is not None
              else "not restarted within 120 s")

        t0 = time.monotonic()
        stop = c.sh("systemctl stop nodeagent")
        took = time.monotonic() - t0
        check("systemctl stop exits 0", stop.returncode == 0 and c.show("ActiveState") == "inactive",
              f"exit {stop.returncode} in {took:.2f} s")

        c.sh("systemctl start nodeagent", timeout=180)
        c.sh("systemctl reboot")
        assert c.proc is not None
        c.proc.wait(120)  # systemd-nspawn exits when the container reboots; the host would start it again
        c.boot()
        took = c.wait_for(lambda: c.show("ActiveState") == "active", 120)
        check("back after a reboot", took is not None and c.show("UnitFileState") == "enabled",
              f"active {took:.1f} s after boot, {c.show('UnitFileState')}" if took is not None
              else "not active within 120 s of boot")

        pid = c.show("MainPID")
        got = c.sh(f"{NA} service install --system --model {MODEL} --port 8498", timeout=180)
        answered = c.sh("python3 -c \"import urllib.request; print(urllib.request.urlopen("
                        "'http://127.0.0.1:8498/healthz', timeout=5).status)\"").stdout.strip()
        check("installing again applies the new unit", got.returncode == 0 and "restarted" in got.stderr and
              c.show("MainPID") != pid and answered == "200",
              f"{got.stderr.strip()}; /healthz on the new port: {answered or 'no answer'}")
    finally:
        c.sh(f"{NA} service uninstall --system", timeout=120)
        c.poweroff()
    out = ROOT / "benchmarks" / "results" / "systemd_check.json"
    out.write_text(json.dumps({"debian": "12 (bookworm)", "created": time.strftime("%Y-%m-%d"),
                               "checks": results}, indent=1) + "\n")
    failed = [k for k, v in results.items() if not v["ok"]]  # type: ignore[index]
    say(f"{len(results) - len(failed)} of {len(results)} held; written to {out.relative_to(ROOT)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
