"""Extraction accuracy against the truth: nodeagent's extraction in each prompt form against the route a user
would write by hand, on labelled sets (``benchmarks/extract_sets.py``: contact details and orders, with values
that are spans of the text and values that are not), in one run, taking turns item by item.

- **nodeagent**: ``Node.run(ExtractTask(...))`` with each prompt form (``ExtractTask.prompt``): ``schema`` (the
  JSON Schema in the system prompt), ``fields`` (a line per field: type, enum values, description, "null if not
  stated"), ``none`` (the instruction alone: the grammar holds the shape), and ``fields+example`` (``fields`` with
  one worked example as turns, from an item outside the measured ones); ``+copy`` adds copy ``auto`` (span fields
  must be spans of the input: ``nodeagent/tasks/copying.py``). Greedy, the node's defaults otherwise (drafts from
  the input as the node's plan sets them; the drafted tokens the model kept are counted).
- **the hand-written route**: llama-cpp-python's ``create_chat_completion`` with
  ``response_format={"type": "json_object", "schema": ...}``, a one-line system instruction, temperature 0, the
  same model file and thread count.

Measures per model, set and side: field accuracy (exact after ``extract_sets.normalise``: case, accents, outer
punctuation, a phone's digits, numbers as floats) with its standard error over the item-fields, span fields and
other fields apart, items wholly right, schema-valid share, tasks/s (each extraction alone, as a caller waits).

Usage: python benchmarks/extract_quality.py [--models smollm2,gemma,synthetic] [--sets contacts,orders] [--items 120]
       [--forms schema,fields,none,none+copy,...] [--add] [--render]
   -> benchmarks/results/extract_quality.{json,md}, models/facts/extraction.json (what plans cite)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import extract_sets as sets  # noqa: E402

from benchmarks.results_io import read_results, write_results  # noqa: E402
from benchmarks.stats import accuracy_se, expected_calibration_error  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma-3-270m-it"}
REFERENCE_SYSTEM = "Extract the requested fields from the user's text as JSON."
CTX = 2048


def variant_node(path: str, threads: int, variant: str):
    """A node for one variant, so each keeps its own prompt's cells from item to item as a worker serving one
    kind of task does (the sides share the machine, not a KV cache). ``variant``: a prompt form, with
    ``+example`` (one worked example as turns), ``+copy`` (copy ``auto``) and ``+drafts`` (drafts from the input,
    up to 4 tokens a step)."""
    from nodeagent.config import resolve
    from nodeagent.node import Node

    env = {"NODEAGENT_THREADS": str(threads)}
    if "drafts" in variant.split("+")[1:]:
        env["NODEAGENT_DRAFT_TOKENS"] = "4"
    node = Node(path, config=resolve(env=env), task="extract", ctx_tokens=CTX, slots=1)
    node.load()
    return node


def node_run(node, text: str, schema: dict, variant: str, example: dict | None) -> dict:
    """One extraction: the output (None unless valid), whether it is valid, the drafted tokens the model kept,
    the error's code and each field's mean chosen-token log-probability."""
    from nodeagent.tasks.contracts import ExtractTask

    form, *flags = variant.split("+")
    examples = [{"text": example["text"], "output": example["truth"]}] if "example" in flags else []
    runner = node.runner()
    kept = sum(k for _, k in runner.drafts)
    task = ExtractTask(input=text, schema=schema, prompt=form, examples=examples,
                       copy="auto" if "copy" in flags else "none")
    r = node.run(task)
    return {"output": r.output if r.status == "ok" else None, "valid": r.status == "ok",
            "kept": sum(k for _, k in runner.drafts) - kept, "error": r.error.code if r.error else None,
            "logprobs": r.field_logprobs or {}, "tokens": r.tokens.generated}


def reference_side(path: str, threads: int):
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=CTX, n_threads=threads, verbose=False)

    def run(text: str, schema: dict) -> tuple[dict | None, bool, int]:
        """The output (None unless it parses), whether it validates, the tokens generated."""
        from nodeagent.tasks.schema import validate_output

        out = llm.create_chat_completion(messages=[{"role": "system", "content": REFERENCE_SYSTEM},
                                                   {"role": "user", "content": text}],
                                         response_format={"type": "json_object", "schema": schema},
                                         temperature=0.0, max_tokens=400)
        tokens = out["usage"]["completion_tokens"]
        try:
            value = json.loads(out["choices"][0]["message"]["content"])
        except (ValueError, TypeError):
            return None, False, tokens
        return value, validate_output(schema, value) is None, tokens

    return llm, run


def score(name: str, rows: list[dict]) -> dict:
    fields = list(sets.SCHEMAS[name]["properties"])
    spans = set(sets.SPANS[name])
    right = [[sets.right(f, r["output"], r["truth"]) for f in fields] for r in rows]
    flat = [x for row in right for x in row]
    span = [x for row in right for f, x in zip(fields, row) if f in spans]
    other = [x for row in right for f, x in zip(fields, row) if f not in spans]
    p, se = accuracy_se(sum(flat), len(flat))
    seconds = sum(r["s"] for r in rows)
    return {"field_accuracy": round(p, 4), "se": round(se, 4), "fields_right": sum(flat), "fields": len(flat),
            "span_accuracy": round(sum(span) / len(span), 4) if span else None,
            "other_accuracy": round(sum(other) / len(other), 4) if other else None,
            "items_right": sum(all(row) for row in right), "items": len(rows),
            "valid": sum(r["valid"] for r in rows), "tasks_per_s": round(len(rows) / seconds, 3) if seconds else None,
            **({"tokens_per_task": round(sum(r["tokens"] for r in rows) / len(rows), 1),
                "tokens_per_s": round(sum(r["tokens"] for r in rows) / seconds, 2) if seconds else None}
               if rows and all("tokens" in r for r in rows) else {}),
            "drafts_kept": sum(r.get("kept", 0) for r in rows),
            "errors": {c: sum(r.get("error") == c for r in rows) for c in sorted({r["error"] for r in rows
                                                                                 if r.get("error")})},
            "per_field": {f: round(sum(row[i] for row in right) / len(rows), 3) for i, f in enumerate(fields)},
            **({"calibration": calibration(fields, rows, right)} if any(r.get("logprobs") for r in rows) else {})}


def calibration(fields: list[str], rows: list[dict], right: list[list[bool]]) -> dict:
    """How well exp(a field's mean chosen-token log-probability) predicts that the field is right, over the
    fields of the valid outputs: ECE over 10 equal-width bins, and the bins (fields, mean confidence, share
    right)."""
    conf, ok = [], []
    for r, row in zip(rows, right):
        if r["valid"]:
            for f, x in zip(fields, row):
                if f in r["logprobs"]:
                    conf.append(math.exp(r["logprobs"][f]))
                    ok.append(x)
    bins = []
    for b in range(10):
        inside = [i for i, c in enumerate(conf) if b / 10 < c <= (b + 1) / 10 or (b == 0 and c == 0.0)]
        if inside:
            bins.append({"bin": f"{b / 10:.1f}-{(b + 1) / 10:.1f}", "fields": len(inside),
                         "confidence": round(sum(conf[i] for i in inside) / len(inside), 3),
                         "right": round(sum(ok[i] for i in inside) / len(inside), 3)})
    return {"ece": round(expected_calibration_error(conf, ok), 4), "fields": len(conf), "bins": bins}


def model_path(key: str) -> str:
    """A test model's file, or ``synthetic``: TinyLlama's shape with random Q8_0 weights (bandwidth-bound as a
    1B model is; its values are noise, so it is measured for speed only)."""
    from nodeagent.config import resolve

    if key == "synthetic":
        from benchmarks.synthetic_model import synthetic_model

        return str(synthetic_model("Q8_0"))
    return str(test_model_path(MODELS[key], resolve(env=dict(os.environ))["test_models_dir"]))


def run_model(key: str, names: list[str], items: int, forms: list[str], threads: int) -> dict:
    path = model_path(key)
    nodes = {v: variant_node(path, threads, v) for v in forms}
    llm, reference = reference_side(path, threads)
    out: dict = {"model": Path(path).name, "sets": {}, **({"speed_only": True} if key == "synthetic" else {})}
    try:
        for name in names:
            data = sets.build(name, items)
            example = sets.build(name, 1, seed=7)[0]  # outside the measured items
            schema = sets.SCHEMAS[name]
            rows: dict[str, list[dict]] = {f: [] for f in forms + ["hand-written"]}
            for form in forms:  # a first task each, not measured: the first one pays for warming up
                node_run(nodes[form], example["text"], schema, form, example)
            reference(example["text"], schema)
            for i, item in enumerate(data):
                for form in forms:  # taking turns item by item: the same load on every side
                    t0 = time.perf_counter()
                    row = node_run(nodes[form], item["text"], schema, form, example)
                    rows[form].append({**row, "truth": item["truth"], "s": time.perf_counter() - t0})
                t0 = time.perf_counter()
                output, valid, tokens = reference(item["text"], schema)
                rows["hand-written"].append({"output": output, "valid": valid, "truth": item["truth"],
                                             "s": time.perf_counter() - t0, "tokens": tokens})
                if (i + 1) % 20 == 0:
                    print(f"{key} {name}: {i + 1}/{len(data)}", file=sys.stderr, flush=True)
            out["sets"][name] = {side: score(name, r) for side, r in rows.items()}
    finally:
        for node in nodes.values():
            node.close()
        llm.close()
    return out


def default_variant() -> str:
    """The variant a task without prompt, copy or examples gets from the code as it stands."""
    from nodeagent.tasks import copying
    from nodeagent.tasks.prompts import EXTRACT_PROMPT_DEFAULT

    return EXTRACT_PROMPT_DEFAULT + ("+copy" if copying.DEFAULT == "auto" else "")


def targets(sides: dict, variant: str) -> dict:
    """The issue's targets for ``variant`` against the hand-written route on one set."""
    s, ref = sides[variant], sides["hand-written"]
    speedup = round(s["tasks_per_s"] / ref["tasks_per_s"], 2) if s["tasks_per_s"] and ref["tasks_per_s"] else None
    return {"accuracy": s["field_accuracy"], "se": s["se"], "reference_accuracy": ref["field_accuracy"],
            "reference_se": ref["se"], "accurate_enough": s["field_accuracy"] >= ref["field_accuracy"] + ref["se"],
            "speedup": speedup, "fast_enough": speedup is not None and speedup >= 2.0,
            "all_valid": s["valid"] == s["items"]}


def write_facts(data: dict) -> None:
    """models/facts/extraction.json: what plans for extraction cite (nodeagent/tasks/measured_defaults.py)."""
    import datetime

    default = default_variant()
    models = {}
    for m in data["models"]:
        if default not in next(iter(m["sets"].values())) or m.get("speed_only"):
            continue
        rows = [{"set": name, "items": sides[default]["items"], **targets(sides, default)}
                for name, sides in m["sets"].items()]
        passing = [v for v in next(iter(m["sets"].values())) if v != "hand-written" and "example" not in v
                   and all(all(targets(sides, v)[k] for k in ("accurate_enough", "fast_enough", "all_valid"))
                           for sides in m["sets"].values())]
        models[m["model"]] = {"measured": data.get("created", str(datetime.date.today())), "default": default,
                              "passing_variants": passing, "sets": rows}
    out = {"source": "benchmarks/extract_quality.py (generated: do not edit)", "models": models}
    (ROOT / "models/facts/extraction.json").write_text(json.dumps(out, indent=1) + "\n")


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def markdown(data: dict) -> str:
    default = default_variant()
    lines = ["# Extraction accuracy against the truth", "",
             f"{data['items']} items a set, greedy, {data['threads']} threads, {data['machine']}"
             + (f", {data['created']}" if data.get("created") else "") + ". Field accuracy: "
             "exact after normalisation (case, accents, outer punctuation, a phone's digits, numbers as floats), ± one "
             "standard error over the item-fields. Span fields are spans of the text; the others (an enum "
             "said in other words, a number word, a currency symbol, a written date) are not. tasks/s: each "
             "extraction alone, the sides taking turns item by item, each nodeagent variant on its own node (its "
             "prompt's cells kept from item to item, as a worker serving one kind of task keeps them). ECE: how far "
             "exp(a field's mean chosen-token log-probability, `Result.field_logprobs`) is from the share of such "
             "fields that are right (10 bins).", "",
             f"**The default** (a task that names no prompt form, copy or examples): `{default}`. Examples are "
             "the caller's to give; the `+example` rows show what one worked example buys.", ""]
    for model in data["models"]:
        if model.get("speed_only"):
            lines += speed_only(model)
            continue
        for name, sides in model["sets"].items():
            ref = sides["hand-written"]
            lines += [f"## {model['model']}: {name}", "",
                      "| side | fields right | accuracy ± se | span fields | other fields | items wholly right "
                      "| schema-valid | tasks/s | vs hand-written | drafted tokens kept | ECE |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for side, s in sides.items():
                ratio = (f"x{s['tasks_per_s'] / ref['tasks_per_s']:.2f}" if s["tasks_per_s"] and ref["tasks_per_s"]
                         else "")
                label = f"**{side}** (default)" if side == default else side
                ece = f"{s['calibration']['ece']:.3f}" if "calibration" in s else ""
                lines.append(f"| {label} | {s['fields_right']} of {s['fields']} | {s['field_accuracy']:.3f} ± "
                             f"{s['se']:.3f} | {s['span_accuracy']:.3f} | {s['other_accuracy']:.3f} | "
                             f"{s['items_right']} of {s['items']} | {s['valid']}/{s['items']} | "
                             f"{s['tasks_per_s']} | {ratio} | {'' if side == 'hand-written' else s['drafts_kept']} "
                             f"| {ece} |")
            if default in sides:
                t = targets(sides, default)
                lines += ["", f"Targets for the default: accuracy {t['accuracy']:.3f} against the hand-written "
                              f"route's {t['reference_accuracy']:.3f} + {t['reference_se']:.3f}: "
                              f"{_yes(t['accurate_enough'])}; x{t['speedup']} its tasks/s (target 2): "
                              f"{_yes(t['fast_enough'])}; all schema-valid: {_yes(t['all_valid'])}."]
            lines += ["", "Per field (share right): " + "; ".join(
                f"**{side}** " + ", ".join(f"{f} {v:.2f}" for f, v in s["per_field"].items())
                for side, s in sides.items() if side in ("schema", "hand-written", default)), ""]
            errors = {side: s["errors"] for side, s in sides.items() if s.get("errors")}
            if errors:
                lines += ["Errors (an output that is not schema-valid): " + "; ".join(
                    f"**{side}** " + ", ".join(f"{c} {n}" for c, n in e.items()) for side, e in errors.items()), ""]
            cal = sides.get(default, {}).get("calibration")
            if cal:
                lines += [f"Reliability of the default's field confidence ({cal['fields']} fields, ECE "
                          f"{cal['ece']:.3f}): " + "; ".join(f"{b['bin']}: {b['fields']} fields, confidence "
                                                             f"{b['confidence']:.2f}, right {b['right']:.2f}"
                                                             for b in cal["bins"]), ""]
    return "\n".join(lines) + "\n"


def speed_only(model: dict) -> list[str]:
    """The synthetic model's section: its values are noise (random weights), so only the speed counts; and the
    two sides write different amounts of noise, so tokens/s is shown beside tasks/s."""
    lines = [f"## {model['model']}: speed only", "",
             "TinyLlama's shape with random Q8_0 weights (benchmarks/synthetic_model.py): bandwidth-bound as a 1B "
             "model is, its values noise, so accuracy means nothing here. Both sides write noise until something "
             "stops them (nodeagent: the grammar and its bounds; the hand-written route: its max_tokens of 400), so "
             "tasks/s compares different amounts of work: tokens/s is the like-for-like figure.", "",
             "| set | side | items | tokens a task | tasks/s | vs hand-written | tokens/s | vs hand-written | "
             "schema-valid |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, sides in model["sets"].items():
        ref = sides["hand-written"]
        for side, s in sides.items():
            def ratio(k: str) -> str:
                return f"x{s[k] / ref[k]:.2f}" if s.get(k) and ref.get(k) else ""
            lines.append(f"| {name} | {side} | {s['items']} | {s.get('tokens_per_task', '')} | {s['tasks_per_s']} | "
                         f"{ratio('tasks_per_s')} | {s.get('tokens_per_s', '')} | {ratio('tokens_per_s')} | "
                         f"{s['valid']}/{s['items']} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma")
    ap.add_argument("--sets", default="contacts,orders")
    ap.add_argument("--items", type=int, default=120)
    ap.add_argument("--forms", default="schema,fields,none,none+copy,fields+copy,none+example,fields+example,"
                                       "none+drafts,none+copy+drafts")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--name", default="extract_quality")
    ap.add_argument("--add", action="store_true", help="add these models to the saved results (replacing any "
                                                       "of the same file) rather than start afresh")
    ap.add_argument("--render", action="store_true", help="write the summary and the plan's facts again from the "
                                                          "saved results (no new measurement)")
    args = ap.parse_args()
    if args.render:
        data = read_results(args.name)
    else:
        data = {"items": args.items, "threads": args.threads, "created": str(datetime.date.today()),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores", "models": []}
        if args.add:
            data = read_results(args.name)
        for key in args.models.split(","):
            m = run_model(key, args.sets.split(","), args.items, args.forms.split(","), args.threads)
            data["models"] = [x for x in data["models"] if x["model"] != m["model"]] + [m]
            write_results(args.name, data, markdown(data))  # what is measured so far is kept
    write_results(args.name, data, markdown(data))
    if args.name == "extract_quality":
        write_facts(data)
    print(markdown(data))


if __name__ == "__main__":
    main()
