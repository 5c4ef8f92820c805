"""The wheel: a non-editable install lists the device profiles and the model catalog, and plans a catalog
model offline from the header facts it ships, from a folder far from the checkout; and `pip install` of the wheel
into a fresh virtual environment gives a node that serves tasks from a Redis queue."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out),
                            str(ROOT)], check=True, capture_output=True, text=True)
    assert "would be ignored" not in built.stdout + built.stderr  # every folder it ships is declared
    return next(out.glob("nodeagent-*.whl"))


def test_wheel_ships_profiles_catalog_and_facts(tmp_path, wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"nodeagent/broker/lua/{p.name}" for p in (ROOT / "nodeagent/broker/lua").glob("*.lua")} <= set(names)
    assert {f"nodeagent/_profiles/{p.name}" for p in (ROOT / "profiles").glob("*.toml")} <= set(names)
    assert {f"nodeagent/_models/{p.name}" for p in (ROOT / "models").glob("*.toml")} <= set(names)
    assert any(n.startswith("nodeagent/_models/facts/deepseek-r1-distill-qwen-7b/") for n in names)
    assert not any(n.endswith(".gguf") or "/tests/" in n for n in names)  # no weights, no tests

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, text=True)
    # -S: no site processing, so the editable install's path hook is not loaded; the dependencies come from
    # this environment's site-packages, nodeagent from the installed wheel alone
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "NODEAGENT_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(target), *site.getsitepackages()])}

    def run(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-S", "-m", "nodeagent", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    where = subprocess.run([sys.executable, "-S", "-c", "import nodeagent; print(nodeagent.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path).stdout
    assert where.startswith(str(target)), where
    profiles = {p["id"] for p in json.loads(run("profiles", "--json"))}
    assert profiles == {p.stem for p in (ROOT / "profiles").glob("*.toml")}
    catalog = json.loads(run("models", "catalog", "--json"))
    assert "deepseek-r1-distill-qwen-7b" in {m["id"] for m in catalog}
    plan = json.loads(run("plan", "deepseek-r1-distill-qwen-7b", "--profile", "rpi5-8gb", "--json"))
    assert plan["fits"] and any("header facts the catalog records" in r for r in plan["reasons"])


def test_pip_install_of_the_wheel_in_a_fresh_venv_serves_a_redis_queue(tmp_path, wheel, redis_server):
    """As a user installs it, away from the checkout: a new virtual environment, `pip install` of the wheel with
    its dependencies (pip's cache supplies the llama-cpp-python build), then a worker on the Redis broker."""
    import redis

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True,
                             cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {"PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}", "HOME": str(tmp_path),
           "NODEAGENT_HOME": str(tmp_path / "home"), "NODEAGENT_OFFLINE": "1"}
    where = subprocess.run([str(py), "-c", "import nodeagent, llama_cpp; print(nodeagent.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where.stderr
    redis.Redis.from_url(redis_server.url).flushall()
    submit = subprocess.run([str(venv / "bin" / "nodeagent"), "submit", "classify", "--labels", "a,b", "--text",
                             "from the wheel", "--broker", redis_server.url, "--json"], capture_output=True,
                            text=True, env=env, cwd=tmp_path)
    assert submit.returncode == 0, submit.stderr
    task_id = json.loads(submit.stdout)["task_id"]
    worker = subprocess.run([str(venv / "bin" / "nodeagent"), "worker", "--model", "fake", "--broker",
                             redis_server.url, "--burst"], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=120)
    assert worker.returncode == 0, worker.stderr[-3000:]
    shown = subprocess.run([str(venv / "bin" / "nodeagent"), "tasks", "show", task_id, "--broker", redis_server.url,
                            "--json"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert json.loads(shown.stdout)["result"]["status"] == "ok", shown.stdout
