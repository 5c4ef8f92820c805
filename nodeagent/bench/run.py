"""`nodeagent bench`: the numbers people compare devices by, measured the same way on every device.

Each phase runs in a fresh process (``nodeagent.bench.phase``) so that its load time and its peak memory are
its own; this module plans the phases, shows progress on stderr, and assembles one result: the probe, the
plans, the software versions, and the measurements, with the ratios the README quotes:

- the agent's overhead: the same chat completions through the node and through llama-cpp-python alone, in
  alternating processes (the 1-slot run, then raw and agent in turn, 3 pairs in full), as a ratio of seconds per
  generated token;
- tasks per minute at each slot count (1, 2, 4 and 8), against one slot, and beside it llama.cpp's own gain from
  decoding that many sequences in one llama_decode (the bindings alone): the ceiling for what slots can gain on
  the device, and the agent's share of it;
- the plan against the measured peak memory at each slot count;
- the recommendation: the slot count with the most tasks per minute whose plan fits, and where more slots stop
  paying (`nodeagent bench --apply` writes it to the node's config);
- the first 16 tokens after a load from a cold and a warm page cache, with mmap on and off;
- drafts from the input: a step's cost by the tokens it carries (k up to 16 drafted) and what the model kept of
  its drafts on the workload's extractions; the draft length that pays here, or none (``planner/drafts.py``),
  which the node's plans then take (``store/measured.py``);
- heat: the device's health before and after each phase and the throttle flags since boot (``heat.py``), so a
  result says whether the device slowed itself while it was measured; ``cooldown_s`` between phases.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from nodeagent.errors import BackendError
from nodeagent.planner.types import ctx_per_slot

SCHEMA_PATH = Path(__file__).with_name("result.schema.json")


@dataclass(frozen=True)
class BenchSpec:
    model: str
    quick: bool = False
    ctx_tokens: int = 2048
    slots: tuple[int, ...] = (1, 2, 4, 8)

    @property
    def tasks(self) -> int:
        return 4 if self.quick else 24

    @property
    def lengths(self) -> list[int]:
        return [128, 512] if self.quick else [128, 512, 1536]

    @property
    def gen_tokens(self) -> int:
        return 32 if self.quick else 64

    @property
    def overhead_rounds(self) -> int:
        return 2 if self.quick else 8

    @property
    def overhead_pairs(self) -> int:
        """Raw and agent chat phases taken in turn after the runs (drift on a shared machine evens out)."""
        return 1 if self.quick else 3


def run_phase(spec: dict[str, Any], timeout_s: float = 1800) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "nodeagent.bench.phase", json.dumps(spec)], capture_output=True,
                          text=True, timeout=timeout_s)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BackendError(f"benchmark phase {spec['phase']} failed: {last}",
                           hint="run it alone with: python -m nodeagent.bench.phase '<spec>' to see why")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(spec: BenchSpec, device: Any, progress: Callable[[str], None] = lambda s: None,
          health: Callable[[], Any] | None = None, cooldown_s: float = 0.0) -> dict[str, Any]:
    """``health``: a reading of the device's health (``HealthReader.read``), taken before and after each phase;
    ``cooldown_s``: a wait before each phase after the first."""
    from nodeagent.bench.heat import Thermal

    thermal = Thermal(health, cooldown_s, progress)
    base = {"model": spec.model, "ctx_tokens": spec.ctx_tokens}
    loads = [{"phase": "load", **base, "mmap": m, "cold": c} for m in (True, False) for c in (True, False)]
    counts = fitting_slots(spec, progress)
    steps = len(loads) + len(counts) + 2 * spec.overhead_pairs + 2
    done = [0]
    started = time.perf_counter()

    def step(label: str, phase: dict[str, Any]) -> dict[str, Any]:
        done[0] += 1
        progress(f"[{done[0]}/{steps}] {label} ({time.perf_counter() - started:.0f} s)")
        return thermal.around(label, lambda: run_phase(phase))

    load = [step(f"load, mmap {'on' if p['mmap'] else 'off'}, {'cold' if p['cold'] else 'warm'} page cache", p)
            for p in loads]
    runs = []
    for n in counts:
        runs.append(step(f"{n} slot{'s' if n > 1 else ''}: {'speeds, ' if n == 1 else ''}{spec.tasks} extractions "
                         f"and {spec.tasks} classifications",
                         {"phase": "run", **base, "slots": n, "tasks": spec.tasks, "probes": n == 1,
                          "lengths": spec.lengths, "gen_tokens": spec.gen_tokens,
                          "overhead_rounds": spec.overhead_rounds}))
    one = runs[0]
    raw_spec = {"phase": "raw", "settings": one["plan"]["settings"], "prompts": one["prompts"],
                "gen_tokens": spec.gen_tokens,
                "scaling": {"settings": runs[-1]["plan"]["settings"], "sequences": counts,
                            "steps": spec.gen_tokens,
                            # at the extraction prompts' length: the context the slots really decode at
                            "prompt_tokens": one["tasks"]["extract"]["prompt_tokens"] if one["tasks"] else 12}}
    raws, agains = [], []
    for _ in range(spec.overhead_pairs):  # raw and agent in turn, so drift on a shared machine favours neither
        raws.append(step("the same chat completions through llama-cpp-python alone", raw_spec))
        raw_spec = {k: v for k, v in raw_spec.items() if k != "scaling"}  # the batch gain is measured once
        agains.append(step("the chat completions through the node again",
                           {"phase": "run", **base, "slots": 1, "tasks": 0, "probes": True, "lengths": [],
                            "gen_tokens": spec.gen_tokens, "overhead_rounds": spec.overhead_rounds}))
    drafts = step("drafts from the input: a step's cost by its tokens, and what the model keeps of its drafts",
                  {"phase": "drafts", **base, "tasks": spec.tasks, "steps": 8 if spec.quick else 24})
    lengths = PREFIX_LENGTHS[:2] if spec.quick else PREFIX_LENGTHS
    prefixes = step(f"warm prefixes: prompts of {', '.join(map(str, lengths))} tokens read from their tokens, against "
                    "their state read back from disk", {"phase": "prefixes", **base, "lengths": lengths})
    result = assemble(spec, device, load, runs, raws, agains, time.perf_counter() - started)
    result["drafts"] = drafts
    result["prefixes"] = prefixes
    result["thermal"] = thermal.summary()
    check(result)
    return result


def fitting_slots(spec: BenchSpec, progress: Callable[[str], None]) -> list[int]:
    """The slot counts whose plan fits this device (a count that does not is said and left out)."""
    import os

    from nodeagent.config import resolve
    from nodeagent.node import Node

    out = []
    for n in spec.slots:
        p = Node(spec.model, config=resolve(env=dict(os.environ)), task="classify", ctx_tokens=spec.ctx_tokens,
                 slots=n).plan
        if p.fits or n == 1:
            out.append(n)
        else:
            progress(f"{n} slots: left out, the plan does not fit ({p.reasons[-1]})")
    return out


def _per_token(chats: list[dict[str, Any]]) -> float:
    return sum(c["s"] for c in chats) / max(1, sum(c["completion_tokens"] for c in chats))


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("nodeagent", "llama-cpp-python", "llguidance", "mlx-lm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def assemble(spec: BenchSpec, device: Any, load: list[dict], runs: list[dict], raws: list[dict],
             agains: list[dict], wall_s: float) -> dict[str, Any]:
    one = runs[0]
    agent_chats = one["chat"] + [c for a in agains for c in a["chat"]]
    raw_chats = [c for r in raws for c in r["chat"]]
    agent, plain = _per_token(agent_chats), _per_token(raw_chats)
    base = {k: one["tasks"][k]["per_min"] for k in one["tasks"]}
    ceiling = {b["sequences"]: b["speedup"] for b in raws[0]["batch_scaling"]}
    slots = []
    for r in runs:
        m = r["memory"]
        speedup = {k: round(r["tasks"][k]["per_min"] / base[k], 3) if base[k] else None for k in r["tasks"]}
        top = ceiling.get(r["slots"])
        slots.append({
            "slots": r["slots"], "ctx_per_slot": ctx_per_slot(r["plan"]["settings"]["n_ctx"], r["slots"]),
            "n_ctx": r["plan"]["settings"]["n_ctx"], "tasks": r["tasks"], "speedup": speedup,
            "ceiling": top,
            "share_of_ceiling": {k: round(v / top, 3) if v and top else None for k, v in speedup.items()},
            "fits": bool(r["plan"]["fits"]),
            "memory": {**m, "planned_over_peak": round(m["planned_bytes"] / m["peak_rss_bytes"], 4)},
        })
    hw = device.hardware
    return {
        "schema": "nodeagent.bench/1", "quick": spec.quick, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": round(wall_s, 1), "model": spec.model, "model_file": one["plan"]["model"],
        "quant": one["plan"]["quant"], "profile": device.profile.id, "versions": versions(),
        "probe": hw.model_dump(mode="json"), "plans": {str(r["slots"]): r["plan"] for r in runs},
        "load": load, "speeds": one["speeds"],
        "overhead": {"agent_s_per_token": round(agent, 5), "raw_s_per_token": round(plain, 5),
                     "ratio": round(agent / plain, 4),
                     "agent_tokens": sum(c["completion_tokens"] for c in agent_chats),
                     "raw_tokens": sum(c["completion_tokens"] for c in raw_chats),
                     "rounds": spec.overhead_rounds, "pairs": spec.overhead_pairs},
        "batch_scaling": raws[0]["batch_scaling"],
        "slots": slots,
        "recommendation": recommend(slots),
    }


PAYS = 1.10  # more slots pay when they add at least 10 % tasks per minute
PREFIX_LENGTHS = [300, 1000, 3000]  # a warm prefix's: an extraction's instructions, a system prompt with tools


def recommend(slots: list[dict[str, Any]]) -> dict[str, Any]:
    """The slot count with the most tasks per minute (the mean of extraction and classification) among those whose
    plan fits and whose every output was valid; and where more slots stop paying (the smallest count that no
    larger one beats by 10 %)."""
    def score(s: dict[str, Any]) -> float:
        t = s["tasks"]
        return (t["extract"]["per_min"] + t["classify"]["per_min"]) / 2

    usable = [s for s in slots if s.get("fits", True) and all(t["valid"] == t["tasks"] for t in s["tasks"].values())]
    if not usable:
        return {"slots": 1, "tasks_per_min": 0.0, "speedup": 1.0, "stops_paying_at": None,
                "reason": "no slot count ran with every output valid within the plan: slots 1"}
    best = max(usable, key=score)
    first = score(usable[0]) or 1.0
    # where more slots stop paying: the smallest count that no larger one beats by PAYS
    stops = next((s["slots"] for i, s in enumerate(usable)
                  if i + 1 < len(usable) and all(score(t) < PAYS * score(s) for t in usable[i + 1:])), None)
    gain = score(best) / first
    reason = (f"slots {best['slots']}: {score(best):.1f} tasks/min, x{gain:.2f} one slot's"
              + (f"; past {stops} slots, more add under {round((PAYS - 1) * 100)} %" if stops else "")
              + (f" (llama.cpp's own gain at {best['slots']} sequences: x{best['ceiling']})" if best.get("ceiling")
                 else ""))
    return {"slots": best["slots"], "tasks_per_min": round(score(best), 1), "speedup": round(gain, 3),
            "stops_paying_at": stops, "reason": reason}


def check(result: dict[str, Any]) -> None:
    """The result against its JSON Schema (result.schema.json): a broken result is never saved."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(result))
    if error is not None:
        raise BackendError(f"the benchmark result breaks its schema at /{'/'.join(map(str, error.absolute_path))}: "
                           f"{error.message}")


def summary_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("model", f"{Path(result['model_file']).name} ({result['quant']})"), ("profile", result["profile"])]
    for entry in result["load"]:
        rows.append((f"load, mmap {'on' if entry['mmap'] else 'off'}, {'cold' if entry['cold'] else 'warm'}",
                     f"{entry['load_s']:.2f} s; with the first token {entry['load_and_first_token_s']:.2f} s"
                     + (f", the first 16 tokens {entry['load_and_16_tokens_s']:.2f} s" if "load_and_16_tokens_s"
                        in entry else "")
                     + ("" if entry["cache_dropped"] or not entry["cold"] else " (the cache could not be dropped)")))
    for s in result["speeds"]:
        rows.append((f"prompt {s['prompt_tokens']} tokens", f"{s['prompt_tps']} tok/s prompt, {s['gen_tps']} tok/s "
                                                           f"generation, first token {s['ttft_s'] * 1000:.0f} ms"))
    o = result["overhead"]
    rows.append(("agent overhead", f"{(o['ratio'] - 1) * 100:+.1f} % per generated token against llama-cpp-python "
                                   "alone"))
    prompt = result["slots"][0]["tasks"]["extract"].get("prompt_tokens")
    rows.append(("llama.cpp batch gain", ", ".join(f"x{b['speedup']} tokens/s at {b['sequences']} sequences"
                                                   for b in result["batch_scaling"][1:])
                  + " per llama_decode step (llama-cpp-python alone: the ceiling for slots"
                  + (f"; each sequence holding a {prompt}-token prompt, as the extractions do)" if prompt else ")")))
    for s in result["slots"]:
        t = s["tasks"]
        rows.append((f"{s['slots']} slot{'s' if s['slots'] > 1 else ''}",
                     f"extract {t['extract']['per_min']}/min ({t['extract']['valid']}/{t['extract']['tasks']} "
                     f"valid, x{s['speedup']['extract']}), classify {t['classify']['per_min']}/min "
                     f"(x{s['speedup']['classify']})"
                     + (f", {round(100 * s['share_of_ceiling']['extract'])} % / "
                        f"{round(100 * s['share_of_ceiling']['classify'])} % of llama.cpp's x{s['ceiling']}"
                        if s.get("ceiling") and s["slots"] > 1 and all(s["share_of_ceiling"].values()) else "")
                     + f"; plan/peak memory {s['memory']['planned_over_peak']}"))
    if "recommendation" in result:
        rows.append(("recommended", result["recommendation"]["reason"]))
    if "drafts" in result:
        d = result["drafts"]
        rows.append(("step cost by tokens", ", ".join(f"{c['tokens']}: x{c['relative']}" for c in d["cost"])
                     + " the time of a step of 1 (one sequence, logits for each)"))
        rows.append(("drafts", d["reason"]))
    for p in (result.get("prefixes") or {}).get("lengths", []):
        rows.append((f"warm prefix {p['prompt_tokens']} tokens",
                     f"prefill {p['prefill_s']:.2f} s ({p['prefill_tps']} tok/s); its state "
                     f"{p['state_bytes'] / 1e6:.1f} MB, written in {p['write_s']:.2f} s, "
                     + (f"read back in {p['restore_s']:.3f} s (x{p['prefill_over_restore']} faster than the prefill"
                        + ("" if p["cache_dropped"] else "; the page cache could not be dropped") + ")"
                        if p["restored"] else "not read back (llama.cpp refused it)")))
    if "thermal" in result:
        from nodeagent.bench.heat import words

        rows.append(("throttling", words(result["thermal"])))
    return rows


def markdown(result: dict[str, Any]) -> str:
    hw = result["probe"]
    lines = [f"# nodeagent bench: {Path(result['model_file']).name} on {result['profile']}", "",
             f"Measured by `nodeagent bench{' --quick' if result['quick'] else ''}` on {result['created']} "
             f"({hw.get('cpu_model') or '?'}, {hw.get('cores_logical')} logical cores, "
             f"{hw.get('ram_total_bytes', 0) / (1 << 30):.1f} GiB RAM); "
             + ", ".join(f"{k} {v}" for k, v in result["versions"].items()) + ".", "",
             "| measure | result |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in summary_rows(result)]
    lines += ["", "| slots | context per slot | extract/min | classify/min | valid | planned MiB | peak MiB | "
                  "plan/peak |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in result["slots"]:
        t, m = s["tasks"], s["memory"]
        lines.append(f"| {s['slots']} | {s['ctx_per_slot']} | {t['extract']['per_min']} | {t['classify']['per_min']} "
                     f"| {t['extract']['valid'] + t['classify']['valid']}/{t['extract']['tasks'] + t['classify']['tasks']}"
                     f" | {m['planned_bytes'] / (1 << 20):.1f} | {m['peak_rss_bytes'] / (1 << 20):.1f} | "
                     f"{m['planned_over_peak']} |")
    return "\n".join(lines) + "\n"


def write_result(result: dict[str, Any], text: str, out_dir: Path, stem: str) -> list[Path]:
    """A bench result as ``<stem>.json`` and its markdown as ``<stem>.md`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(text)
    return paths


def save(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """JSON, markdown and (with matplotlib) PNG plots under ``out_dir``, named by the model file."""
    stem = Path(result["model_file"]).stem + ("-quick" if result["quick"] else "")
    paths = write_result(result, markdown(result), out_dir, stem)
    try:
        from nodeagent.bench.plots import plot_all
    except ImportError:  # matplotlib is an optional extra
        return paths
    return paths + plot_all(result, out_dir, stem)
