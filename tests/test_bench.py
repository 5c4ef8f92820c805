"""`nodeagent bench --quick` end to end on SmolLM2, as a user types it: its JSON against its schema, the saved
files (the plots are PNG files), and benchmarks/compare.py over them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from conftest import cli

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_quick_on_smollm2(smollm2_path, isolated_env, tmp_path):
    """bench --quick --apply: the result against its schema, the saved files, the drafts' choice; the
    recommendation is the slot count with the most tasks/min among those measured (1 and 2 here), written into the
    config file beside what was there; the next plan takes it and the drafts, and cites the measurements."""
    out = tmp_path / "results" / "this-device"
    config = Path(isolated_env["NODEAGENT_CONFIG"])
    config.write_text("# my node\nlog_level = \"warning\"  # quiet\n")
    proc = cli(["bench", str(smollm2_path), "--quick", "--slots", "2", "--apply", "--json", "--save", str(out)],
               isolated_env)
    result = json.loads(proc.stdout)
    rec = result["recommendation"]
    score = {s["slots"]: (s["tasks"]["extract"]["per_min"] + s["tasks"]["classify"]["per_min"]) / 2
             for s in result["slots"]}
    assert rec["slots"] == max(score, key=score.get) and rec["tasks_per_min"] == pytest.approx(max(score.values()),
                                                                                               abs=0.1)
    assert rec["stops_paying_at"] == (1 if score[2] < 1.1 * score[1] else None)
    assert rec["speedup"] == pytest.approx(max(score.values()) / score[1], abs=1e-3)
    assert f"slots = {rec['slots']} written to {config}" in proc.stderr
    text = config.read_text()
    assert text.startswith("# my node") and "# quiet" in text and f"slots = {rec['slots']}" in text
    schema = json.loads((ROOT / "nodeagent/bench/result.schema.json").read_text())
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(result)
    assert "[1/" in proc.stderr and "[10/10]" in proc.stderr  # the progress display
    assert [s["slots"] for s in result["slots"]] == [1, 2]
    for s in result["slots"]:
        for kind in ("extract", "classify"):
            assert s["tasks"][kind]["valid"] == s["tasks"][kind]["tasks"], s["tasks"][kind]["errors"]
        assert s["n_ctx"] == s["slots"] * s["ctx_per_slot"]
    assert result["overhead"]["agent_tokens"] > 0 and result["overhead"]["raw_tokens"] > 0
    scaling = result["batch_scaling"]  # llama.cpp's own batch gain, at the same sequence counts as the slots
    assert [b["sequences"] for b in scaling] == [1, 2] and scaling[0]["speedup"] == 1.0
    for s in result["slots"]:  # each slot count beside llama.cpp's own gain at that many sequences
        assert s["ceiling"] == next(b["speedup"] for b in scaling if b["sequences"] == s["slots"])
        assert s["share_of_ceiling"]["extract"] == pytest.approx(s["speedup"]["extract"] / s["ceiling"], abs=1e-3)
    assert all(x["load_and_16_tokens_s"] >= x["load_and_first_token_s"] for x in result["load"])
    assert "llama.cpp batch gain" in (out / "SmolLM2-135M-Instruct.Q4_1-quick.md").read_text()
    # drafts from the input: a step's cost by its tokens (up to 16 drafted), what the model kept, the length chosen
    drafts = result["drafts"]
    assert [c["tokens"] for c in drafts["cost"]] == [1, 2, 3, 5, 9, 17] and drafts["cost"][0]["relative"] == 1.0
    assert drafts["drafts"] == len(drafts["draft_log"]) > 0 and drafts["kept_tokens"] <= drafts["drafted_tokens"]
    assert 0 <= drafts["draft_tokens"] <= 16 and drafts["reason"].startswith("drafts from the input")
    from nodeagent.planner.drafts import choose_draft

    again = choose_draft({c["tokens"]: c["s_per_step"] for c in drafts["cost"]},
                         [tuple(d) for d in drafts["draft_log"]], 16, drafts["node_step_overhead_s"])
    assert again.draft_tokens == drafts["draft_tokens"]  # the choice follows from what was measured
    plan = json.loads(cli(["plan", str(smollm2_path), "--task", "extract", "--json"], isolated_env).stdout)
    assert plan["draft_tokens"] == drafts["draft_tokens"]  # the node's next plan takes it, and says why
    assert any(r.startswith(drafts["reason"]) for r in plan["reasons"])
    assert plan["settings"]["slots"] == rec["slots"]  # and the slots the bench applied
    # warm prefixes: each length read from its tokens, and back from disk into an empty slot, faster
    lengths = result["prefixes"]["lengths"]
    assert result["prefixes"]["kept"] and [p["prompt_tokens"] for p in lengths] == [300, 1000]
    for p in lengths:
        assert p["restored"] and p["restore_s"] < p["prefill_s"], p
        assert p["prefill_over_restore"] == pytest.approx(p["prefill_s"] / p["restore_s"], rel=0.05)
        assert p["state_bytes"] == pytest.approx(p["bytes_per_token"] * p["prompt_tokens"], rel=0.01)
    said = lengths[1]  # the plan cites the 1,000-token one
    assert any(r.startswith("warm prefixes measured here by nodeagent bench on") and
               f"in {said['prefill_s']:.2f} s ({said['prefill_tps']:g} tok/s)" in r for r in plan["reasons"])
    assert "| warm prefix 1000 tokens | prefill" in (out / "SmolLM2-135M-Instruct.Q4_1-quick.md").read_text()
    assert any(r.startswith(f"slots {rec['slots']}: measured x") and "nodeagent bench on" in r
               for r in plan["reasons"]), plan["reasons"]
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


@pytest.fixture(scope="module")
def synthetic_small() -> Path:
    """The bandwidth-bound synthetic model's 4-block variant (benchmarks/synthetic_model.py), cached."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.synthetic_model import synthetic_model

    return synthetic_model("Q8_0", "small")


@pytest.mark.parametrize("given", ["0", "two", "1,,100", ""])
def test_bench_refuses_slot_counts_it_cannot_measure(synthetic_small, isolated_env, given):
    proc = cli(["bench", str(synthetic_small), "--quick", "--slots", given], isolated_env, check=False)
    assert proc.returncode != 0 and "--slots" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2  # the error and its hint
