"""The wheel: a non-editable install lists the device profiles and the model catalog, and plans a catalog
model offline from the header facts it ships, from a folder far from the checkout."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_profiles_catalog_and_facts(tmp_path):
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, text=True)
    wheel = next(out.glob("nodeagent-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
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
