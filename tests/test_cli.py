"""The CLI as a user types it: tables, --json, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import HARDWARE

from nodeagent.cli.main import cli


def run(args, env, ok=True):
    result = CliRunner(env=env).invoke(cli, args, catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def run_real(args, env):
    """Through the installed entry point, in a subprocess."""
    return subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env})


def test_probe_json_on_fixture(isolated_env):
    env = {**isolated_env, "NODEAGENT_HARDWARE_FIXTURE": str(HARDWARE / "rpi4-4gb.json")}
    data = json.loads(run(["probe", "--json"], env).stdout)
    assert data["hardware"]["raspberry_pi"]["board"] == "4B"
    assert data["profile"]["profile_id"] == "rpi4-4gb"


def test_probe_table_live(isolated_env):
    out = run(["probe"], isolated_env).stdout
    assert "llama.cpp" in out and "profile" in out and "linux-cpu" in out


def test_inspect_json_and_table(isolated_env, smollm2_path):
    data = json.loads(run(["inspect", str(smollm2_path), "--json"], isolated_env).stdout)
    assert data["architecture"] == "llama" and data["block_count"] == 30
    assert "chat_template" not in data  # the template text itself stays out of the JSON
    table = run(["inspect", str(smollm2_path)], isolated_env).stdout
    assert "Q4_1" in table and "49,152" in table


def test_profiles(isolated_env):
    data = json.loads(run(["profiles", "--json"], isolated_env).stdout)
    assert {p["id"] for p in data} >= {"rpi4-4gb", "apple-m2-pro-16gb", "linux-cpu"}
    assert "rpi5-16gb" in run(["profiles"], isolated_env).stdout


def test_models_catalog(isolated_env):
    data = json.loads(run(["models", "catalog", "--json"], isolated_env).stdout)
    assert len({m["family"] for m in data}) >= 8
    out = run(["models", "catalog", "--family", "qwen2.5"], isolated_env).stdout
    assert "Qwen2.5-7B-Instruct-Q4_K_M.gguf" in out and "(est.)" in out


def test_config_show_provenance(isolated_env, tmp_path):
    (tmp_path / "config.toml").write_text("slots = 3\n")
    env = {**isolated_env, "NODEAGENT_THREADS": "7",
           "NODEAGENT_HARDWARE_FIXTURE": str(HARDWARE / "rpi5-8gb.json")}
    data = json.loads(run(["config", "show", "--json"], env).stdout)
    s = data["settings"]
    assert data["profile"] == "rpi5-8gb"
    assert (s["threads"]["value"], s["threads"]["source"]) == (7, "env NODEAGENT_THREADS")
    assert s["slots"]["value"] == 3 and s["slots"]["source"].startswith("config ")
    # unset: the planner takes the profile's context for the task (one road for profile defaults)
    assert (s["ctx_tokens"]["value"], s["ctx_tokens"]["source"]) == (None, "default")
    assert s["log_level"]["source"] == "default"
    env["NODEAGENT_PROFILE"] = "rpi4-4gb"
    data = json.loads(run(["config", "show", "--json"], env).stdout)
    assert data["profile"] == "rpi4-4gb" and data["settings"]["profile"]["source"] == "env NODEAGENT_PROFILE"


def test_forced_profile_flag(isolated_env):
    data = json.loads(run(["--profile", "rpi5-16gb", "probe", "--json"], isolated_env).stdout)
    assert data["profile"]["profile_id"] == "rpi5-16gb"


@pytest.mark.parametrize("args,code,needle", [
    (["--profile", "nope", "probe"], 4, "unknown device profile 'nope'"),
    (["inspect", "/does/not/exist.gguf"], 4, "no such file"),
    (["probe", "--bogus"], 2, "No such option"),
    (["frobnicate"], 2, "No such command"),
])
def test_errors_are_one_line(isolated_env, args, code, needle):
    proc = run_real(args, isolated_env)
    assert proc.returncode == code, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[0].startswith("error: ")


def test_bad_env_value_is_one_line(isolated_env):
    proc = run_real(["config", "show"], {**isolated_env, "NODEAGENT_THREADS": "lots"})
    assert proc.returncode == 3 and "NODEAGENT_THREADS" in proc.stderr and "Traceback" not in proc.stderr


def test_debug_shows_traceback(isolated_env):
    proc = run_real(["--debug", "inspect", "/does/not/exist.gguf"], isolated_env)
    assert proc.returncode == 4 and "Traceback" in proc.stderr


def test_help_lists_every_variable(isolated_env):
    from nodeagent.config import SETTINGS

    out = run(["--help"], isolated_env).stdout
    for s in SETTINGS:
        assert s.env in out


# -- a model set this machine cannot load refuses at start, with the error one model gets --------------------------

def _started(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`nodeagent ARGS` as typed, given 60 s to refuse (a command that starts instead runs on, and is stopped)."""
    try:
        return subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", **env}, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`nodeagent {' '.join(args)}` started instead of refusing")


@pytest.mark.real_model
@pytest.mark.parametrize("command", ["serve", "worker"])
def test_a_model_set_planned_for_another_device_refuses_at_start(isolated_env, tmp_path, smollm2_path, gemma3_path,
                                                                 command):
    """NODEAGENT_PROFILE=rpi4-1gb on this machine: `serve` (or `worker`) with two --model refuses at start with the
    one-line error one model gets, instead of starting and answering every request 500."""
    from conftest import free_port

    env = {**isolated_env, "NODEAGENT_PROFILE": "rpi4-1gb"}
    where = ["--port", str(free_port())] if command == "serve" else ["--broker", f"sqlite://{tmp_path / 'q.db'}"]
    one = _started([command, *where, "--model", str(smollm2_path)], env)
    two = _started([command, *where, "--model", str(smollm2_path), "--model", str(gemma3_path)], env)
    assert two.returncode == one.returncode == 2, two.stderr
    assert two.stderr.splitlines()[0] == one.stderr.splitlines()[0] == (
        "error: the plan is for profile rpi4-1gb, not this machine, so it cannot be loaded here")
    assert "Traceback" not in two.stderr
