"""The tree before a change against the tree after it, on the benchmarks that touch what changed, taking turns:
each benchmark runs from a copy of each tree (its own code and its own benchmark script), before, after, after,
before, ... (ABBA, so a drift of the shared machine falls on both), and each figure is compared as the median of
its runs, with each side's spread so that what is within noise reads as such.

What it runs (``--suite``):

- ``first_token``: benchmarks/gateway.py's first-token phase (SmolLM2 streamed through `serve` and through the
  gateway to a worker, taking turns): the gateway's and serve's median time to the first content chunk;
- ``added_latency``: its added-latency phase (0 ms tasks through `serve` and the gateway);
- ``fast_forward``: benchmarks/fast_forward.py on SmolLM2 at one slot: extraction tasks/s with forced tokens and
  drafts off, forced, drafts, on; valid outputs and outputs identical to the plain decode's;
- ``tasks``: benchmarks/tasks.py on SmolLM2: constrained extraction's latency and schema-valid share, and the
  classification sets' accuracy (the same decisions are expected: a change of code, not of method);
- ``embeddings``: benchmarks/embed_throughput.py (3 rounds): all-MiniLM-L6-v2's texts/s through nodeagent in batches
  of 1, 8 and 64, its overhead over llama-cpp-python's own, and one-text tasks in flight.

Usage: python benchmarks/ab.py [--before REF] [--rounds 2] [--suite first_token,added_latency,fast_forward,tasks,embeddings]
   -> benchmarks/results/ab.json and ab.md (the tree after: this checkout's files, committed or not)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import write_results  # noqa: E402


def _first_token(d: dict) -> dict[str, float]:
    f = d["first_token"]
    return {"serve first token, ms": f["serve_ms"], "gateway first token, ms": f["gateway_ms"],
            "gateway added, ms": f["added_ms"]}


def _added(d: dict) -> dict[str, float]:
    a = d["added_latency"]
    return {"serve p50, ms": a["serve_p50_ms"], "gateway p50, ms": a["gateway_p50_ms"],
            "gateway added p50, ms": a["added_p50_ms"]}


def _fast_forward(d: dict) -> dict[str, float]:
    run = d["runs"][0]
    out: dict[str, float] = {}
    for mode in ("off", "forced", "drafts", "on"):
        out[f"{mode}: tasks/s"] = run[mode]["tasks_per_s"]
        out[f"{mode}: valid"] = run[mode]["valid"]
        out[f"{mode}: identical to off"] = run[mode]["identical_to_off"]
    return out


def _embeddings(d: dict) -> dict[str, float]:
    out = {f"batches of {o['batch']}: nodeagent texts/s": o["nodeagent_texts_per_s"] for o in d["overhead"]}
    out.update({f"batches of {o['batch']}: overhead over llama-cpp-python, %": o["overhead_pct"]
                for o in d["overhead"]})
    out["64 one-text tasks in flight: tasks/s"] = d["shared"]["in_flight_tasks_per_s"]
    return out


def _tasks(d: list) -> dict[str, float]:
    m = d[0]
    out = {"extraction p50, s": m["extraction"]["constrained"]["p50_s"],
           "extraction valid share": m["extraction"]["constrained"]["valid_share"]}
    for name, c in sorted(m["classification"].items()):
        out[f"{name}: JSON route, tasks/s"] = c["json_route"]["tasks_per_s"]
        out[f"{name}: JSON route, accuracy"] = c["json_route"]["accuracy"]
        out[f"{name}: label scoring, tasks/s"] = c["variants"]["json"]["tasks_per_s"]
        out[f"{name}: label scoring, accuracy"] = c["variants"]["json"]["configs"]["sum+calibrated"]["accuracy"]
    return out


# name -> (the benchmark's arguments, the result file it writes, what is compared)
SUITE: dict[str, tuple[list[str], str, Callable[[Any], dict[str, float]]]] = {
    "first_token": (["benchmarks/gateway.py", "--phases", "first_token", "--quick"], "gateway", _first_token),
    "added_latency": (["benchmarks/gateway.py", "--phases", "added_latency", "--quick"], "gateway", _added),
    "fast_forward": (["benchmarks/fast_forward.py", "--models", "smollm2", "--slots", "1", "--items", "8",
                      "--rounds", "1"], "fast_forward", _fast_forward),
    "tasks": (["benchmarks/tasks.py", "--models", "smollm2", "--extract", "20", "--classify", "40", "--multi",
               "0", "--out", "ab_tasks"], "ab_tasks", _tasks),
    "embeddings": (["benchmarks/embed_throughput.py", "--rounds", "3"], "embed_throughput", _embeddings),
}


def copy_of_checkout(to: Path) -> None:
    """This checkout's files as they are (tracked and untracked, less what git ignores) under ``to``."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (to / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, to / rel)


def copy_of_commit(ref: str, to: Path) -> str:
    """The tree at ``ref`` under ``to``; its commit."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", ref], capture_output=True, text=True,
                            check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(to)], input=archive, check=True)
    return commit


def run_once(tree: Path, name: str) -> dict[str, float]:
    args, result, read = SUITE[name]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} in {tree} failed:\n{done.stderr[-3000:]}")
    figures = read(json.loads((tree / "benchmarks" / "results" / f"{result}.json").read_text()))
    print(f"  {name} {tree.name}: {time.perf_counter() - started:.0f} s {figures}", file=sys.stderr, flush=True)
    return figures


def compare(runs: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """Each figure: the median of each side's runs, their spread, and after / before."""
    rows = []
    for key in runs["before"][0]:
        b = [r[key] for r in runs["before"]]
        a = [r[key] for r in runs["after"] if key in r]
        if not a:
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        rows.append({"figure": key, "before": mb, "after": ma, "before_range": [min(b), max(b)],
                     "after_range": [min(a), max(a)], "ratio": round(ma / mb, 3) if mb else None})
    return rows


def markdown(d: dict) -> str:
    lines = [f"# Before and after: {d['before']} against {d['after']}", "",
             f"{d['machine']}, {d['when']}; {d['rounds']} rounds of each, taking turns (ABBA). Each figure the "
             "median of its runs; the range, each side's lowest and highest; the ratio, after / before.", ""]
    for name, rows in d["benchmarks"].items():
        lines += [f"## {name}", "", "| figure | before | after | ratio | before: range | after: range |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['figure']} | {r['before']:g} | {r['after']:g} | "
                  f"{r['ratio'] if r['ratio'] is not None else '-'} | {r['before_range'][0]:g}-{r['before_range'][1]:g}"
                  f" | {r['after_range'][0]:g}-{r['after_range'][1]:g} |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def checkout_label() -> str:
    """The tree after, as measured: this checkout's commit, and whether tracked files differ from it."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True).stdout.strip()
    return f"{head} with uncommitted changes" if changed else head


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="HEAD", help="the commit before the change (default: HEAD)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree per benchmark")
    ap.add_argument("--suite", default=",".join(SUITE))
    ap.add_argument("--out", default="ab")
    args = ap.parse_args()
    import platform

    with tempfile.TemporaryDirectory(prefix="nodeagent-ab-") as tmp:
        before, after = Path(tmp) / "before", Path(tmp) / "after"
        before.mkdir()
        after.mkdir()
        commit = copy_of_commit(args.before, before)
        copy_of_checkout(after)
        trees = {"before": before, "after": after}
        out: dict[str, Any] = {"before": commit[:7], "after": checkout_label(), "rounds": args.rounds,
                               "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                               "when": time.strftime("%Y-%m-%d"), "benchmarks": {}}
        for name in args.suite.split(","):
            runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for i in range(args.rounds):
                order = ("before", "after") if i % 2 == 0 else ("after", "before")
                for side in order:
                    runs[side].append(run_once(trees[side], name))
            out["benchmarks"][name] = compare(runs)
    write_results(args.out, out, markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()
