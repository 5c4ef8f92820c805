"""Service files as `nodeagent service install --dry-run` renders them: the systemd unit passes
systemd-analyze verify, the launchd plist round-trips through plistlib with the expected keys; JSON logs under
a service manager."""

from __future__ import annotations

import json
import plistlib
import shutil
import subprocess

import pytest
from conftest import cli


def test_systemd_unit_verifies(isolated_env, tmp_path):
    out = json.loads(cli(["service", "install", "--model", "smollm2-135m-instruct", "--manager", "systemd",
                          "--dry-run", "--json", "--port", "8411"], isolated_env).stdout)
    assert out["path"].endswith(".config/systemd/user/nodeagent.service")
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
    unit = cli(["service", "install", "--model", "fake", "--system", "--manager", "systemd", "--dry-run"],
               isolated_env).stdout
    assert "WantedBy=multi-user.target" in unit and "Environment=NODEAGENT_HOME=%S/nodeagent" in unit
    path = tmp_path / "nodeagent.service"
    path.write_text(unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("user", [True, False])
def test_launchd_plist_round_trips(isolated_env, user):
    args = ["service", "install", "--model", "smollm2-135m-instruct", "--manager", "launchd", "--dry-run", "--json"]
    out = json.loads(cli(args + ([] if user else ["--system"]), isolated_env).stdout)
    job = plistlib.loads(out["content"].encode())
    assert job["Label"] == "io.nodeagent.node" and job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False} and job["ThrottleInterval"] > 0
    assert job["ProcessType"] != "Background"
    assert job["ProgramArguments"][-4:] == ["serve", "--model", "smollm2-135m-instruct"][-3:] or \
        job["ProgramArguments"][-3:] == ["serve", "--model", "smollm2-135m-instruct"]
    assert "/Library/Logs/nodeagent/" in job["StandardErrorPath"]
    assert job["EnvironmentVariables"]["NODEAGENT_LOG_FORMAT"] == "json"
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
    one = cli(["service", "install", "--model", "smollm2-135m-instruct", "--manager", "systemd", "--dry-run"],
              isolated_env).stdout
    unit = cli(["service", "install", "--model", "smollm2-135m-instruct", "--model", "gemma-3-270m-it", "--pin",
                "smollm2-135m-instruct", "--manager", "systemd", "--dry-run"], isolated_env).stdout
    assert "serve --model smollm2-135m-instruct --model gemma-3-270m-it --pin smollm2-135m-instruct" in unit

    def high(text: str) -> int:
        return next(int(x.split("=")[1].rstrip("M")) for x in text.splitlines() if x.startswith("MemoryHigh="))

    assert high(unit) > high(one)  # both models' plans, the overhead once
    path = tmp_path / "nodeagent.service"
    path.write_text(unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    bad = cli(["service", "install", "--model", "fake", "--pin", "other", "--dry-run"], isolated_env, check=False)
    assert bad.returncode == 2 and "--pin 'other'" in bad.stderr


def test_a_service_of_the_config_files_models(isolated_env, outside_tmp):
    config = outside_tmp / "config.toml"  # where the service's own /tmp does not hide it
    config.write_text('[[models]]\nmodel = "smollm2-135m-instruct"\npin = true\n\n[[models]]\nmodel = "fake"\n')
    unit = cli(["service", "install", "--manager", "systemd", "--dry-run"],
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
    proc = cli(["service", "install", "--model", str(model), "--manager", "systemd", "--dry-run"],
               {**isolated_env, "HOME": str(home)}, check=False)
    assert proc.returncode == 2 and str(model) in proc.stderr and "PrivateTmp" in proc.stderr
    assert "out of /tmp" in proc.stderr and "Traceback" not in proc.stderr
    assert not (home / ".config" / "systemd").exists()


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
    unit = cli(["service", "install", "--gateway", "--broker", "redis://queue-host:6379/0", "--port", "8500",
                "--manager", "systemd", "--dry-run"], isolated_env).stdout
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    assert " -m nodeagent gateway " in line and "--broker redis://queue-host:6379/0" in line and "--port 8500" in line
    assert "MemoryHigh" not in unit  # no model: no plan to bound it by
    path = tmp_path / "nodeagent.service"
    path.write_text(unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    refused = cli(["service", "install", "--gateway", "--manager", "systemd", "--dry-run"], isolated_env, check=False)
    assert refused.returncode == 2 and "--broker" in refused.stderr
