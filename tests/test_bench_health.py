"""Heat in `nodeagent bench`: the device's health read before and after each phase with the throttle flags since
boot (bench/heat.py), the cooldown between phases, and `bench --sustained` on the fake backend (a hot recorded
machine) and on SmolLM2 (this machine), as a user types it."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from conftest import HARDWARE, cli

from nodeagent.bench.heat import Thermal, words
from nodeagent.bench.sustained import parse_duration
from nodeagent.errors import UsageError
from nodeagent.hardware.health import HealthReader
from nodeagent.hardware.system import RecordedSystem

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
THROTTLE = "/sys/devices/platform/soc/soc:firmware/get_throttled"
TEMP = "/sys/class/thermal/thermal_zone0/temp"


def pi4() -> tuple[RecordedSystem, HealthReader]:
    sys = RecordedSystem.load(HARDWARE / "rpi4-4gb-undervolted.json")
    sys.files[THROTTLE], sys.files[TEMP] = "0\n", "48000\n"  # a cool Pi, nothing since boot
    return sys, HealthReader(sys)


def test_health_is_read_around_each_phase_and_a_throttle_during_the_run_is_said():
    sys, reader = pi4()
    slept: list[float] = []
    t = Thermal(reader.read, cooldown_s=30, sleep=slept.append)

    def heats() -> str:
        sys.files[TEMP], sys.files[THROTTLE] = "81500\n", "a000a\n"  # soft limit and capped, now and since boot
        return "ran"

    def cools() -> str:
        sys.files[TEMP], sys.files[THROTTLE] = "60000\n", "a0000\n"  # cleared now; since boot stays
        return "ran"

    assert t.around("load", lambda: "ran") == "ran"
    assert t.around("1 slot", heats) == "ran"
    assert t.around("2 slots", cools) == "ran"
    assert slept == [30, 30]  # before every phase but the first
    s = t.summary()
    assert [p["phase"] for p in s["phases"]] == ["load", "1 slot", "2 slots"]
    assert s["phases"][1]["before"]["temperature_c"] == 48.0 and s["phases"][1]["after"]["temperature_c"] == 81.5
    assert s["phases"][1]["after"]["throttling"] == ["frequency capped", "soft temperature limit"]
    assert s["since_boot"] == {"start": [], "end": ["frequency capped", "soft temperature limit"]}
    assert s["throttled_during_run"] is True and s["temperature_c"] == {"min": 48.0, "max": 81.5}
    assert s["throttling_seen"] == ["frequency capped", "soft temperature limit"]
    assert words(s).startswith("THROTTLED during the run (frequency capped, soft temperature limit); 48-81.5 °C")
    quiet = Thermal(pi4()[1].read)
    quiet.around("load", lambda: None)
    assert quiet.summary()["throttled_during_run"] is False and words(quiet.summary()) == "none seen; 48 °C"
    assert Thermal(None).summary()["throttled_during_run"] is None  # no reading: not known, not "no"


def test_a_bench_result_carries_its_thermal_record_and_passes_its_schema(monkeypatch):
    """bench() with each phase's output taken from a saved result (no model run): the health is read around every
    phase and the result, with its `thermal` part, passes its JSON Schema."""
    import nodeagent.bench.run as run
    from nodeagent.hardware import probe
    from nodeagent.profiles import get_profile

    saved = json.loads((ROOT / "benchmarks/results/linux-cpu/SmolLM2-135M-Instruct.Q4_1.json").read_text())
    by_slots = {s["slots"]: s for s in saved["slots"]}
    chat = [{"s": 0.5, "prompt_tokens": 40, "completion_tokens": 32}]

    def phase(spec, timeout_s=0):
        if spec["phase"] == "load":
            return next(x for x in saved["load"] if (x["mmap"], x["cold"]) == (spec["mmap"], spec["cold"]))
        if spec["phase"] == "raw":
            return {"chat": chat, "batch_scaling": saved["batch_scaling"]}
        if spec["phase"] == "prefixes":
            return {"kept": True, "lengths": [
                {"prompt_tokens": 1000, "prefill_s": 3.1, "prefill_tps": 322.6, "state_bytes": 23_052_744,
                 "bytes_per_token": 23053, "write_s": 0.04, "restored": True, "restore_s": 0.064,
                 "cache_dropped": True, "prefill_over_restore": 48.4}]}
        if spec["phase"] == "drafts":
            return {"cost": [{"tokens": 1, "s_per_step": 0.01, "relative": 1.0},
                             {"tokens": 2, "s_per_step": 0.019, "relative": 1.9}], "node_step_overhead_s": 0.0,
                    "drafts": 3, "drafted_tokens": 30, "kept_tokens": 6, "draft_tokens": 0, "gain": 1.0,
                    "reason": "drafts from the input: off, they do not pay on this device"}
        s = by_slots[spec["slots"]]
        return {"slots": spec["slots"], "plan": saved["plans"][str(spec["slots"])], "speeds": saved["speeds"],
                "chat": chat, "prompts": ["p"], "tasks": s["tasks"] if spec["tasks"] else {},
                "memory": {k: v for k, v in s["memory"].items() if k != "planned_over_peak"}}

    monkeypatch.setattr(run, "run_phase", phase)
    monkeypatch.setattr(run, "fitting_slots", lambda spec, progress: [1, 2, 4, 8])
    sys, reader = pi4()

    class Device:
        hardware = probe(sys)
        profile = get_profile("rpi4-4gb")

    reads = []

    def read():
        reads.append(1)
        return reader.read()

    result = run.bench(run.BenchSpec(model="m.gguf", quick=True), Device(), health=read)
    steps = 4 + 4 + 2 + 1 + 1  # loads, slot counts, one raw and agent pair, drafts, warm prefixes
    assert len(result["thermal"]["phases"]) == steps and len(reads) == 2 * steps + 2  # around each, start, end
    assert result["thermal"]["phases"][0]["before"]["temperature_c"] == 48.0
    assert result["thermal"]["throttled_during_run"] is False and result["thermal"]["cooldown_s"] == 0
    schema = json.loads((ROOT / "nodeagent/bench/result.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(result)
    assert dict(run.summary_rows(result))["throttling"].startswith("none seen; 48 °C")


def test_durations():
    assert parse_duration("20s") == 20 and parse_duration("5m") == 300 and parse_duration("1h") == 3600
    assert parse_duration("90") == 90 and parse_duration("0.5m") == 30
    for bad in ("", "5 minutes", "-3s", "0s"):
        with pytest.raises(UsageError):
            parse_duration(bad)


def test_sustained_on_the_fake_backend_on_a_hot_pi(isolated_env, tmp_path):
    env = {**isolated_env, "NODEAGENT_HARDWARE_FIXTURE": str(HARDWARE / "rpi5-8gb-hot.json")}
    out = tmp_path / "out"
    proc = cli(["bench", "fake:latency_ms=30", "--sustained", "4s", "--window", "2s", "--json", "--save", str(out)],
               env)
    r = json.loads(proc.stdout)
    assert r["schema"] == "nodeagent.bench.sustained/1" and r["backend"] == "fake" and r["duration_s"] == 4.0
    assert [(w["from_s"], w["to_s"]) for w in r["windows"]] == [(0, 2), (2, 4)]
    assert r["tasks"] == sum(w["tasks"] for w in r["windows"]) > 10 and r["valid"] == r["tasks"]
    for w in r["windows"]:
        assert w["tasks_per_s"] == pytest.approx(w["tasks"] / 2, abs=1e-3) and w["tokens_per_s"] > 0
        assert w["health"]["temperature_c"] == 84.5 and w["health"]["cpu_freq_ratio"] == 0.625
        assert w["health"]["throttling"] == ["frequency capped", "throttled", "soft temperature limit"]
    ratio = r["ratio_last_to_first"]["tasks_per_s"]
    assert ratio == pytest.approx(r["windows"][1]["tasks_per_s"] / r["windows"][0]["tasks_per_s"], abs=1e-3)
    assert r["throttling_seen"] == ["frequency capped", "soft temperature limit", "throttled"]
    assert "2 of 4 s" in proc.stderr
    stem = "fake_latency_ms_30-sustained-4s"
    assert json.loads((out / f"{stem}.json").read_text()) == r
    assert "| last / first window | x" in (out / f"{stem}.md").read_text()
    assert (out / f"{stem}.png").read_bytes()[:8] == PNG_MAGIC
    table = cli(["bench", "fake", "--sustained", "2s", "--window", "1s", "--cooldown", "0.5"], env)
    assert "84.5 °C, clock 62%, throttling: frequency capped" in table.stdout and "cooling down 0.5 s" in table.stderr


def test_sustained_on_smollm2_here(smollm2_path, isolated_env):
    proc = cli(["bench", str(smollm2_path), "--sustained", "8s", "--window", "4s", "--ctx", "512", "--json"],
               isolated_env)
    r = json.loads(proc.stdout)
    assert r["backend"] == "llamacpp" and len(r["windows"]) == 2 and r["tasks"] > 0
    assert r["valid"] == r["tasks"]  # every extraction schema-valid, every classification ok
    assert all(w["tokens_per_s"] > w["generated_tokens_per_s"] > 0 for w in r["windows"] if w["tasks"])
    assert r["ratio_last_to_first"]["tokens_per_s"] is not None
    here = r["windows"][0]["health"]
    assert ("temperature_c" in here) == any(Path("/sys/class/thermal").glob("thermal_zone*/temp"))
