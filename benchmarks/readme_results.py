"""Rewrite the README's generated figures from the code and the result files (never by hand).

Two sections of README.md are generated, each between markers:
- ``headline``: the 7B Q4_K_M header planned for three device profiles, by the node core, now;
- ``benchmarks``: the figures of benchmarks/results/*.json;
- ``devices``: the `nodeagent bench` results saved under benchmarks/results/<profile>/ (benchmarks/compare.py's
  table, the machine each came from, and the throughput, overhead and memory targets judged).

Usage: python benchmarks/readme_results.py [--check]   (--check: exit 1 if the README is not current)
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER_7B = ROOT / "tests" / "fixtures" / "deepseek-r1-distill-qwen-7b-q4_k_m.header.gguf.gz"
GIB = 1 << 30


def headline_text() -> str:
    """The 7B header planned for a 16 GB Mac, a 4 GB Pi 4 and an 8 GB Pi 5, through the node core."""
    sys.path.insert(0, str(ROOT))
    from nodeagent.config import resolve
    from nodeagent.node import Node

    with tempfile.TemporaryDirectory() as tmp:
        header = Path(tmp) / "DeepSeek-R1-Distill-Qwen-7B-Q4_K_M.gguf"
        with gzip.open(HEADER_7B) as src, open(header, "wb") as dst:
            shutil.copyfileobj(src, dst)
        plans = {p: Node(str(header), config=resolve(env={}), profile=p).plan
                 for p in ("apple-m2-pro-16gb", "rpi4-4gb", "rpi5-8gb")}
    mac, pi4, pi5 = plans.values()
    layers = mac.settings.n_gpu_layers
    where = "every layer on the GPU" if layers < 0 or layers >= 29 else f"{layers} of 29 layers on the GPU"
    pi4_text = ("fits" if pi4.fits else
                f"does not fit ({pi4.reasons[-1].split(': ', 1)[-1]})")
    pi5_text = (f"fits on the CPU in {pi5.memory.total_bytes / GIB:.2f} GiB at {pi5.settings.ctx_per_slot} tokens, "
                f"mmap {'on' if pi5.settings.use_mmap else 'off'}" if pi5.fits else "does not fit")
    return (f"The headline case, computed by the planner when this README was generated: the "
            f"DeepSeek-R1-Distill-Qwen-7B Q4_K_M header planned for `apple-m2-pro-16gb` lands at "
            f"**{mac.memory.total_bytes / GIB:.2f} GiB** with a context of {mac.settings.ctx_per_slot} tokens for each of its "
            f"{mac.settings.slots} slots and {where} "
            f"({mac.settings.n_threads} threads; the slots are the profile's); on `rpi4-4gb` it "
            f"{pi4_text}; on `rpi5-8gb` it {pi5_text}"
            + (" (its Q4_K/Q6_K weights would otherwise be resident twice)." if pi5.fits and not
               pi5.settings.use_mmap else "."))


def together_text(s: dict) -> str:
    t = s.get("together") or {}
    if not t:
        return ""
    return (f" SmolLM2 and Gemma 3 loaded together in one process, at each of the {t['cases']} contexts: x{t['min']} "
            f"to x{t['max']} of the peak ({t['within_plan_and_5pct']} of {t['cases']} within the plan and no more "
            "than 5 % under it).")


def _saved(name: str) -> dict | None:
    """A benchmark's saved results (benchmarks/results/NAME.json), or None before it has run."""
    path = ROOT / "benchmarks/results" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def scheduler_text() -> str:
    d = _saved("scheduler_sim")
    if d is None:
        return ""
    p = d["policies"]
    ours, st, gr = p["nodeagent"], p["static"], p["greedy"]
    rs = ours["round_s"]
    lower = ours["peak_backlog"] < min(st["peak_backlog"], gr["peak_backlog"])
    fewer = ours["swaps"] < gr["swaps"]
    return (f"The central scheduler ([benchmarks/results/scheduler_sim.md](benchmarks/results/scheduler_sim.md), "
            f"`python benchmarks/scheduler_sim.py`, {d['nodes']:,} simulated Pis and Macs, {len(d['models'])} models from "
            f"135M to 8B, {d['hours']:g} h of shifting demand, every fit the real planner's): peak backlog "
            f"{ours['peak_backlog']:,} tasks against {st['peak_backlog']:,} for every node keeping its first model and "
            f"{gr['peak_backlog']:,} for a greedy first-fit by free memory; {ours['swaps_per_hour']} swaps an hour "
            f"against greedy's {gr['swaps_per_hour']} (target: a lower peak than both, fewer swaps than greedy: "
            f"{'met' if lower and fewer else 'not met'}); a round over the {d['nodes']:,} nodes {rs['median']} s "
            f"median, {rs['max']} s at most (target under 1 s: {'met' if rs['max'] < 1 else 'not met'}), after a "
            f"{d['fit_table_s']} s cold fit table; {ours['rounds_over_plan']} rounds with a node over its plan and "
            f"{ours['model_rounds_uncovered']} with a waiting model that fits somewhere left unplaced."
            + throttled_text(d))


def gateway_text() -> str:
    d = _saved("gateway")
    if d is None:
        return ""
    ft, al, k = d["first_token"], d["added_latency"], d["kills"]
    eff = min(r["efficiency"] for r in d["scaling"])
    few, many = d["many_clients"]
    held = many["ok_per_s"] / few["ok_per_s"] if few["ok_per_s"] else 0.0
    fives = sum(v for c, v in many["statuses"].items() if c.startswith("5") or not c.isdigit())
    return (f"The gateway ([benchmarks/results/gateway.md](benchmarks/results/gateway.md), `python benchmarks/gateway.py`, "
            f"Redis, workers on the same 2 cores): SmolLM2's first token +{ft['added_ms']} ms through the queue "
            f"against `serve` (target within 30 ms: {'met' if ft['added_ms'] <= 30 else 'not met'}); a 0 ms task's "
            f"p50 +{al['added_p50_ms']} ms (target within 15 ms: {'met' if al['added_p50_ms'] <= 15 else 'not met'}); "
            f"scaling efficiency {eff} or more up to {d['scaling'][-1]['workers']} workers (target 0.9: "
            f"{'met' if eff >= 0.9 else 'not met'}); "
            f"{many['clients']:,} concurrent clients held {held:.0%} of the 50-client rate with {fives} 5xx "
            f"(each waiting its turn in the queue: p50 {many['p50_s']} s; the gateway at {many['gateway_rss_mb']} MiB "
            f"resident); a worker killed every 10 s for "
            f"{k['seconds']:.0f} s: {k['failed']} of {sum(k['statuses'].values())} requests failed (target 0: "
            f"{'met' if k['failed'] == 0 else 'not met'})." + _streams_text(d))


def _streams_text(d: dict) -> str:
    sk = d.get("stream_kills")
    if not sk:
        return ""
    failed = sk["whole_failed"] + sk["streams_failed"]
    return (f" Streams that survive their node (real SmolLM2 workers, six clients of which three stream, a worker "
            f"killed every {sk['every_s']:.0f} s for {sk['seconds']:.0f} s): {failed} failed requests and "
            f"{sk['streams_restarted']} streams begun again (target 0 and 0: "
            f"{'met' if failed == 0 and sk['streams_restarted'] == 0 else 'not met'}); {sk['streams_resumed']} streams "
            f"continued on another node, the gap across the move p50 {sk['resume_gap_p50_s']} s and p99 "
            f"{sk['resume_gap_p99_s']} s (lease 2 s).")


def fast_forward_text() -> str:
    d = _saved("fast_forward")
    if d is None or "bench" not in d:
        return ""
    name = lambda r: r["model"].split(".")[0].split("-Instruct")[0]  # noqa: E731
    rows = ["| model | slots | tasks/s off | forced tokens | drafts from the input | both | what the node runs here |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in d["runs"]:
        chosen = d["bench"][r["model"]]["draft_tokens"]
        runs = r["on"] if chosen else r["forced"]
        rows.append(f"| {name(r)} | {r['slots']} | {r['off']['tasks_per_s']} | x{r['forced']['speedup']} | "
                    f"x{r['drafts']['speedup']} (k={r['draft_tokens']}, {r['drafts']['acceptance'] or 0:.0%} kept) | "
                    f"x{r['on']['speedup']} | {'forced + drafts of ' + str(chosen) if chosen else 'forced only'}: "
                    f"x{runs['speedup']} |")
    one = {name(r): r for r in d["runs"] if r["slots"] == 1}
    four = [r for r in d["runs"] if r["slots"] == 4]
    big = [one[m] for m in one if not m.startswith("SmolLM2")]
    node = lambda r: r["on"] if d["bench"][r["model"]]["draft_tokens"] else r["forced"]  # noqa: E731
    met_big = all(node(r)["speedup"] >= 1.4 for r in big)
    met_small = all(node(r)["speedup"] >= 1.0 for m, r in one.items() if m.startswith("SmolLM2"))
    met_four = all(node(r)["speedup"] >= 1.0 for r in four)
    outside = [f"the {m} mode for {name(r)} at {r['slots']} slot{'s' if r['slots'] > 1 else ''} ({r[m]['fields_right']} "
               f"against {r['off']['fields_right']}, ± {r['fields_right_se']})"
               for r in d["runs"] for m in ("forced", "drafts", "on")
               if abs(r[m]["fields_right"] - r["off"]["fields_right"]) > max(r["fields_right_se"], 1)]
    valid = all(r[m]["valid"] == r["items"] for r in d["runs"] for m in ("off", "forced", "drafts", "on"))
    drafts = "; ".join(f"{name({'model': m})} {b['draft_tokens'] or 'off'} (a step of 2 tokens x"
                       f"{b['cost'][1]['relative']} one of 1)" for m, b in d["bench"].items())
    return (f"Extraction at the speed of its grammar ([benchmarks/results/fast_forward.md]"
            f"(benchmarks/results/fast_forward.md), `python benchmarks/fast_forward.py`, contact-card extractions, "
            f"the modes taking turns; on this machine, {d['machine']}): the draft length `nodeagent bench` chose: "
            f"{drafts}. What the node runs here at 1 slot, at least x1.4 on Gemma 3 and the synthetic 1B model: "
            f"{'met' if met_big else 'not met'}; SmolLM2 not slower: {'met' if met_small else 'not met'}; at 4 slots "
            f"not slower than one step a token: {'met' if met_four else 'not met'}. Every output schema-valid in every "
            f"mode: {'yes' if valid else 'no'}; fields right within one standard error of the plain decode's: "
            + (f"all but {'; '.join(outside)}" if outside else "all") + ".\n\n" + "\n".join(rows) + "\n")


def ui_text() -> str:
    d = _saved("ui_render")
    if d is None:
        return ""
    warm = max(p["warm_p50_ms"] for p in d["pages"].values())
    cold = max(p["cold_p50_ms"] for p in d["pages"].values())
    return (f"The operator's page ([benchmarks/results/ui_render.md](benchmarks/results/ui_render.md), "
            f"`python benchmarks/ui_render.py`, a store of {d['nodes']:,} nodes and {d['tasks']:,} tasks): every "
            f"page's median {warm} ms at most from the shared snapshot (target under 300 ms: "
            f"{'met' if warm < 300 else 'not met'}), {cold} ms at most for the first after it went stale (the "
            f"whole fleet read again: {d['snapshot']['warm_p50_ms']} ms of it).")


def hostile_text() -> str:
    d = _saved("hostile_bodies")
    if d is None:
        return ""
    b, n = d["before"], d["now"]
    big_b, big_n = b["uploads"][-1], n["uploads"][-1]
    return (f"Hostile bodies ([benchmarks/results/hostile_bodies.md](benchmarks/results/hostile_bodies.md), "
            f"`python benchmarks/hostile_bodies.py`, `serve` with a token, release {b['release']} and this tree in "
            f"one run): {n['flood']['connections']} connections without the token each sending 4 MiB to the open "
            f"paths grew the server by {n['flood']['grew_peak_mb']} MB at its peak, against "
            f"{b['flood']['grew_peak_mb']} MB before (target under 48 MB: "
            f"{'met' if n['flood']['grew_peak_mb'] < 48 else 'not met'}); a {big_n['megabytes']} MB batch file "
            f"uploaded on loopback in {big_n['seconds']} s ({big_n['status']}), the server growing "
            f"{big_n['grew_peak_mb']} MB at its peak, against {big_b['seconds']} s "
            f"({big_b['status']}{' ' + big_b['code'] if big_b['code'] else ''}) and {big_b['grew_peak_mb']} MB "
            f"before; while a {n['stall']['body_mb']} MB body is walked for its nesting, the longest `/healthz` "
            f"{n['stall']['longest_probe_s']} s, against {b['stall']['longest_probe_s']} s before.")


def soak_text() -> str:
    d = _saved("soak")
    if d is None:
        return ""
    parts = []
    for run in d["runs"]:
        lv = run["levels"]
        what = "keys" if run["engine"] == "redis" else "rows"
        mem = "used_memory" if run["engine"] == "redis" else "the queue's files"
        parts.append(f"{run['engine']}: {run['ok']:,} requests in {run['minutes']:g} minutes, {run['failed']} failed; "
                     f"the last third against the middle third: {lv['keys']['last']:,.0f} {what} "
                     f"({lv['keys']['growth']:+.1%}), {mem} {lv['broker_mib']['last']:.1f} MiB "
                     f"({lv['broker_mib']['growth']:+.1%}), the gateway {lv['gateway_rss_mib']['last']:.0f} MiB "
                     f"({lv['gateway_rss_mib']['growth']:+.1%}), while the requests served grew "
                     f"{lv['requests']['growth']:+.0%}")
    level = all(run["levels"][k]["level"] for run in d["runs"]
                for k in ("keys", "broker_mib", "gateway_rss_mib", "worker_rss_mib"))
    return (f"A fleet over months ([benchmarks/results/soak.md](benchmarks/results/soak.md), "
            f"`python benchmarks/soak.py`, a gateway, two fake workers and an embedding worker at steady mixed load, "
            f"embeddings and 300 KB Responses bodies among it, results and responses kept 30 s so that a week of "
            f"turnover fits in minutes): {'; '.join(parts)}. Everything levels off "
            f"(within 10 %): {'met' if level else 'not met'}.")


def embeddings_text() -> str:
    """Classification by embeddings against label scoring, and embedding throughput against llama-cpp-python."""
    d, t = _saved("embed_classify"), _saved("embed_throughput")
    if d is None:
        return ""
    parts, met_acc, met_speed = [], [], []
    for name in d["sets"]:
        row = {k: v for k, v in d["table"][name].items() if "accuracy" in v}
        llm = {k: v for k, v in row.items() if k.startswith("label scoring")}
        emb = {k: v for k, v in row.items() if k.startswith("embeddings")}
        best_llm = max(llm, key=lambda k: llm[k]["accuracy"])
        best_emb = max(emb, key=lambda k: emb[k]["accuracy"])
        smol = llm.get("label scoring, smollm2")
        e, b = emb[best_emb], llm[best_llm]
        met_acc.append(e["accuracy"] >= b["accuracy"] - (b["se"] or 0))
        speed = e["tasks_per_s"] / smol["tasks_per_s"] if smol else None
        met_speed.append(speed is not None and speed >= 10)
        parts.append(f"{name}: {best_emb.removeprefix('embeddings, ')} {e['accuracy']:.3f} ± {e['se'] or 0:.3f} "
                     f"against {best_llm.removeprefix('label scoring, ')}'s label scoring {b['accuracy']:.3f} ± "
                     f"{b['se']:.3f}" + (f", x{speed:.0f} its tasks/s" if speed else ""))
    st = d["embeddings"]["study"]
    text = ("Classification by embeddings "
            "([benchmarks/results/embed_classify.md](benchmarks/results/embed_classify.md), "
            f"`python benchmarks/embed_classify.py`, all-MiniLM-L6-v2 F32 zero-shot and with 2-16 examples a label "
            f"against label scoring on SmolLM2 and Gemma 3, through the node, the best route of each kind): "
            f"{'; '.join(parts)}. The best embedding route at or above the best label scoring less one SE: "
            f"{sum(met_acc)} of {len(met_acc)} sets; at x10 SmolLM2's tasks/s or more: {sum(met_speed)} of "
            f"{len(met_speed)}. Label template and temperature as measured: {st['best_template']}, "
            f"{st['best_temperature']:g}.")
    if t is not None:
        worst = max(r["overhead_pct"] for r in t["overhead"])
        sh = t["shared"]
        text += ("\nEmbedding throughput "
                 "([benchmarks/results/embed_throughput.md](benchmarks/results/embed_throughput.md), "
                 f"`python benchmarks/embed_throughput.py`, {t['model']}, against llama-cpp-python's `embed` on the "
                 f"same file and settings, taking turns): " + ", ".join(
                     f"batches of {r['batch']} {r['nodeagent_texts_per_s']} texts/s against "
                     f"{r['llama_cpp_python_texts_per_s']} ({r['overhead_pct']:+.1f} %)" for r in t["overhead"])
                 + f" (target: overhead 5 % or less: {'met' if worst <= 5 else 'not met'}); {sh['tasks']} tasks of "
                 f"one text from {sh['threads']} threads at once x{sh['gain']} the tasks/s of one at a time "
                 f"({sh['forward_batches']} forward batches).")
        if t.get("overhead_one_process"):
            text += (" In one process on the node's own context: " + ", ".join(
                f"batches of {r['batch']} {r['overhead_pct']:+.1f} %" for r in t["overhead_one_process"]) + ".")
    routes = _saved("classify_routes")
    if routes is not None:
        rows = [(name, shots, row) for name, by in routes["table"].items() for shots, row in by.items()]
        met = sum(row["within_one_se"] for _, _, row in rows)
        missed = [f"{name} at {shots} a label (unnamed {row['unnamed']['accuracy']:.3f} against "
                  f"{max(row['embeddings']['accuracy'], row['label scoring']['accuracy']):.3f})"
                  for name, shots, row in rows if not row["within_one_se"]]
        text += ("\nThe unnamed classify route "
                 "([benchmarks/results/classify_routes.md](benchmarks/results/classify_routes.md), "
                 f"`python benchmarks/classify_routes.py`, all-MiniLM-L6-v2 and SmolLM2 in one model set, "
                 f"up to {routes['items']} items a set, 0-16 examples a label, the route measured on the task's examples): "
                 f"within one SE of the better single route in {met} of {len(rows)} rows"
                 + (f"; not in {', '.join(missed)}" if missed else "") + ".")
    return text


def warm_prefixes_text() -> str:
    """The first task after a restart, a swap and on a fresh slot against a warm one, the prefix kept on disk."""
    d = _saved("warm_prefixes")
    if d is None:
        return ""
    rows = d["rows"]
    worst = max(max(r["swap_x_warm"], r["restart_x_warm"]) for r in rows)
    same = all(all(r["same_output"].values()) and r["restored_both"] for r in rows)
    return ("Warm prefixes on disk ([benchmarks/results/warm_prefixes.md](benchmarks/results/warm_prefixes.md), "
            "`python benchmarks/warm_prefixes.py`, an extraction whose instructions are the prefix): " + "; ".join(
                f"{r['model']} {r['prompt_tokens']} tokens: fresh x{r['fresh_x_warm']}, after a swap "
                f"x{r['swap_x_warm']}, after a restart x{r['restart_x_warm']} a warm task's time "
                f"({r['state_bytes'] / 1e6:.1f} MB stored)" for r in rows)
            + f" (target: after a swap or a restart x1.2 or less: {'met' if worst <= 1.2 else 'not met'}); the "
            f"answers after a restore the same as the warm ones token for token: {'yes' if same else 'no'}.")


def warm_affinity_text() -> str:
    """The fleet simulation: the share of tasks landing warm and their wait, without and with the preference."""
    d = _saved("warm_affinity")
    if d is None:
        return ""
    by_rate: dict[float, list[dict]] = {}
    for r in d["runs"]:
        by_rate.setdefault(r["rate_per_s"], []).append(r)
    parts = []
    for rate, runs in sorted(by_rate.items()):
        off = next(r for r in runs if r["bound_s"] == 0)
        parts.append(f"at {rate} tasks/s, without it {off['warm_share']:.0%} warm (wait p95 {off['wait_p95_s']} s), "
                     + ", ".join(f"with a {r['bound_s']:g} s bound {r['warm_share']:.0%} (p95 {r['wait_p95_s']} s)"
                                 for r in runs if r["bound_s"]))
    return ("Warm affinity, simulated ([benchmarks/results/warm_affinity.md](benchmarks/results/warm_affinity.md), "
            f"`python benchmarks/warm_affinity.py`, 4 nodes, 20 prefixes, a task {d['warm_s']} s warm and "
            f"{d['fresh_s']} s fresh as measured for the synthetic 1B): " + "; ".join(parts) + ".")


def throttled_text(d: dict) -> str:
    """The scheduler with part of the fleet throttled: the backlog with and without derating."""
    th, ours, blind = d.get("throttled"), d["policies"]["nodeagent"], d["policies"].get("nodeagent (no derating)")
    if not th or not blind:
        return ""
    return (f" With {th['throttled']} of the {th['pis']} Pis throttled to {th['clock_ratio']:.0%} of their clock, "
            f"derating their throughput by it: peak backlog {ours['peak_backlog']:,} (mean {ours['mean_backlog']:,}) "
            f"against {blind['peak_backlog']:,} (mean {blind['mean_backlog']:,}) blind to it.")


def benchmarks_text() -> str:
    d = json.loads((ROOT / "benchmarks/results/memory_accuracy.json").read_text())
    s = d["summary"]
    t = json.loads((ROOT / "benchmarks/results/tasks.json").read_text())
    comp = s["components"]
    cls_lines = [f"- {r['model']}: extraction {r['extraction']['constrained']['schema_valid']}/"
                 f"{r['extraction']['constrained']['inputs']} schema-valid with constrained decoding vs "
                 f"{r['extraction']['unconstrained']['schema_valid']}/{r['extraction']['unconstrained']['inputs']} "
                 "unconstrained." for r in t]
    if s["cases"] == s["matrix_cases"]:
        ran = f"all {s['cases']} cases of the matrix ran"
    else:
        ran = f"{s['cases']} of the {s['matrix_cases']} cases of the matrix have run (`--resume` runs the rest)"
    bad = {k: v["cases"] - v["within_target"] for k, v in comp.items() if v["within_target"] < v["cases"]}
    within = ("every case is within target for every component" if not bad else
              "components outside target: " + ", ".join(f"{k} in {n} cases" for k, n in bad.items()))
    n_below = s["planned_over_peak"]["below_peak_by_more_than_2pct"]
    below = "never more than 2 % below" if n_below == 0 else f"more than 2 % below it in {n_below} cases"
    errs = {r["model"]: r["extraction"]["constrained"].get("errors", {}) for r in t}
    unfinished = "".join(f" {m}: {', '.join(f'{n} {k}' for k, n in e.items())} among the constrained extractions "
                         f"(error results with no output; see tasks.md)." for m, e in errs.items() if e)
    classification = classification_text(t)
    extraction = extraction_accuracy_text()
    classification += ("\n" + extraction) if extraction else ""
    queue = queue_text()
    return f"""Memory planner ([benchmarks/results/memory_accuracy.md](benchmarks/results/memory_accuracy.md),
`python benchmarks/memory_accuracy.py [--resume]`): {ran}. Against the buffers llama.cpp
reports, {within} (largest errors: weights
{comp['weights_mapped_bytes']['max_abs_error_pct']} % / {comp['weights_anon_bytes']['max_abs_error_pct']} %,
KV {comp['kv_bytes']['max_abs_error_pct']} %, output within 1 MiB, compute
{comp['compute_bytes']['max_abs_error_pct']} %). The planned total over the peak RSS after a classification, an
extraction and filling the context: {s['planned_over_peak']['min']} to {s['planned_over_peak']['max']} (median
{s['planned_over_peak']['median']}), {below}.{together_text(s)} The naive rule "file size + f16 KV", in the same run: {s['naive_over_peak']['min']}
to {s['naive_over_peak']['max']} of the peak (median {s['naive_over_peak']['median']}), more than 2 % below it in
{s['naive_over_peak']['below_peak_by_more_than_2pct']} cases.

Typed tasks ([benchmarks/results/tasks.md](benchmarks/results/tasks.md), `python benchmarks/tasks.py`):
""" + "\n".join(cls_lines) + f"""{unfinished}

{classification}
{queue}"""


def extraction_accuracy_text() -> str:
    """The default extraction against the hand-written route, per model and set (extract_quality.json)."""
    d = _saved("extract_quality")
    if d is None:
        return ""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchmarks.extract_quality import default_variant, targets

    default = default_variant()
    rows = ["| model | set | default | hand-written | tasks/s | schema-valid | ECE | best variant with an example |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    met = []
    for m in d["models"]:
        if m.get("speed_only"):  # the synthetic model: its values are noise
            continue
        for name, sides in m["sets"].items():
            if default not in sides:
                continue
            t, s = targets(sides, default), sides[default]
            met.append(t["accurate_enough"] and t["fast_enough"] and t["all_valid"])
            ex = max((v for v in sides if "example" in v), key=lambda v: sides[v]["field_accuracy"], default=None)
            cal = s.get("calibration", {}).get("ece")
            rows.append(f"| {m['model'].split('.')[0]} | {name} | {t['accuracy']:.3f} ± {t['se']:.3f} | "
                        f"{t['reference_accuracy']:.3f} ± {t['reference_se']:.3f} | x{t['speedup']} | "
                        f"{s['valid']}/{s['items']} | {'' if cal is None else f'{cal:.3f}'} | "
                        + (f"{ex}: {sides[ex]['field_accuracy']:.3f}" if ex else "") + " |")
    if not met:
        return ""
    verdict = ("met on every model and set" if all(met) else
               f"met on {sum(met)} of {len(met)} model-set pairs (the results file says where and by how much)")
    return (f"Extraction accuracy ([benchmarks/results/extract_quality.md](benchmarks/results/extract_quality.md), "
            f"`python benchmarks/extract_quality.py`, {d['items']} labelled items a set, field accuracy ± one "
            f"standard error): the default (`{default}`) against llama-cpp-python's `json_object` route with the "
            f"schema, the same model file, taking turns. Targets (at least its accuracy plus one standard error, at "
            f"least x2 its tasks/s, every output schema-valid): {verdict}. ECE: the calibration of "
            f"`Result.field_logprobs`.\n\n" + "\n".join(rows) + "\n")


def classification_text(t: list[dict]) -> str:
    """Classification's targets, from benchmarks/tasks.py's results: the default against the JSON route."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.task_inputs import default_name
    from benchmarks.task_report import targets

    rows = targets(t)
    lines = [f"Classification (the default: {default_name()}; model / set, as resolved: accuracy (SE) against "
             "the JSON route's, speed-up, top-label ECE uncalibrated -> calibrated):"]
    for x in rows:
        lines.append(f"- {x['model']} / {x['set']} ({x['items']} items, {x['config']}): {x['accuracy']} ({x['se']}) vs "
                     f"{x['json_accuracy']} ({x['json_se']}), {x['speedup']}x, ECE {x['ece']} -> {x['ece_calibrated']}")
    n = len(rows)
    acc, fast = sum(x["accurate_enough"] for x in rows), sum(x["fast_enough"] for x in rows)
    ece, multi = sum(x["ece_halved"] for x in rows), sum(x["multi_ece_halved"] for x in rows)
    lines.append(f"At least the JSON route's accuracy less one SE on {acc} of {n} model/set pairs; at least 2x its "
                 f"tasks/s on {fast} of {n}; calibration at least halves the top label's ECE on {ece} of {n}, and "
                 f"the multi-label per-label ECE on {multi} of {n} (single-label sets).")
    pairs = [r for r in t if "multi_label" in r]
    if pairs:
        m0 = pairs[0]["multi_label"]
        lines.append(f"Multi-label on {m0['texts']} texts, {m0['two_label_texts']} of them two BBC News items of "
                     "different topics joined (per-label ECE uncalibrated -> calibrated; both labels of a two-label "
                     "text found at the default threshold, " + str(m0["threshold_setting"])
                     + f" ({round(m0['threshold'], 4)})): " + "; ".join(
                         f"{r['model']} {r['multi_label']['uncalibrated']['ece_per_label']} -> "
                         f"{r['multi_label']['calibrated']['ece_per_label']} (at most half: "
                         f"{'yes' if r['multi_label']['ece_halved'] else 'no'}), "
                         f"{r['multi_label']['calibrated']['both_found']}" for r in pairs) + ".")
    return "\n".join(lines)


def failover_text(wait: dict | None) -> list[str]:
    """What NODEAGENT_REDIS_MIN_REPLICAS=1 costs (queue.json's ``wait``), and the queue and the gateway across a
    failover of the broker (failover.json)."""
    out = []
    if wait:
        out.append(f"Acknowledged means replicated (`NODEAGENT_REDIS_MIN_REPLICAS=1`, `WAIT` after each reported "
                   f"write, a replica on loopback, same run): a submit +{wait['submit_added_ms']} ms at the median, "
                   f"{wait['workers']} workers' throughput x{wait['throughput_ratio']}.")
    d = _saved("failover")
    if d:
        by = {(r["min_replicas"], r["lag_s"]): r for r in d["runs"]}
        lagged = {m: by.get((m, max(k[1] for k in by))) for m in (0, 1)}
        g = d["gateway"]
        out.append(
            f"The broker's host killed ([benchmarks/results/failover.md](benchmarks/results/failover.md), "
            f"`python benchmarks/failover.py`, a primary, one replica and three Sentinels on loopback, "
            f"{lagged[1]['tasks']} tasks at {lagged[1]['rate_per_s']:g}/s, the replica lagging "
            f"{lagged[1]['lag_s']:g} s before the primary's SIGKILL): min replicas 1: {lagged[1]['lost']} lost, "
            f"{lagged[1]['done']} done once, {lagged[1]['two_tasks_for_a_key']} keys with two tasks, submits going "
            f"through again {lagged[1]['resume_submit_s']} s after the kill; min replicas 0: {lagged[0]['lost']} "
            f"lost (acknowledged, then gone with the primary). The gateway on the same kind of fleet, "
            f"{g['clients']} clients for {g['seconds']:g} s, the primary killed once: {g['ok']} ok, {g['retried']} "
            f"ok after a retry, {g['failed']} failed, {g['hung']} hung (the longest {g['longest_s']} s).")
    return out


def queue_text() -> str:
    """The queue, contention, schema and HTTP benchmarks, when their result files exist."""
    out = []
    qpath = ROOT / "benchmarks/results/queue.json"
    if qpath.exists():
        q = json.loads(qpath.read_text())
        rows = q["rows"]

        def best(system: str, engine: str, ms: int) -> dict:
            return max((r for r in rows if (r["system"], r["engine"], r["task_ms"]) == (system, engine, ms)),
                       key=lambda r: r["tasks_per_s"])

        def at(system: str, engine: str, ms: int, n: int) -> dict:
            return next(r for r in rows if (r["system"], r["engine"], r["task_ms"], r["workers"]) ==
                        (system, engine, ms, n))

        s, r, rq = best("nodeagent", "sqlite", 0), best("nodeagent", "redis", 0), best("rq", "redis", 0)
        n_max = max(x["workers"] for x in rows)
        eff = {e: at("nodeagent", e, 100, n_max)["scaling_efficiency"] for e in ("sqlite", "redis")}
        lat = {e: at("nodeagent", e, 0, 1)["latency"] for e in ("sqlite", "redis")}
        out.append(
            f"\nQueue ([benchmarks/results/queue.md](benchmarks/results/queue.md), `python benchmarks/fleet_queue.py`, "
            f"fake backend, worker processes on the same {q['cpus']} cores as Redis and the producer): 0 ms tasks "
            f"end to end, best of 1-{n_max} workers: SQLite {s['tasks_per_s']} tasks/s ({s['workers']} "
            f"worker{'s' if s['workers'] > 1 else ''}; target 1,000: {'met' if s['tasks_per_s'] >= 1000 else 'not met'}), "
            f"Redis {r['tasks_per_s']} ({r['workers']}; target 2,000: "
            f"{'met' if r['tasks_per_s'] >= 2000 else 'not met'}), RQ on the same Redis {rq['tasks_per_s']} "
            f"({rq['workers']}): nodeagent/RQ {r['tasks_per_s'] / rq['tasks_per_s']:.2f}x. Dispatch latency with "
            f"one idle worker, p50/p99: SQLite {lat['sqlite']['p50_ms']}/{lat['sqlite']['p99_ms']} ms (polling), "
            f"Redis {lat['redis']['p50_ms']}/{lat['redis']['p99_ms']} ms (blocking read). 100 ms tasks at "
            f"{n_max} workers: scaling efficiency {eff['sqlite']} (SQLite) and {eff['redis']} (Redis); target 0.9: "
            f"{'met' if min(eff.values()) >= 0.9 else 'not met'}.")
    out += failover_text(q.get("wait") if qpath.exists() else None)
    cpath = ROOT / "benchmarks/results/contention.json"
    if cpath.exists():
        c = json.loads(cpath.read_text())
        v = c["variants"]
        rows = "; ".join(f"{name} {r['quiet_tasks_per_s']} / {r['contended_tasks_per_s']} (x{r['contention_slowdown']}"
                         f" slower contended{', quiet ' + format(0.0 - 100 * r['quiet_cost'], '+.1f') + ' %' if name != 'default' else ''})"
                         for name, r in v.items())
        out.append(f"A worker beside a busy core ([benchmarks/results/contention.md](benchmarks/results/contention.md), "
                   f"`python benchmarks/contention.py`, {c['model']} on {c['threads']} threads, one other process "
                   f"spinning on one core), tasks/s quiet / contended: {rows}. The pick, the fastest under "
                   f"contention of those costing at most 3 % when quiet: {c['pick']}, "
                   f"x{c['pick_slowdown_under_contention']} slower under contention (target at most 2x: "
                   f"{'met' if c['target_met'] else 'not met'}).")
    xpath = ROOT / "benchmarks/results/extract_schemas.json"
    if xpath.exists():
        xdata = json.loads(xpath.read_text())
        x = xdata["summary"]
        out.append(f"Real-world schemas ([benchmarks/results/extract_schemas.md](benchmarks/results/extract_schemas.md), "
                   f"`python benchmarks/extract_schemas.py` over `scripts/schema-corpus`): of {x['schemas']:,} schemas "
                   f"({', '.join(f'{k} {v}' for k, v in x['by_source'].items())}), the extract.v1 contract accepts "
                   f"{100 * x['contract_rate']:.1f} % and llguidance alone compiles {100 * x['llguidance_rate']:.1f} %; "
                   f"of those llguidance compiles, the contract accepts {100 * x['accepted_of_llguidance']:.1f} % "
                   f"(target 97 %)." + "".join(
                       f" Through {m}, {r['schemas']} sampled schemas: {r['ok']} ok, errors "
                       f"{', '.join(f'{k} {v}' for k, v in r['errors'].items()) or 'none'}, invalid outputs passed "
                       f"as ok {r['invalid_as_ok']}." for m, r in xdata.get("runs", {}).items()))
    spath = ROOT / "benchmarks/results/serve.json"
    if spath.exists():
        v = json.loads(spath.read_text())
        out.append(f"HTTP ([benchmarks/results/serve.md](benchmarks/results/serve.md), `python benchmarks/serve.py`): "
                   f"`/v1/classify` over a real server p50 {v['http']['p50_ms']} ms against {v['core']['p50_ms']} ms "
                   f"calling the core in-process, same model, taking turns over {v['items']} requests: HTTP adds "
                   f"{100 * v['http_overhead_p50']:.1f} % (target: under 5 %: "
                   f"{'met' if v['http_overhead_p50'] < 0.05 else 'not met'}).")
    tpath = ROOT / "benchmarks/results/tools.json"
    if tpath.exists():
        t = json.loads(tpath.read_text())
        s = t["summary"]

        def share(key: str) -> str:
            return f"{s[key]['valid']}/{s[key]['calls']}"

        ins = t["instructor"]
        met = all(s[f"nodeagent/{m}"]["valid"] == s[f"nodeagent/{m}"]["calls"] for m in ("required", "named"))
        out.append(f"<a id=\"tool-calls-measured\"></a>Tool calls ([benchmarks/results/tools.md](benchmarks/results/tools.md), "
                   f"`python benchmarks/tools.py`, {t['model']}, {t['calls_per_side']} calls a side over 12 tools, "
                   f"temperature 0.7, no max_tokens): valid against their function's schema through nodeagent "
                   f"{share('nodeagent/required')} with `required` and {share('nodeagent/named')} named (target "
                   f"100 %: {'met' if met else 'not met'}); llama-cpp-python's own chatml-function-calling handler, "
                   f"same requests, same run: {share('llama-cpp-python/required')} and "
                   f"{share('llama-cpp-python/named')}. instructor on the same server, {ins['TOOLS']['items']} texts: "
                   f"TOOLS {ins['TOOLS']['valid']} schema-valid ({ins['TOOLS']['exact']} exactly right), JSON_SCHEMA "
                   f"{ins['JSON_SCHEMA']['valid']} ({ins['JSON_SCHEMA']['exact']}) (target TOOLS as valid as "
                   f"JSON_SCHEMA: {'met' if ins['TOOLS']['valid'] >= ins['JSON_SCHEMA']['valid'] else 'not met'}).")
    bpath = ROOT / "benchmarks/results/batch.json"
    if bpath.exists():
        b = json.loads(bpath.read_text())
        e = b["summary"]
        met = all(v["ratio"] <= 1.05 for v in e.values())
        fast = all(v["download_s_max"] < 1 for v in e.values())
        out.append(f"<a id=\"batches-measured\"></a>Batches ([benchmarks/results/batch.md](benchmarks/results/batch.md), "
                   f"`python benchmarks/batch.py`, {b['lines']:,} classify lines, {b['workers']} workers, fake backend "
                   f"50 ms, {b['rounds']} rounds taking turns): upload to the last result x{e['sqlite']['ratio']:.3f} "
                   f"the time of `Client.map` on SQLite and x{e['redis']['ratio']:.3f} on Redis (target within 5 %: "
                   f"{'met' if met else 'not met'}); the output file downloaded in "
                   f"{max(v['download_s_max'] for v in e.values()):.2f} s at most (target under 1 s: "
                   f"{'met' if fast else 'not met'}).")
    mpath = ROOT / "benchmarks/results/multi_model.json"
    if mpath.exists():
        m = {p["phase"]: p for p in json.loads(mpath.read_text())["phases"]}
        t, sw, tp, fr = m["memory-together"], m["swaps"], m["throughput"], m["first-result"]["models"]
        under = t["peak_bytes"] / t["planned_bytes"]
        first = "; ".join(f"{k} {v['not_loaded_s']:.3f} s not loaded, {v['loaded_s']:.3f} s loaded"
                          for k, v in fr.items())
        out.append(f"Two models on one node ([benchmarks/results/multi_model.md](benchmarks/results/multi_model.md), "
                   f"`python benchmarks/multi_model.py`, SmolLM2 and Gemma 3 at ctx 2048): loaded together the peak "
                   f"is {100 * (1 - under):.1f} % under the set's plan (x{t['ratio']:.3f}; alone in the same run "
                   f"x{m['memory-0']['ratio']:.3f} and x{m['memory-1']['ratio']:.3f}; target: within the plan and no "
                   f"more than 5 % under it: {'met' if 0.95 <= under <= 1 else 'not met'}). With a budget for one, "
                   f"{sw['tasks']} alternating tasks made {sw['loads']} loads, the peak x{sw['peak_over_single_plan']:.3f} "
                   f"the larger single plan, {sw['labels_same_as_without_swaps']}/{sw['tasks']} labels the same as "
                   f"without swaps ({m['swaps-deterministic']['labels_same_as_without_swaps']}/{sw['tasks']} under "
                   f"NODEAGENT_DETERMINISTIC). First result: {first}. {tp['tasks']} alternating classifications with both "
                   f"loaded: x{tp['ratio']:.3f} the time of two plain nodes (target within 5 %: "
                   f"{'met' if tp['ratio'] <= 1.05 else 'not met'}).")
    out += [text for text in (scheduler_text(), fast_forward_text(), gateway_text(), ui_text(), hostile_text(),
                              soak_text(), embeddings_text(), warm_prefixes_text(), warm_affinity_text()) if text]
    return "\n".join(out)


def devices_text() -> str:
    from benchmarks.compare import results, table

    found = results([ROOT / "benchmarks" / "results"])
    if not found:
        return "No `nodeagent bench` results are saved yet: run `python benchmarks/device.py`."
    out = [table(found)]
    for r in found:
        p, name = r["probe"], Path(r["model_file"]).name
        by = {s["slots"]: s for s in r["slots"]}
        most = by[max(by)]
        ext = [s["tasks"]["extract"] for s in r["slots"]]
        valid, total = sum(e["valid"] for e in ext), sum(e["tasks"] for e in ext)
        overhead = (r["overhead"]["ratio"] - 1) * 100
        ceilings = {b["sequences"]: b["speedup"] for b in r.get("batch_scaling", [])}
        ratios = ", ".join(f"{s['memory']['planned_over_peak']} at {s['slots']}" for s in r["slots"])
        gains = []
        for n in sorted(by)[1:]:
            got, top = by[n]["speedup"]["extract"], ceilings.get(n)
            target = (f"target 2x or 90 % of llama.cpp's x{top}" if n == 4 and top and top < 2.2 else
                      "target 2x" if n == 4 else f"target 90 % of llama.cpp's x{top}" if n == 8 and top else None)
            met = (got >= 2 or (top is not None and top < 2.2 and got >= 0.9 * top)) if n == 4 else \
                (top is not None and got >= 0.9 * top) if n == 8 else None
            share = f", {round(100 * got / top)} % of llama.cpp's x{top}" if top else ""
            gains.append(f"x{got} at {n} slots{share}" + (f" ({target}: {'met' if met else 'not met'})"
                                                         if target else ""))
        rec = r.get("recommendation")
        prompt = r["slots"][0]["tasks"]["extract"].get("prompt_tokens")
        out.append(f"- `{r['profile']}`, {name}: measured {r['created'][:10]} on {p.get('cpu_model') or '?'} "
                   f"({p['cores_logical']} logical cores, {p['ram_total_bytes'] / GIB:.1f} GiB RAM), "
                   f"{'quick' if r['quick'] else 'full'} run. Extraction tasks per minute over 1 slot: "
                   + "; ".join(gains)
                   + (f" (llama.cpp's gain measured with {prompt}-token prompts, as the extractions')" if prompt
                      else "")
                   + f". {valid}/{total} extractions schema-valid; single-task overhead against llama-cpp-python "
                   f"{overhead:+.1f} % (target within 3 %: {'met' if overhead <= 3 else 'not met'}); planned over "
                   f"peak memory {ratios} slots (target at {most['slots']} slots, never more than 2 % below: "
                   f"{'met' if most['memory']['planned_over_peak'] >= 0.98 else 'not met'})"
                   + (f"; recommended: {rec['reason']}" if rec else "")
                   + (f"; {r['drafts']['reason']}" if r.get("drafts") else "") + ".")
    return "\n".join(out)


SECTIONS = {"headline": headline_text, "benchmarks": benchmarks_text, "devices": devices_text}


def render(readme: str) -> str:
    for name, make in SECTIONS.items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- /generated:{name} -->)", re.S)
        if not pattern.search(readme):
            raise SystemExit(f"README.md has no generated:{name} section")
        text = make()
        readme = pattern.sub(lambda m: m.group(1) + text + "\n" + m.group(2), readme)
    return readme


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="Exit 1 when the README's generated sections are stale")
    args = ap.parse_args()
    path = ROOT / "README.md"
    current = path.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("README.md is stale: run python benchmarks/readme_results.py", file=sys.stderr)
            sys.exit(1)
        return
    path.write_text(fresh)


if __name__ == "__main__":
    main()
