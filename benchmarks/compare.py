"""A table across devices from saved `nodeagent bench` results (benchmarks/results/<profile>/*.json).

Usage: python benchmarks/compare.py [RESULTS_DIR ...]   (default: benchmarks/results) -> markdown on stdout
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COLUMNS = ("device", "model", "cpu", "load (warm, mmap)", "prompt tok/s", "gen tok/s", "first token",
           "extract/min at 1 / 4 slots", "classify/min at 1 / 4 slots", "llama.cpp gain at 4 sequences",
           "overhead vs llama-cpp-python", "a step of 2 / 17 tokens (drafts)",
           "plan / peak memory (worst)")


def results(dirs: list[Path]) -> list[dict]:
    out = []
    for d in dirs:
        for f in sorted(d.glob("*/*.json")):
            data = json.loads(f.read_text())
            if data.get("schema") == "nodeagent.bench/1":
                out.append(data)
    return out


def row(r: dict) -> list[str]:
    warm = next((x for x in r["load"] if x["mmap"] and not x["cold"]), r["load"][0])
    longest = r["speeds"][-1]
    by = {s["slots"]: s for s in r["slots"]}
    first, last = by[min(by)], by[max(by)]
    worst = min(s["memory"]["planned_over_peak"] for s in r["slots"])
    return [r["profile"] + (" (quick)" if r["quick"] else ""), f"{Path(r['model_file']).name}",
            f"{r['probe'].get('cpu_model') or '?'}, {r['probe']['cores_logical']} cores",
            f"{warm['load_and_first_token_s']:.2f} s",
            f"{longest['prompt_tps']} ({longest['prompt_tokens']} tokens)", f"{r['speeds'][0]['gen_tps']}",
            f"{r['speeds'][0]['ttft_s'] * 1000:.0f} ms ({r['speeds'][0]['prompt_tokens']} tokens)",
            f"{first['tasks']['extract']['per_min']} / {last['tasks']['extract']['per_min']} "
            f"(x{last['speedup']['extract']})",
            f"{first['tasks']['classify']['per_min']} / {last['tasks']['classify']['per_min']} "
            f"(x{last['speedup']['classify']})",
            next((f"x{b['speedup']}" for b in r.get("batch_scaling", []) if b["sequences"] == last["slots"]), "-"),
            f"{(r['overhead']['ratio'] - 1) * 100:+.1f} %", _drafts(r.get("drafts")), f"{worst}"]


def _drafts(d: dict | None) -> str:
    """A step's cost by its tokens and the draft length chosen (a result from before bench measured it: -)."""
    if not d:
        return "-"
    cost = {c["tokens"]: c["relative"] for c in d["cost"]}
    return f"x{cost.get(2, '?')} / x{cost.get(17, '?')} ({d['draft_tokens'] or 'off'})"


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    dirs = [Path(a) for a in sys.argv[1:]] or [ROOT / "benchmarks" / "results"]
    found = results(dirs)
    if not found:
        sys.exit(f"no bench results under {', '.join(map(str, dirs))}: run benchmarks/device.py or "
                 "nodeagent bench --save DIR")
    sys.stdout.write(table(found))


if __name__ == "__main__":
    main()
