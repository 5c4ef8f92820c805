"""The service on a real systemd: a minimal Debian 12 booted with systemd inside systemd-nspawn on this machine,
nodeagent installed in it from the wheel built from this checkout, and `nodeagent service install --system` put
through what a service must survive. Run by scripts/systemd-check (as root); about 6 minutes, most of it the
watchdog's 60 s and the first debootstrap.

What it proves, each printed as a line and saved in benchmarks/results/systemd_check.json:
- the unit reaches active (running) through Type=notify, with its status line;
- kill -9 of the service restarts it; SIGSTOP trips the watchdog (WatchdogSec=60) and restarts it;
- `systemctl stop` exits 0, in the time it took;
- it is back, enabled, after the container reboots;
- a model under /tmp (which the unit's PrivateTmp=yes hides) is refused, naming it, and nothing is installed;
- installing again with a changed unit restarts the running service, and says so;
- a fleet on one machine, as an operator's first day sets it up: Debian's redis-server set up by the steps
  `nodeagent broker setup` prints (its user limited to nodeagent's keys), then a following node, the gateway and
  the scheduler installed as three services side by side, all active; the scheduler's assignment followed by the
  node; the gateway answering a chat request for the node's model with the token it generated, and a 401 without
  it; a re-install of the gateway leaving the node running; the token and the Redis password in no unit file and
  in no `systemctl show`.
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
PACKAGES = "systemd,systemd-sysv,dbus,python3,python3-venv,ca-certificates,procps,libgomp1,libstdc++6,redis-server"
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


def redis_in_rootfs() -> None:
    """Debian's redis-server in the root (made before it was one of PACKAGES: added once)."""
    if (ROOTFS / "usr" / "bin" / "redis-server").exists():
        return
    say("adding redis-server to the container's root")
    in_root("apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server "
            ">/dev/null", "installing redis-server in the container")


def in_root(command: str, what: str) -> None:
    """A shell command run in the container's root before it boots (systemd-nspawn without --boot)."""
    done = run(["systemd-nspawn", "-q", "-D", str(ROOTFS), "--register=no", "--keep-unit", "--pipe", "sh", "-c",
                command])
    if done.returncode != 0:
        raise SystemExit(f"{what} failed: {done.stderr[-3000:]}")


def build_tools() -> None:
    """What building the wheel without isolation needs in this environment (a fresh clone's has neither): the build
    front end, and pyproject.toml's [build-system] requires (setuptools 77 or later reads its ``license = "Apache-2.0"``
    string), installed as scripts/_venv.sh installs nodeagent."""
    from nodeagent.tomlfile import parse_toml

    requires = parse_toml((ROOT / "pyproject.toml").read_bytes(), "pyproject.toml")["build-system"]["requires"]
    got = run([sys.executable, "-m", "pip", "install", "-q", "build", *requires])
    if got.returncode != 0:
        raise SystemExit(f"installing build and {', '.join(requires)} failed: {got.stderr[-2000:]}")


def wheels(into: Path) -> None:
    """The nodeagent wheel built from this checkout, and a wheel of every dependency (from pip's cache and the
    package index, as this machine reaches them; llama-cpp-python's is the build pip cached here), so the
    container installs with no network of its own. Built first, outside the container's root: a build that fails
    says so in seconds, before the root is made."""
    build_tools()
    into.mkdir(parents=True, exist_ok=True)
    for old in into.glob("*.whl"):
        old.unlink()
    say(f"building the nodeagent wheel, and its dependencies' wheels, into {into}")
    built = run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(into), str(ROOT)])
    if built.returncode != 0:
        raise SystemExit(f"building the wheel failed: {built.stderr[-2000:]}")
    wheel = next(into.glob("nodeagent-*.whl"))
    # Debian 12's Python is 3.11.2: redis wants async-timeout below 3.11.3, which this Python does not ask for
    got = run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(into), str(wheel), "async-timeout>=4.0.3"])
    if got.returncode != 0:
        raise SystemExit(f"the dependencies' wheels could not be had: {got.stderr[-2000:]}")


def install_nodeagent(built: Path) -> None:
    """A fresh virtual environment in the container, nodeagent installed from the wheels ``built`` (dependencies and
    llama-cpp-python beside it), and the test model where the service may read it."""
    src = ROOTFS / "opt" / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(built, src)
    models = ROOTFS / "opt" / "models"
    models.mkdir(parents=True, exist_ok=True)
    from nodeagent.config import load
    from nodeagent.store.pkgindex import test_model_path

    shutil.copy(test_model_path("smollm2-135m-instruct", load().test_models_dir), models)
    shutil.rmtree(ROOTFS / "opt" / "nodeagent", ignore_errors=True)
    say("installing nodeagent from its wheel into /opt/nodeagent in the container")
    in_root("python3 -m venv /opt/nodeagent && /opt/nodeagent/bin/pip install -q --no-index --find-links /opt/src "
            "/opt/src/nodeagent-*.whl", "pip install in the container")


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

    def show(self, prop: str, unit: str = "nodeagent-node") -> str:
        return self.sh(f"systemctl show -p {prop} --value {unit}").stdout.strip()

    def wait_for(self, test, timeout_s: float, every_s: float = 0.2) -> float | None:
        """Seconds until ``test()`` holds, or None past ``timeout_s``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if test():
                return time.monotonic() - start
            time.sleep(every_s)
        return None

    def running_with_new_pid(self, old: str, unit: str = "nodeagent-node") -> bool:
        return self.show("ActiveState", unit) == "active" and self.show("MainPID", unit) not in ("0", old)

    def poweroff(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.sh("systemctl poweroff", timeout=30)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


BROKER = "redis://nodeagent@127.0.0.1:6379/0"
PASSWORD = "/etc/nodeagent/broker.password"


def fleet(c: Container, check) -> None:  # type: ignore[no-untyped-def]
    """The roles of a small fleet on one machine, each its own service (see the module's docstring)."""
    import shlex

    made = c.sh(f"{NA} broker setup --host 127.0.0.1 --bind 127.0.0.1 --password-file {PASSWORD} --json")
    recipe = json.loads(made.stdout)
    steps = [s for s in recipe["steps"] if not s.startswith(("sudo apt-get", "sudo ufw"))]
    applied = [c.sh(s.replace("sudo ", ""), timeout=60) for s in steps]
    doctor = c.sh(f"NODEAGENT_BROKER={BROKER} NODEAGENT_BROKER_PASSWORD_FILE={PASSWORD} NODEAGENT_OFFLINE=1 "
                  f"{NA} doctor --json")
    broker_checks = {k["name"]: k["status"] for k in json.loads(doctor.stdout or '{"checks": []}')["checks"]
                     if k["name"].startswith("broker")}
    check("the queue host as broker setup prints it", made.returncode == 0 and all(a.returncode == 0 for a in applied)
          and broker_checks and set(broker_checks.values()) == {"ok"},
          f"{len(steps)} steps applied to Debian's redis-server; doctor: {broker_checks}")
    common = f"--system --broker {BROKER} --broker-password-file {PASSWORD}"
    installs = {"scheduler": c.sh(f"{NA} service install --role scheduler {common}", timeout=180),
                "node": c.sh(f"{NA} service install --role node --follow --model {MODEL} --port 8401 {common}",
                             timeout=180),
                "gateway": c.sh(f"{NA} service install --role gateway --host 0.0.0.0 --port 8400 --generate-token "
                                f"{common}", timeout=180)}
    states = {r: c.show("ActiveState", f"nodeagent-{r}") for r in installs}
    check("three roles side by side", all(p.returncode == 0 for p in installs.values()) and
          set(states.values()) == {"active"},
          f"{states}; " + "; ".join(p.stderr.strip().splitlines()[-1] for p in installs.values() if p.stderr.strip()))

    def followed() -> bool:
        shown = json.loads(c.sh(f"NODEAGENT_BROKER_PASSWORD_FILE={PASSWORD} {NA} status --broker {BROKER} --json")
                           .stdout or "{}")
        rows = shown.get("assignments") or []
        return any(a["models"] and a["followed_generation"] == a["generation"] for a in rows)

    took = c.wait_for(followed, 90, every_s=1.0)
    shown = json.loads(c.sh(f"NODEAGENT_BROKER_PASSWORD_FILE={PASSWORD} {NA} status --broker {BROKER} --json").stdout
                       or "{}")
    check("the scheduler places a model on the following node", took is not None,
          f"assignment {[(a['node'], a['models'], a['generation']) for a in shown.get('assignments', [])]} "
          f"followed after {took:.1f} s" if took is not None else "no assignment followed within 90 s")
    token_file = "/etc/nodeagent/secrets/nodeagent-gateway.token"
    ask = ("import json, sys, urllib.request, urllib.error\n"
           "body = json.dumps({'model': sys.argv[1], 'messages': [{'role': 'user', 'content': 'Name a colour.'}], "
           "'max_tokens': 8}).encode()\n"
           "headers = {'content-type': 'application/json', **({'authorization': 'Bearer ' + open(sys.argv[2]).read()"
           ".strip()} if sys.argv[2] != '-' else {})}\n"
           "try:\n r = urllib.request.urlopen(urllib.request.Request('http://127.0.0.1:8400/v1/chat/completions', "
           "body, headers), timeout=120); print(r.status, json.load(r)['choices'][0]['message']['content'] or '')\n"
           "except urllib.error.HTTPError as e: print(e.code)\n")
    model = Path(MODEL).stem
    answered = c.sh(f"python3 -c {shlex.quote(ask)} {model} {token_file}", timeout=180).stdout.strip()
    refused = c.sh(f"python3 -c {shlex.quote(ask)} {model} -", timeout=60).stdout.strip()
    check("the gateway answers for the node's model, with its token only", answered.startswith("200") and
          refused == "401", f"with the token: {answered!r}; without: {refused!r}")
    node_pid = c.show("MainPID", "nodeagent-node")
    again = c.sh(f"{NA} service install --role gateway --host 0.0.0.0 --port 8402 --generate-token {common}",
                 timeout=180)
    check("a re-install of the gateway leaves the node running", again.returncode == 0 and
          c.show("MainPID", "nodeagent-node") == node_pid and c.show("ActiveState", "nodeagent-node") == "active"
          and c.show("ActiveState", "nodeagent-gateway") == "active",
          f"node pid {node_pid} -> {c.show('MainPID', 'nodeagent-node')}; gateway {again.stderr.strip()[-120:]}")
    token = c.sh(f"cat {token_file}").stdout.strip()
    password = c.sh(f"cat {PASSWORD}").stdout.strip()
    texts = c.sh("cat /etc/systemd/system/nodeagent-*.service; for u in node gateway scheduler; do systemctl show "
                 "nodeagent-$u; done").stdout
    check("the token and the Redis password in no unit and no systemctl show", bool(token) and bool(password) and
          token not in texts and password not in texts and "LoadCredential=token:" in texts,
          f"{len(texts)} characters of unit files and systemctl show read; token "
          f"{'found' if token in texts else 'absent'}, password {'found' if password in texts else 'absent'}")


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("error: run as root (systemd-nspawn and debootstrap need it)")
    built = WORK / "wheels"
    wheels(built)
    rootfs()
    redis_in_rootfs()
    install_nodeagent(built)
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
        unit_there = c.sh("test -e /etc/systemd/system/nodeagent-node.service").returncode == 0
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
        said = c.sh("journalctl -u nodeagent-node --no-pager -o cat | grep -i watchdog | tail -1").stdout.strip()
        check("SIGSTOP trips the watchdog", took is not None and took >= 55 and "atchdog" in said,
              f"restarted {took:.1f} s after SIGSTOP (WatchdogSec=60); journal: {said!r}" if took is not None
              else "not restarted within 120 s")

        t0 = time.monotonic()
        stop = c.sh("systemctl stop nodeagent-node")
        took = time.monotonic() - t0
        check("systemctl stop exits 0", stop.returncode == 0 and c.show("ActiveState") == "inactive",
              f"exit {stop.returncode} in {took:.2f} s")

        c.sh("systemctl start nodeagent-node", timeout=180)
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
        c.sh(f"{NA} service uninstall --system", timeout=120)
        fleet(c, check)
    finally:
        c.sh(f"{NA} service uninstall --system --all", timeout=120)
        c.poweroff()
    out = ROOT / "benchmarks" / "results" / "systemd_check.json"
    out.write_text(json.dumps({"debian": "12 (bookworm)", "created": time.strftime("%Y-%m-%d"),
                               "checks": results}, indent=1) + "\n")
    failed = [k for k, v in results.items() if not v["ok"]]  # type: ignore[index]
    say(f"{len(results) - len(failed)} of {len(results)} held; written to {out.relative_to(ROOT)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
