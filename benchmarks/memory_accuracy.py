"""How close is the planner to what llama.cpp allocates and to what the process really peaks at?

For SmolLM2-135M (Q4_1) and Gemma 3 270M (Q4_K_M, sliding-window layers, 262k
vocabulary), over context {512, 2048, 8192} x KV {f16 without and with flash
attention, q8_0 and q4_0 with flash attention} x mmap {on, off} x n_ubatch
{128, 512} (Gemma also with swa_full on and off), each case in a fresh process:

- every predicted component against the buffer llama.cpp reports
  (targets: weights, KV and output within 1 % or 1 MiB; compute within 5 %);
- the predicted total against the process's peak RSS after a classification and an
  extraction (the plan is a serving node's: the constrained decoder and the task
  machinery are in it) and then filling the whole context in full batches
  (target: never more than 2 % below the peak);
- in the same run, the naive rule "file size + f16 KV" against the same peak;
- both models loaded together in one process (a model set, at each context, planned by the set's rule: the
  process overhead once, each model its plan less it), after a classification and an extraction on each and
  each context filled: the peak against the set's plan (target: within it, and no more than 5 % under it).

Writes benchmarks/results/memory_accuracy.json and .md.
Usage: python benchmarks/memory_accuracy.py [--quick] [--resume] [--ctx 512,2048]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import write_results  # noqa: E402
from nodeagent.config import resolve  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402

MIB = 1 << 20
KV = [("f16", "f16", False), ("f16", "f16", True), ("q8_0", "q8_0", True), ("q4_0", "q4_0", True)]
COMPONENTS = ("weights_mapped_bytes", "weights_anon_bytes", "kv_bytes", "output_bytes", "compute_bytes")


def cases(quick: bool, only_ctx: set[int] | None = None):
    models_dir = resolve(env=dict(os.environ))["test_models_dir"]
    models = [("SmolLM2-135M Q4_1", test_model_path("smollm2-135m-instruct", models_dir), [True]),
              ("Gemma 3 270M Q4_K_M", test_model_path("gemma-3-270m-it", models_dir), [True, False])]
    ctxs = (512, 8192) if quick else (512, 2048, 8192)
    every = []
    for ctx, (name, path, swa_opts), (tk, tv, fa), mmap, ub, swa in itertools.product(
            ctxs, models, KV, (True, False), (128, 512), (True, False)):
        if swa not in swa_opts or (only_ctx and ctx not in only_ctx):
            continue
        if quick and (mmap is False or ub == 128):
            continue
        every.append((name, path, {"ctx_tokens": ctx, "type_k": tk, "type_v": tv, "flash_attn": fa,
                                   "use_mmap": mmap, "n_ubatch": ub, "n_batch": 512, "swa_full": swa}))
    # the 8k cases fill 8k tokens each and take minutes on 2 cores: every model, KV type and SWA setting
    # at 8k (mmap on, n_ubatch 512) runs before the remaining 8k variations
    def tier(case):
        f = case[2]
        return 1 if f["ctx_tokens"] == 8192 and (not f["use_mmap"] or f["n_ubatch"] != 512) else 0
    return sorted(every, key=tier)


def within(component: str, planned: int, actual: int) -> bool:
    if component == "compute_bytes":
        return abs(planned - actual) <= 0.05 * actual
    return abs(planned - actual) <= max(0.01 * actual, MIB)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="A small subset, for a smoke run")
    ap.add_argument("--resume", action="store_true", help="Keep the cases already in the results file (a failed "
                                                          "one runs again)")
    ap.add_argument("--ctx", help="Only these contexts, e.g. 512,2048 (with --resume: add them to the file)")
    args = ap.parse_args()
    only = {int(x) for x in args.ctx.split(",")} if args.ctx else None
    rows, together = [], []
    started = time.time()
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    done = set()
    if args.resume and (out / f"memory_accuracy{suffix}.json").exists():
        old = json.loads((out / f"memory_accuracy{suffix}.json").read_text())
        rows = [r for r in old["cases"] if "error" not in r]
        together = [r for r in old.get("together", []) if "error" not in r]
        done = {(r["label"] if "label" in r else r["model"], json.dumps(r["fixed"], sort_keys=True)) for r in rows}
    for name, path, fixed in cases(args.quick, only):
        if (name, json.dumps(fixed, sort_keys=True)) in done:
            continue
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "_case.py"), str(path), json.dumps(fixed)],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            rows.append({"model": name, "label": name, "fixed": fixed, "error": proc.stderr.strip().splitlines()[-1:]})
            print(f"{name} {fixed}: FAILED {rows[-1]['error']}", file=sys.stderr)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["label"], r["fixed"] = name, fixed
        r["checks"] = {c["component"]: within(c["component"], c["planned_bytes"], c["actual_bytes"])
                       for c in r["components"]}
        total, peak = r["planned"]["total_bytes"], r["peak_rss_bytes"]
        r["total_over_peak"] = total / peak
        r["naive_over_peak"] = r["naive_bytes"] / peak
        rows.append(r)
        print(f"{name} ctx {fixed['ctx_tokens']} {fixed['type_k']} fa={fixed['flash_attn']} mmap={fixed['use_mmap']} "
              f"ub={fixed['n_ubatch']} swa_full={fixed['swa_full']}: planned/peak {r['total_over_peak']:.3f} "
              f"naive/peak {r['naive_over_peak']:.3f} components ok {all(r['checks'].values())}", file=sys.stderr)
        write(out, suffix, rows, together, started, complete=False)  # a cut-short run keeps what it did
    have = {r["ctx_tokens"] for r in together}
    for ctx in sorted({c[2]["ctx_tokens"] for c in cases(args.quick, only)} - have):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_model.py"), "--ctx", str(ctx),
                               "--child", "memory", "together"], capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            together.append({"ctx_tokens": ctx, "error": proc.stderr.strip().splitlines()[-1:]})
        else:
            together.append({"ctx_tokens": ctx, **json.loads(proc.stdout.strip().splitlines()[-1])})
        print(f"together ctx {ctx}: {together[-1]}", file=sys.stderr)
        write(out, suffix, rows, together, started, complete=False)
    together.sort(key=lambda r: r["ctx_tokens"])
    summary = write(out, suffix, rows, together, started, complete=True)
    print(json.dumps(summary, indent=1))


def write(out: Path, suffix: str, rows: list[dict], together: list[dict], started: float, complete: bool) -> dict:
    summary = summarize(rows)
    ok = [r for r in together if "error" not in r]
    summary["together"] = {"cases": len(together), "min": round(min(r["ratio"] for r in ok), 3),
                           "max": round(max(r["ratio"] for r in ok), 3),
                           "within_plan_and_5pct": sum(1.0 <= r["ratio"] <= 1 / 0.95 for r in ok)} if ok else {}
    summary["wall_s"] = round(time.time() - started, 1)
    summary["complete"] = complete
    write_results(f"memory_accuracy{suffix}", {"summary": summary, "cases": rows, "together": together},
                  markdown(summary, rows, together), out, indent=1)
    return summary


def summarize(rows: list[dict]) -> dict:
    planned = sum(1 for _ in cases(False))
    ok = [r for r in rows if "error" not in r]
    comp = {c: {"within_target": sum(r["checks"][c] for r in ok), "cases": len(ok),
                "max_abs_error_pct": round(100 * max(abs(x["planned_bytes"] - x["actual_bytes"]) / x["actual_bytes"]
                                                     for r in ok for x in r["components"]
                                                     if x["component"] == c and x["actual_bytes"]), 2)
                if any(x["actual_bytes"] for r in ok for x in r["components"] if x["component"] == c) else 0.0}
            for c in COMPONENTS}
    ratios = [r["total_over_peak"] for r in ok]
    naive = [r["naive_over_peak"] for r in ok]
    return {
        "cases": len(rows), "matrix_cases": planned, "failed": len(rows) - len(ok), "components": comp,
        "planned_over_peak": {"min": round(min(ratios), 3), "median": round(sorted(ratios)[len(ratios) // 2], 3),
                              "max": round(max(ratios), 3),
                              "below_peak_by_more_than_2pct": sum(x < 0.98 for x in ratios)} if ratios else {},
        "naive_over_peak": {"min": round(min(naive), 3), "median": round(sorted(naive)[len(naive) // 2], 3),
                            "max": round(max(naive), 3),
                            "below_peak_by_more_than_2pct": sum(x < 0.98 for x in naive)} if naive else {},
        "python": sys.version.split()[0], "llama_cpp": __import__("llama_cpp").__version__,
    }


def markdown(summary: dict, rows: list[dict], together: list[dict] | None = None) -> str:
    status = "" if summary.get("complete") else (f" (partial: {summary['cases']} of the {summary['matrix_cases']} "
                                                   "cases ran; see `--resume`)")
    lines = ["# Memory planner accuracy" + status, "",
             "Produced by `benchmarks/memory_accuracy.py`; each case in a fresh process on this machine "
             f"(llama-cpp-python {summary['llama_cpp']}, CPU). Planned total vs peak RSS after a classification, "
             "an extraction and filling the whole context; components vs the buffers llama.cpp reports.", "",
             "## Summary", "",
             "| | min | median | max | cases >2 % below peak |", "| --- | --- | --- | --- | --- |"]
    for key, label in (("planned_over_peak", "nodeagent plan / peak RSS"), ("naive_over_peak",
                                                                           "file size + f16 KV / peak RSS")):
        s = summary[key]
        if s:
            lines.append(f"| {label} | {s['min']} | {s['median']} | {s['max']} | "
                         f"{s['below_peak_by_more_than_2pct']} of {summary['cases'] - summary['failed']} |")
    lines += ["", "| component | within target | max error |", "| --- | --- | --- |"]
    for c, s in summary["components"].items():
        lines.append(f"| {c} | {s['within_target']} / {s['cases']} | {s['max_abs_error_pct']} % |")
    if together:
        lines += ["", "## SmolLM2 and Gemma 3 together in one process (a model set)", "",
                  "Defaults otherwise (f16 KV, flash attention, mmap). The peak after a classification and an "
                  "extraction on each and each context filled, against the set's plan (overhead once); target: "
                  "within the plan and no more than 5 % under it.", "",
                  "| ctx | planned MiB | peak MiB | plan/peak |", "| --- | --- | --- | --- |"]
        for r in together:
            lines.append(f"| {r['ctx_tokens']} | error: {r['error']} | | |" if "error" in r else
                         f"| {r['ctx_tokens']} | {r['planned_bytes'] / MIB:.1f} | {r['peak_bytes'] / MIB:.1f} | "
                         f"{r['ratio']:.3f} |")
    lines += ["", "## Cases", "",
              "| model | ctx | K/V | FA | mmap | ubatch | swa_full | planned MiB | peak MiB | plan/peak | "
              "naive/peak | compute plan/actual MiB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        f = r["fixed"]
        if "error" in r:
            lines.append(f"| {r['model']} | {f['ctx_tokens']} | {f['type_k']} | {f['flash_attn']} | {f['use_mmap']} | "
                         f"{f['n_ubatch']} | {f['swa_full']} | error: {r['error']} | | | | |")
            continue
        comp = next(c for c in r["components"] if c["component"] == "compute_bytes")
        lines.append(
            f"| {r['label']} | {f['ctx_tokens']} | {f['type_k']}/{f['type_v']} | {f['flash_attn']} | {f['use_mmap']} | "
            f"{f['n_ubatch']} | {f['swa_full']} | {r['planned']['total_bytes'] / MIB:.1f} | "
            f"{r['peak_rss_bytes'] / MIB:.1f} | {r['total_over_peak']:.3f} | {r['naive_over_peak']:.3f} | "
            f"{comp['planned_bytes'] / MIB:.1f} / {comp['actual_bytes'] / MIB:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
