"""Service files as `nodeagent service install --dry-run` renders them: the systemd unit passes
systemd-analyze verify, the launchd plist round-trips through plistlib with the expected keys; JSON logs under
a service manager.

A unit runs the interpreter that installed it, and its PrivateTmp=yes hides /tmp and /var/tmp, so `service install`
refuses an interpreter there (a virtual environment under /tmp: tested below). A checkout cloned under /tmp has its
.venv there, so these tests install through ``service_cli``: an interpreter the unit can see, this one or (from such
a clone) a virtual environment outside /tmp that reads this one's packages (``visible_python``)."""

from __future__ import annotations

import atexit
import functools
import json
import os
import plistlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
from conftest import cli

HIDDEN = (Path("/tmp"), Path("/var/tmp"))  # what PrivateTmp=yes hides (units.HIDDEN_BY_SANDBOX)


def under_hidden(path: str | Path) -> bool:
    return any(p == d or d in p.parents for p in {Path(path).absolute(), Path(path).resolve()} for d in HIDDEN)


def python_reading_this_one(folder: Path) -> str:
    """A virtual environment made in ``folder`` without packages of its own, reading this interpreter's (a .pth
    that adds its site-packages, their own .pth files run: the editable install of this checkout among them).
    Its interpreter, to run ``-m nodeagent``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, capture_output=True)
    python = folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "nodeagent-tests.pth").write_text("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in ours)
                                                  + "\n")
    return str(python)


@functools.cache
def visible_python() -> str:
    """An interpreter a unit's sandbox leaves visible, with this one's packages: this one, unless it lies under /tmp
    or /var/tmp (a clone there, and its .venv); then one made once for the session outside them (/dev/shm, or the
    home folder's cache), removed at exit."""
    if not under_hidden(sys.executable):
        return sys.executable
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path.home() / ".cache"
    base.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="nodeagent-test-venv-", dir=base))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return python_reading_this_one(folder)


def service_cli(args, env, check=True, python=None):
    """`nodeagent ARGS` as conftest's ``cli`` runs it, by ``python`` (default: ``visible_python()``), the
    interpreter the unit it installs will run."""
    proc = subprocess.run([python or visible_python(), "-m", "nodeagent", *args], capture_output=True, text=True,
                          env={**os.environ, **env})
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_systemd_unit_verifies(isolated_env, tmp_path):
    out = json.loads(service_cli(["service", "install", "--model", "smollm2-135m-instruct", "--manager", "systemd",
                                  "--dry-run", "--json", "--port", "8411"], isolated_env).stdout)
    assert out["path"].endswith(".config/systemd/user/nodeagent-node.service")
    unit = out["content"]
    for line in ("Type=notify", "Restart=on-failure", "StartLimitBurst=5", "StateDirectory=nodeagent",
                 "CacheDirectory=nodeagent", "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=read-only",
                 "PrivateTmp=yes", "WatchdogSec=60", "Environment=NODEAGENT_LOG_FORMAT=json"):
        assert line in unit.splitlines(), line
    assert "serve --model smollm2-135m-instruct --port 8411" in unit
    high = next(int(x.split("=")[1].rstrip("M")) for x in unit.splitlines() if x.startswith("MemoryHigh="))
    top = next(int(x.split("=")[1].rstrip("M")) for x in unit.splitlines() if x.startswith("MemoryMax="))
    assert 200 < high < top < 2000  # the plan of a 135M model, plus its margin
    path = tmp_path / "nodeagent.service"
    path.write_text(unit)
    assert shutil.which("systemd-analyze"), "scripts/test installs systemd (systemd-analyze)"
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_system_unit_runs_as_a_user_in_var_lib(isolated_env, tmp_path):
    unit = service_cli(["service", "install", "--model", "fake", "--system", "--manager", "systemd", "--dry-run"],
                       isolated_env).stdout
    assert "WantedBy=multi-user.target" in unit and "Environment=NODEAGENT_HOME=%S/nodeagent" in unit
    path = tmp_path / "nodeagent.service"
    path.write_text(unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("user", [True, False])
def test_launchd_plist_round_trips(isolated_env, user):
    args = ["service", "install", "--model", "smollm2-135m-instruct", "--manager", "launchd", "--dry-run", "--json"]
    out = json.loads(service_cli(args + ([] if user else ["--system"]), isolated_env).stdout)
    job = plistlib.loads(out["content"].encode())
    assert job["Label"] == "io.nodeagent.node" and job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False} and job["ThrottleInterval"] > 0
    assert job["ProcessType"] != "Background"
    assert job["ProgramArguments"][-4:] == ["serve", "--model", "smollm2-135m-instruct"][-3:] or \
        job["ProgramArguments"][-3:] == ["serve", "--model", "smollm2-135m-instruct"]
    assert job["StandardErrorPath"].endswith("/Library/Logs/nodeagent/nodeagent-node.log")
    assert job["EnvironmentVariables"]["NODEAGENT_LOG_FORMAT"] == "json"
    assert job["EnvironmentVariables"]["NODEAGENT_HOME"] and job["EnvironmentVariables"]["NODEAGENT_CACHE_DIR"]
    assert ("UserName" in job) is (not user)
    assert out["path"].endswith("LaunchAgents/io.nodeagent.node.plist" if user else
                                "/Library/LaunchDaemons/io.nodeagent.node.plist")


def test_logs_are_json_lines_under_a_service_manager(isolated_env):
    """INVOCATION_ID is what systemd sets for a service; a person at a terminal gets plain text instead."""
    args = ["--log-level", "debug", "worker", "--model", "fake", "--burst"]
    proc = cli(args, {**isolated_env, "INVOCATION_ID": "x", "NODEAGENT_LOG_FORMAT": "auto"})
    records = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    assert any(r["logger"].startswith("nodeagent") for r in records)
    text = cli(args, {**isolated_env, "NODEAGENT_LOG_FORMAT": "text"}).stderr
    assert "DEBUG nodeagent" in text or "INFO nodeagent" in text
    assert not any(line.startswith("{") for line in text.splitlines())


def test_a_model_set_as_a_service(isolated_env, tmp_path):
    """Several --model and --pin reach the service's serve command; its memory limits are the set's plan."""
    one = service_cli(["service", "install", "--model", "smollm2-135m-instruct", "--manager", "systemd", "--dry-run"],
                      isolated_env).stdout
    unit = service_cli(["service", "install", "--model", "smollm2-135m-instruct", "--model", "gemma-3-270m-it", "--pin",
                        "smollm2-135m-instruct", "--manager", "systemd", "--dry-run"], isolated_env).stdout
    assert "serve --model smollm2-135m-instruct --model gemma-3-270m-it --pin smollm2-135m-instruct" in unit

    def high(text: str) -> int:
        return next(int(x.split("=")[1].rstrip("M")) for x in text.splitlines() if x.startswith("MemoryHigh="))

    assert high(unit) > high(one)  # both models' plans, the overhead once
    path = tmp_path / "nodeagent.service"
    path.write_text(unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    bad = service_cli(["service", "install", "--model", "fake", "--pin", "other", "--dry-run"], isolated_env,
                      check=False)
    assert bad.returncode == 2 and "--pin 'other'" in bad.stderr


def test_a_service_of_the_config_files_models(isolated_env, outside_tmp):
    config = outside_tmp / "config.toml"  # where the service's own /tmp does not hide it
    config.write_text('[[models]]\nmodel = "smollm2-135m-instruct"\npin = true\n\n[[models]]\nmodel = "fake"\n')
    unit = service_cli(["service", "install", "--manager", "systemd", "--dry-run"],
                       {**isolated_env, "NODEAGENT_CONFIG": str(config)}).stdout
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    assert line.endswith(" -m nodeagent serve")  # the service reads the same config file's models
    assert f"Environment=NODEAGENT_CONFIG={config}" in unit.splitlines()


def test_a_path_the_sandbox_would_hide_is_refused_and_nothing_is_written(isolated_env, tmp_path, smollm2_path):
    """PrivateTmp=yes gives the service a /tmp of its own: a model (or a virtual environment, or a config file)
    under the host's /tmp would not be there, and the service would fail in a loop. Refused, naming it, before
    anything is written."""
    model = tmp_path / "model.gguf"  # pytest's tmp_path lies under /tmp
    model.symlink_to(smollm2_path)
    home = tmp_path / "home"
    proc = service_cli(["service", "install", "--model", str(model), "--manager", "systemd", "--dry-run"],
                       {**isolated_env, "HOME": str(home)}, check=False)
    assert proc.returncode == 2 and str(model) in proc.stderr and "PrivateTmp" in proc.stderr
    assert "out of /tmp" in proc.stderr and "Traceback" not in proc.stderr
    assert not (home / ".config" / "systemd").exists()


def test_a_virtual_environment_the_sandbox_would_hide_is_refused_and_one_outside_tmp_installs(isolated_env, tmp_path):
    """The unit runs the interpreter that installed it: a virtual environment under /tmp would not be in the service's
    own /tmp, so an install from one is refused, naming it, before anything is written (a real install, the service
    manager faked); the same install from an interpreter outside /tmp writes the unit, which runs that one."""
    env, calls = fake_systemctl(tmp_path)
    env = {**isolated_env, **env}
    folder = Path(tempfile.mkdtemp(prefix="nodeagent-test-venv-", dir="/tmp"))  # /tmp itself, whatever TMPDIR says
    try:
        python = python_reading_this_one(folder)
        proc = service_cli(["service", "install", "--model", "fake", "--manager", "systemd"], env, check=False,
                           python=python)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert proc.returncode == 2 and python in proc.stderr and "PrivateTmp" in proc.stderr, proc.stderr
    assert "out of /tmp" in proc.stderr and "Traceback" not in proc.stderr
    units = tmp_path / "home" / ".config" / "systemd" / "user"
    assert not units.exists() and not calls.exists()
    service_cli(["service", "install", "--model", "fake", "--manager", "systemd"], env)
    line = next(x for x in (units / "nodeagent-node.service").read_text().splitlines() if x.startswith("ExecStart="))
    assert line.startswith(f"ExecStart={visible_python()} -m nodeagent serve") and not under_hidden(visible_python())


def test_hidden_paths_follow_links_and_leave_catalog_names_alone(tmp_path):
    from pathlib import Path

    from nodeagent.service.units import ServiceSpec, hidden_paths

    link = Path.home() / ".nodeagent-test-link"
    link.unlink(missing_ok=True)
    link.symlink_to(tmp_path)  # a path outside /tmp that resolves into it
    try:
        spec = ServiceSpec(model="m", argv=["/usr/bin/python3", "-m", "nodeagent", "serve", "--model",
                                            str(link), "--model", "smollm2-135m-instruct"])
        assert hidden_paths(spec, "systemd") == [str(tmp_path.resolve())]
        assert hidden_paths(spec, "launchd") == []
    finally:
        link.unlink()


def test_the_gateway_as_a_service(isolated_env, tmp_path):
    unit = service_cli(["service", "install", "--gateway", "--broker", "redis://queue-host:6379/0", "--port", "8500",
                        "--manager", "systemd", "--dry-run"], isolated_env).stdout
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    assert " -m nodeagent gateway " in line and "--broker redis://queue-host:6379/0" in line and "--port 8500" in line
    assert "MemoryHigh" not in unit  # no model: no plan to bound it by
    path = tmp_path / "nodeagent.service"
    path.write_text(unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    refused = service_cli(["service", "install", "--gateway", "--manager", "systemd", "--dry-run"], isolated_env,
                          check=False)
    assert refused.returncode == 2 and "--broker" in refused.stderr


# -- every role a service of its own, side by side; secrets out of the files' text --------------------------------
def fake_systemctl(tmp_path):
    """A systemctl (and journalctl) that logs what it is asked and says every unit runs: the service manager is the
    other side of this boundary (scripts/systemd-check puts the same installs through a real systemd)."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "systemctl.log"
    for name in ("systemctl", "journalctl"):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n'
                          'case "$*" in *is-active*) echo active ;; *status*) echo "   Active: active (running)" ;; '
                          'esac\nexit 0\n')
        script.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path / "home")}, calls


ROLE_ARGS = {"node": ["--model", "smollm2-135m-instruct", "--port", "8401"],
             "worker": ["--model", "smollm2-135m-instruct", "--types", "classify"],
             "gateway": ["--port", "8402"], "scheduler": []}


@pytest.mark.parametrize("role", list(ROLE_ARGS))
def test_each_role_renders_a_unit_of_its_own_that_verifies(isolated_env, tmp_path, role):
    out = json.loads(service_cli(["service", "install", "--role", role, *ROLE_ARGS[role], "--broker", "redis://q:6379/0",
                                  "--manager", "systemd", "--dry-run", "--json"], isolated_env).stdout)
    assert out["path"].endswith(f".config/systemd/user/nodeagent-{role}.service") and out["unit"] == \
        f"nodeagent-{role}.service"
    unit = out["content"]
    command = {"node": "serve", "worker": "worker", "gateway": "gateway", "scheduler": "scheduler"}[role]
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    assert f" -m nodeagent {command}" in line and "--broker redis://q:6379/0" in line
    assert ("--port" in line) is (role in ("node", "gateway")) and ("--types" in line) is (role == "worker")
    assert ("MemoryHigh=" in unit) is (role in ("node", "worker"))  # a model's plan bounds it
    assert "Type=notify" in unit and f"Description=nodeagent {role}:" in unit
    path = tmp_path / out["unit"]
    path.write_text(unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    plist = json.loads(service_cli(["service", "install", "--role", role, *ROLE_ARGS[role], "--broker", "redis://q:6379/0",
                                    "--manager", "launchd", "--dry-run", "--json"], isolated_env).stdout)
    job = plistlib.loads(plist["content"].encode())
    assert job["Label"] == f"io.nodeagent.{role}" and plist["path"].endswith(f"io.nodeagent.{role}.plist")
    assert job["StandardErrorPath"].endswith(f"nodeagent-{role}.log")


def test_roles_live_side_by_side_and_a_reinstall_touches_only_its_own(isolated_env, tmp_path):
    env, calls = fake_systemctl(tmp_path)
    env = {**isolated_env, **env}
    base = ["--broker", "redis://q:6379/0", "--manager", "systemd"]
    for role in ("node", "gateway", "scheduler"):
        service_cli(["service", "install", "--role", role, *ROLE_ARGS[role], *base], env)
    service_cli(["service", "install", "--role", "worker", "--name", "pi2", "--model", "fake", *base], env)
    units = tmp_path / "home" / ".config" / "systemd" / "user"
    assert sorted(p.name for p in units.iterdir()) == ["nodeagent-gateway.service", "nodeagent-node.service",
                                                       "nodeagent-scheduler.service", "nodeagent-worker-pi2.service"]
    node_before = (units / "nodeagent-node.service").read_text()
    calls.write_text("")
    service_cli(["service", "install", "--role", "gateway", "--port", "8403", *base], env)  # changed: restarted
    asked = calls.read_text()
    assert "restart nodeagent-gateway.service" in asked and "nodeagent-node" not in asked
    assert (units / "nodeagent-node.service").read_text() == node_before
    listed = json.loads(service_cli(["service", "status", "--json"], env).stdout)["services"]
    assert [(s["role"], s["name"], s["running"]) for s in listed] == [
        ("gateway", None, "active"), ("node", None, "active"), ("scheduler", None, "active"),
        ("worker", "pi2", "active")]
    service_cli(["service", "uninstall", "--role", "worker", "--name", "pi2"], env)
    assert not (units / "nodeagent-worker-pi2.service").exists() and (units / "nodeagent-node.service").exists()


def test_an_earlier_versions_unit_for_the_same_role_is_replaced(isolated_env, tmp_path):
    env, calls = fake_systemctl(tmp_path)
    units = tmp_path / "home" / ".config" / "systemd" / "user"
    units.mkdir(parents=True)
    (units / "nodeagent.service").write_text("[Service]\nExecStart=/usr/bin/python3 -m nodeagent serve --model x\n"
                                             "Environment=NODEAGENT_TOKEN=old-secret\n")
    out = service_cli(["service", "install", "--role", "gateway", "--broker", "redis://q:6379/0", "--manager",
                       "systemd"], {**isolated_env, **env})
    assert (units / "nodeagent.service").exists() and "replaced" not in out.stderr  # a node's: another role
    out = service_cli(["service", "install", "--model", "fake", "--manager", "systemd"], {**isolated_env, **env})
    assert not (units / "nodeagent.service").exists() and (units / "nodeagent-node.service").exists()
    assert "replaced" in out.stderr and "nodeagent.service" in out.stderr
    assert "disable --now nodeagent.service" in calls.read_text()


def test_secrets_go_into_0600_files_the_service_reads_never_into_its_unit(isolated_env, tmp_path):
    import stat

    env, _ = fake_systemctl(tmp_path)
    env = {**isolated_env, **env, "NODEAGENT_TOKEN": "tok-from-the-shell", "HF_TOKEN": "hf_secret"}
    broker = "redis://fleet:hunter22@q:6379/0"
    service_cli(["service", "install", "--model", "fake", "--host", "0.0.0.0", "--broker", broker, "--manager",
                 "systemd"], env)
    home = tmp_path / "home"
    unit = (home / ".config" / "systemd" / "user" / "nodeagent-node.service").read_text()
    for secret in ("tok-from-the-shell", "hunter22", "hf_secret"):
        assert secret not in unit
    assert "--broker redis://fleet@q:6379/0" in unit
    folder = home / ".config" / "nodeagent" / "secrets"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name, value, variable in (("token", "tok-from-the-shell", "NODEAGENT_TOKEN_FILE"),
                                  ("broker-password", "hunter22", "NODEAGENT_BROKER_PASSWORD_FILE"),
                                  ("hf-token", "hf_secret", "HF_TOKEN_PATH")):
        path = folder / f"nodeagent-node.{name}"
        assert path.read_text().strip() == value and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert f"Environment={variable}={path}" in unit.splitlines()
    # a system unit: systemd hands the service its copy (LoadCredential), the unit names it by %d
    system = service_cli(["service", "install", "--model", "fake", "--host", "0.0.0.0", "--broker", broker, "--system",
                          "--manager", "systemd", "--dry-run"], env).stdout
    assert "LoadCredential=token:/etc/nodeagent/secrets/nodeagent-node.token" in system
    assert "Environment=NODEAGENT_TOKEN_FILE=%d/token" in system and "tok-from-the-shell" not in system
    path = tmp_path / "nodeagent-node.service"
    path.write_text(system)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    plist = service_cli(["service", "install", "--role", "gateway", "--broker", broker, "--generate-token", "--manager",
                         "launchd", "--dry-run", "--json"], env).stdout
    job = plistlib.loads(json.loads(plist)["content"].encode())
    assert "hunter22" not in json.dumps(job) and job["EnvironmentVariables"]["NODEAGENT_TOKEN_FILE"].endswith(
        "Application Support/nodeagent/secrets/nodeagent-gateway.token")


def test_a_token_file_of_the_operators_and_a_refused_open_port(isolated_env, tmp_path, outside_tmp):
    env, _ = fake_systemctl(tmp_path)
    env = {**isolated_env, **env}
    refused = service_cli(["service", "install", "--role", "gateway", "--broker", "redis://q:6379/0", "--host",
                           "0.0.0.0", "--manager", "systemd", "--dry-run"], env, check=False)
    assert refused.returncode == 2 and "needs a bearer token" in refused.stderr
    assert "--token-file" in refused.stderr and "--generate-token" in refused.stderr
    assert "Traceback" not in refused.stderr
    token = outside_tmp / "token"  # where the unit's own /tmp does not hide it
    token.write_text("operator-token\n")
    token.chmod(0o644)
    loose = service_cli(["service", "install", "--role", "gateway", "--broker", "redis://q:6379/0", "--host", "0.0.0.0",
                         "--token-file", str(token), "--manager", "systemd", "--dry-run"], env, check=False)
    assert loose.returncode == 2 and "can be read by other users" in loose.stderr and "chmod 600" in loose.stderr
    token.chmod(0o600)
    unit = service_cli(["service", "install", "--role", "gateway", "--broker", "redis://q:6379/0", "--host", "0.0.0.0",
                        "--token-file", str(token), "--manager", "systemd", "--dry-run"], env).stdout
    assert f"Environment=NODEAGENT_TOKEN_FILE={token}" in unit and "operator-token" not in unit
    # the service, as it starts, reads the token from the file: a request without it is refused
    from nodeagent.config import resolve

    assert resolve({}, {"NODEAGENT_TOKEN_FILE": str(token)}).token == "operator-token"
