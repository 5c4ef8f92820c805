"""`nodeagent bench --quick` end to end on SmolLM2, as a user types it: its JSON against its schema, the saved
files (the plots are PNG files), and benchmarks/compare.py over them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
from conftest import cli

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_quick_on_smollm2(smollm2_path, isolated_env, tmp_path):
    out = tmp_path / "results" / "this-device"
    proc = cli(["bench", str(smollm2_path), "--quick", "--json", "--save", str(out)], isolated_env)
    result = json.loads(proc.stdout)
    schema = json.loads((ROOT / "nodeagent/bench/result.schema.json").read_text())
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(result)
    assert "[1/" in proc.stderr and "[9/9]" in proc.stderr  # the progress display
    assert [s["slots"] for s in result["slots"]] == [1, 2, 4]
    for s in result["slots"]:
        for kind in ("extract", "classify"):
            assert s["tasks"][kind]["valid"] == s["tasks"][kind]["tasks"], s["tasks"][kind]["errors"]
        assert s["n_ctx"] == s["slots"] * s["ctx_per_slot"]
    assert result["overhead"]["agent_tokens"] > 0 and result["overhead"]["raw_tokens"] > 0
    scaling = result["batch_scaling"]  # llama.cpp's own batch gain, at the same sequence counts as the slots
    assert [b["sequences"] for b in scaling] == [1, 2, 4] and scaling[0]["speedup"] == 1.0
    assert "llama.cpp batch gain" in (out / "SmolLM2-135M-Instruct.Q4_1-quick.md").read_text()
    assert {(x["mmap"], x["cold"]) for x in result["load"]} == {(True, True), (True, False), (False, True),
                                                                 (False, False)}
    saved = json.loads((out / "SmolLM2-135M-Instruct.Q4_1-quick.json").read_text())
    assert saved == result
    assert (out / "SmolLM2-135M-Instruct.Q4_1-quick.md").read_text().startswith("# nodeagent bench")
    # the throughput the scheduler places by: kept in the state directory, read by the node's registration
    from nodeagent.fleet.registration import bench_throughput

    rates = bench_throughput(Path(isolated_env["NODEAGENT_HOME"]))
    assert rates["smollm2-135m-instruct"] == rates["SmolLM2-135M-Instruct.Q4_1.gguf"] > 0
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 4 and all(p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000 for p in pngs)
    table = subprocess.run([sys.executable, str(ROOT / "benchmarks/compare.py"), str(tmp_path / "results")],
                           capture_output=True, text=True, check=True).stdout
    assert f"{result['profile']} (quick)" in table and "SmolLM2-135M-Instruct.Q4_1.gguf" in table
    assert table.count("\n") == 3  # the header, its rule, one device


def test_bench_refuses_a_model_that_is_not_here(isolated_env):
    proc = cli(["bench", "/nonexistent/model.gguf", "--quick"], isolated_env, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2
