"""The typed-tasks benchmark's summary (benchmarks/tasks.py): the targets judged per model and set, the facts
plans cite (models/facts/classification.json), and the markdown the README quotes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spin-waiting threads if the machine is shared

from benchmarks.task_classify import PER_LABEL_FORMS  # noqa: E402
from benchmarks.task_inputs import CONFIGS, UNCONSTRAINED_MAX_TOKENS, VARIANTS, default_choice, default_name, set_labels  # noqa: E402


def _meets(e: dict, variant: str, config: str) -> tuple[bool, bool]:
    v, j = e["variants"][variant], e["json_route"]
    # the speed-up from the tasks/s themselves (the rounded speed-up can round 1.999 up to the target)
    return v["configs"][config]["accuracy"] >= j["accuracy"] - j["se"], v["tasks_per_s"] >= 2 * j["tasks_per_s"]


def targets(results: list[dict]) -> list[dict]:
    """Per model and set: the default against the JSON route, and calibration against none."""
    rows = []
    for r in results:
        for name, e in r["classification"].items():
            choices = {default_choice(labels) for labels in set_labels(name)}
            assert len(choices) == 1, f"the tasks of {name} get different defaults: {choices}"
            variant, config = choices.pop()
            base = config.replace("+calibrated", "")
            v, j = e["variants"][variant], e["json_route"]
            d = v["configs"][config]
            ece_raw, ece_cal = v["configs"][base]["ece"], v["configs"][base + "+calibrated"]["ece"]
            multi = v["multi_label_ece_per_label"]
            accurate, fast = _meets(e, variant, config)
            rows.append({"model": r["model"], "set": name, "items": e["items"], "config": f"{variant} {config}",
                         "accuracy": d["accuracy"], "se": d["se"], "macro_f1": d["macro_f1"],
                         "json_macro_f1": j["macro_f1"], "json_accuracy": j["accuracy"],
                         "json_se": j["se"], "accurate_enough": accurate,
                         "speedup": round(v["tasks_per_s"] / j["tasks_per_s"], 3),
                         "fast_enough": fast, "ece": ece_raw, "ece_calibrated": ece_cal,
                         "ece_halved": ece_cal <= ece_raw / 2, "multi_ece": multi["uncalibrated"],
                         "multi_ece_calibrated": multi["calibrated"],
                         "multi_ece_halved": multi["calibrated"] <= multi["uncalibrated"] / 2})
    return rows


def passing_variants(result: dict) -> list[str]:
    """The fixed variants and configurations that meet both targets on every set of one model's run."""
    sets = list(result["classification"].values())
    return [f"{v} {c}" for v in VARIANTS for c in CONFIGS if all(all(_meets(e, v, c)) for e in sets)]


def write_facts(results: list[dict]) -> None:
    """models/facts/classification.json: what plans for classification cite (nodeagent/tasks/measured_defaults.py)."""
    import datetime

    rows = targets(results)
    keep = ("set", "items", "config", "accuracy", "se", "json_accuracy", "json_se", "accurate_enough", "speedup",
            "fast_enough")
    data = {"source": "benchmarks/tasks.py (generated: do not edit)",
            "models": {r["model"]: {"measured": r.get("created", str(datetime.date.today())),
                                    "default": default_name(), "passing_variants": passing_variants(r),
                                    "sets": [{k: t[k] for k in keep} for t in rows if t["model"] == r["model"]]}
                       for r in results}}
    (ROOT / "models/facts/classification.json").write_text(json.dumps(data, indent=1) + "\n")


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def markdown(results: list[dict]) -> str:
    first = results[0]["classification"]
    sets = "; ".join(f"{name}: {e['items']} items, {e['what']}" + (f" ({e['package']}, {e['license']})"
                                                                    if "package" in e else "")
                     for name, e in first.items())
    lines = ["# Typed tasks", "", "Produced by `benchmarks/tasks.py` on this machine (CPU, llama-cpp-python); all "
             "methods of each comparison ran in the same process over the same items, alternating item by item "
             "(the order rotating), each on its own instance of the same plan (so each keeps its own KV cache "
             "and all see the same machine load).", "",
             "## Classification", "",
             f"Sets: {sets}. The public sets come from wheels on the package index, their sha256 and that of "
             "the items drawn from them checked (`benchmarks/public_sets.py`); nothing of them is committed.", "",
             "Methods: the JSON route is llama-cpp-python's chat completion with a JSON response format whose "
             "schema lists the labels (greedy), after the bare-list system prompt. Label scoring (nodeagent): the "
             "prompt's new tokens and the labels' inner trie nodes (parallel sequences over the prompt's cells) in "
             "one batch; `label` scores "
             "the bare label after the system prompt listing the labels (the JSON route's); `json` scores the "
             "label as the JSON string content that continues the JSON route's own answer prefix "
             "`{\"label\": \"` after that same prompt: what the JSON route would write (no closing quote, so "
             "no deeper a tree than the bare label's); `+descriptions` adds each label's "
             "description (written by the team); `+examples` adds one worked example per label as turns (from "
             "items not evaluated; for the project's set, written by the team). Each method's probabilities "
             "four ways from the same scores: the sum of the label's token log-probabilities or their mean "
             "(length normalisation), each uncalibrated or calibrated against the content-free inputs N/A, "
             "the empty text and [MASK] (their probabilities averaged). Tasks/s are of the task as a worker "
             "runs it, timed with calibration on for every set (its neutral passes, three per prompt and cached per "
             "prompt, included; a task that is not calibrated skips them).", "",
             f"### Targets: the default ({default_name()}) against the JSON route", "",
             "| model | set | default (as resolved) | default accuracy (SE) | JSON route accuracy (SE) | at least JSON - 1 SE "
             "| macro-F1 default / JSON route | speed-up "
             "| at least 2x | ECE uncalibrated | ECE calibrated | at most half | multi-label ECE per label, "
             "uncalibrated / calibrated | at most half |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in targets(results):
        lines.append(f"| {t['model']} | {t['set']} | {t['config']} | {t['accuracy']} ({t['se']}) | {t['json_accuracy']} "
                     f"({t['json_se']}) | {_yes(t['accurate_enough'])} | {t['macro_f1']} / {t['json_macro_f1']} | {t['speedup']}x | {_yes(t['fast_enough'])} | "
                     f"{t['ece']} | {t['ece_calibrated']} | {_yes(t['ece_halved'])} | {t['multi_ece']} / "
                     f"{t['multi_ece_calibrated']} | {_yes(t['multi_ece_halved'])} |")
    multi = [r for r in results if "multi_label" in r]
    if multi:
        m0 = multi[0]["multi_label"]
        lines += ["", "### Multi-label on texts that carry two labels", "",
                  f"{m0['texts']} texts: {m0['two_label_texts']} made of two BBC News items of different topics "
                  f"(joined), and as many single items; the default multi-label task (calibrate "
                  f"{m0['default_calibrate']}, threshold {m0['threshold_setting']}: {round(m0['threshold'], 4)}), "
                  "every (text, label) a yes/no case. "
                  "The runner's probabilities are single-label's (calibrated the same way), so they sum to 1. "
                  "Against them, on the same scores, per-label forms that do not sum to 1 (a the label's share of "
                  "the answer under the text, b under the content-free inputs, K labels): `odds_ratio` the label's "
                  "odds under the text over its odds under the content-free inputs times the odds 1 to K - 1, "
                  "a (1 - b) / (a (1 - b) + (K - 1) b (1 - a)); `share_ratio` a / (a + (K - 1) b) (the default "
                  "before this measurement); `even_odds` a / (a + b). Precision and recall: of the labels chosen "
                  "and of the texts' labels.", "",
                  "| model | probabilities | ECE per label | labels exactly right | both labels of a two-label text "
                  "| precision | recall |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in multi:
            m = r["multi_label"]
            for key in ("uncalibrated", "calibrated", *PER_LABEL_FORMS):
                f = m[key]
                lines.append(f"| {r['model']} | {key}{' (the default)' if key == 'calibrated' else ''} | "
                             f"{f['ece_per_label']} | {f['exact_match']} | {f['both_found']} | {f['precision']} | "
                             f"{f['recall']} |")
        lines += ["", "Calibrated against uncalibrated: "
                  + "; ".join(f"{r['model']} per-label ECE {r['multi_label']['uncalibrated']['ece_per_label']} -> "
                              f"{r['multi_label']['calibrated']['ece_per_label']} (at most half: "
                              f"{_yes(r['multi_label']['ece_halved'])}), {r['multi_label']['tasks_per_s']} tasks/s, "
                              f"the runner's own labels exactly right {r['multi_label']['default_exact_match']}"
                              for r in multi) + ".", "",
                  "The default probabilities at fixed thresholds (`--threshold`):", "",
                  "| model | threshold | labels exactly right | both labels of a two-label text | precision | recall |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in multi:
            for t, f in r["multi_label"]["calibrated_by_threshold"].items():
                lines.append(f"| {r['model']} | {t} | {f['exact_match']} | {f['both_found']} | {f['precision']} | "
                             f"{f['recall']} |")
    lines += ["", "### Every method: accuracy by configuration, macro-F1 and expected calibration error", "",
              "ECE: 10 equal-width bins of the top label's probability. Multi-label: each (item, label) pair a "
              "yes/no case, the label's own probability against whether it is the item's label.", ""]
    for name in first:
        lines += [f"#### {name}", "",
                  "| model | method | tasks/s | speed-up | p50 s | acc sum | acc sum, cal. | acc mean | acc mean, cal. | "
                  "macro-F1 sum, cal. | ECE sum | ECE sum, cal. | multi-label ECE unc. / cal. |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in results:
            e = r["classification"][name]
            j = e["json_route"]
            lines.append(f"| {r['model']} | JSON route | {j['tasks_per_s']} | 1x | {j['p50_s']} | {j['accuracy']} | | | | "
                         f"{j['macro_f1']} | | | |")
            for v, d in e["variants"].items():
                c = d["configs"]
                lines.append(f"| {r['model']} | {v} | {d['tasks_per_s']} | {d['speedup_vs_json_route']}x | {d['p50_s']} | "
                             f"{c['sum']['accuracy']} | {c['sum+calibrated']['accuracy']} | {c['mean']['accuracy']} | "
                             f"{c['mean+calibrated']['accuracy']} | {c['sum+calibrated']['macro_f1']} | "
                             f"{c['sum']['ece']} | {c['sum+calibrated']['ece']} | "
                             f"{d['multi_label_ece_per_label']['uncalibrated']} / "
                             f"{d['multi_label_ece_per_label']['calibrated']} |")
        lines.append("")
    lines += ["The JSON route wrote no unparsable answer" if all(e["json_route"]["invalid"] == 0 for r in results
                                                             for e in r["classification"].values())
              else "Unparsable JSON-route answers: " + ", ".join(
                  f"{r['model']} {n} {e['json_route']['invalid']}" for r in results
                  for n, e in r["classification"].items() if e["json_route"]["invalid"]),
              "; the most a method's timed probabilities differed from the same prompt scored again (llama.cpp's "
              "batches of different shapes round differently): " + ", ".join(
                  f"{r['model']} {max(d['rerun_max_abs_diff'] for e in r['classification'].values() for d in e['variants'].values())}"
                  for r in results) + "."]
    lines += ["", "Prompts (both methods, both tasks) go through the chat template nodeagent renders: "
              + "; ".join(f"{r['model']} {r.get('chat_template', 'not recorded')}" for r in results) + "."]
    lines += ["", "When each model was measured (`--models` re-runs some and keeps the others' figures): "
              + "; ".join(f"{r['model']} {r.get('created', 'date not recorded')}, "
                          f"{'commit ' + r['commit'] if 'commit' in r else 'commit not recorded'}"
                          for r in results) + "."]
    lines += ["", "1-minute load average before and after each model's run: "
              + "; ".join(f"{r['model']} {r['load_avg_1m'][0]} / {r['load_avg_1m'][1]}" for r in results
                          if "load_avg_1m" in r) + "."]
    lines += ["", "## Extraction (generated varied inputs)", ""]
    earlier = sorted({r["extraction_from"] for r in results if "extraction_from" in r})
    if earlier:
        lines += [f"From {', '.join(earlier)}: `--extract 0` ran classification only and kept these figures "
                  "(`git log benchmarks/results/tasks.json` shows the run).", ""]
    lines += [
              f"Unconstrained generation: the same prompt (schema included), greedy, at most "
              f"{UNCONSTRAINED_MAX_TOKENS} tokens, the whole output parsed as JSON and validated.", "",
              "| model | method | inputs | schema-valid | share | p50 s | p95 s | error results |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "extraction" not in r:  # `--extract 0` with no saved extraction figures for this model
            lines.append(f"| {r['model']} | not run | | | | | | |")
            continue
        for m in ("constrained", "unconstrained"):
            e = r["extraction"][m]
            errors = ", ".join(f"{k}: {v}" for k, v in e.get("errors", {}).items()) if m == "constrained" else "n/a"
            lines.append(f"| {r['model']} | {m} | {e['inputs']} | {e['schema_valid']} | {e['valid_share']} | "
                         f"{e['p50_s']} | {e['p95_s']} | {errors or 'none'} |")
    lines += ["", "A constrained task that does not finish returns an error result with no output (never a partial "
              "object); the unconstrained outputs are counted valid only when the whole text parses and validates."]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    """The commit the code under measurement is at (``+`` when the checkout has uncommitted changes)."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()
    changed = git("status", "--porcelain", "--", "nodeagent", "benchmarks/task*.py")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+" if changed else "")
