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

Usage: python benchmarks/extract_quality.py [--models smollm2,gemma] [--sets contacts,orders] [--items 120]
       [--forms schema,fields,none,fields+example,schema+copy,fields+copy]
   -> benchmarks/results/extract_quality.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import extract_sets as sets  # noqa: E402

from benchmarks.results_io import write_results  # noqa: E402
from benchmarks.stats import accuracy_se  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma-3-270m-it"}
REFERENCE_SYSTEM = "Extract the requested fields from the user's text as JSON."
CTX = 2048


def node_side(path: str, threads: int):
    from nodeagent.config import resolve
    from nodeagent.node import Node
    from nodeagent.tasks.contracts import ExtractTask

    node = Node(path, config=resolve(env={"NODEAGENT_THREADS": str(threads)}), task="extract", ctx_tokens=CTX,
                slots=1)
    node.load()

    def run(text: str, schema: dict, variant: str, example: dict | None) -> tuple[dict | None, bool, int, str | None]:
        """``variant``: a prompt form, with ``+example`` (one worked example as turns) and ``+copy`` (copy
        ``auto``); the output, whether it is valid, the drafted tokens the model kept, and the error's code."""
        form, *flags = variant.split("+")
        examples = [{"text": example["text"], "output": example["truth"]}] if "example" in flags else []
        runner = node.runner()
        kept = sum(k for _, k in runner.drafts)
        r = node.run(ExtractTask(input=text, schema=schema, prompt=form, examples=examples,
                                 copy="auto" if "copy" in flags else "none"))
        kept = sum(k for _, k in runner.drafts) - kept
        return (r.output if r.status == "ok" else None), r.status == "ok", kept, (r.error.code if r.error else None)

    return node, run


def reference_side(path: str, threads: int):
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=CTX, n_threads=threads, verbose=False)

    def run(text: str, schema: dict) -> tuple[dict | None, bool]:
        from nodeagent.tasks.schema import validate_output

        out = llm.create_chat_completion(messages=[{"role": "system", "content": REFERENCE_SYSTEM},
                                                   {"role": "user", "content": text}],
                                         response_format={"type": "json_object", "schema": schema},
                                         temperature=0.0, max_tokens=400)
        try:
            value = json.loads(out["choices"][0]["message"]["content"])
        except (ValueError, TypeError):
            return None, False
        return value, validate_output(schema, value) is None

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
            "drafts_kept": sum(r.get("kept", 0) for r in rows),
            "errors": {c: sum(r.get("error") == c for r in rows) for c in sorted({r["error"] for r in rows
                                                                                 if r.get("error")})},
            "per_field": {f: round(sum(row[i] for row in right) / len(rows), 3) for i, f in enumerate(fields)}}


def run_model(key: str, names: list[str], items: int, forms: list[str], threads: int) -> dict:
    from nodeagent.config import resolve

    path = str(test_model_path(MODELS[key], resolve(env=dict(os.environ))["test_models_dir"]))
    node, extract = node_side(path, threads)
    llm, reference = reference_side(path, threads)
    out: dict = {"model": Path(path).name, "sets": {}}
    try:
        for name in names:
            data = sets.build(name, items)
            example = sets.build(name, 1, seed=7)[0]  # outside the measured items
            schema = sets.SCHEMAS[name]
            rows: dict[str, list[dict]] = {f: [] for f in forms + ["hand-written"]}
            for i, item in enumerate(data):
                for form in forms:  # taking turns item by item: the same load on every side
                    t0 = time.perf_counter()
                    output, valid, kept, error = extract(item["text"], schema, form, example)
                    rows[form].append({"output": output, "valid": valid, "truth": item["truth"],
                                       "s": time.perf_counter() - t0, "kept": kept, "error": error})
                t0 = time.perf_counter()
                output, valid = reference(item["text"], schema)
                rows["hand-written"].append({"output": output, "valid": valid, "truth": item["truth"],
                                             "s": time.perf_counter() - t0})
                if (i + 1) % 20 == 0:
                    print(f"{key} {name}: {i + 1}/{len(data)}", file=sys.stderr, flush=True)
            out["sets"][name] = {side: score(name, r) for side, r in rows.items()}
    finally:
        node.close()
        llm.close()
    return out


def markdown(data: dict) -> str:
    lines = ["# Extraction accuracy against the truth", "",
             f"{data['items']} items a set, greedy, {data['threads']} threads, {data['machine']}. Field accuracy: "
             "exact after normalisation (case, accents, outer punctuation, a phone's digits, numbers as floats), ± one "
             "standard error over the item-fields. Span fields are spans of the text; the others (an enum "
             "said in other words, a number word, a currency symbol, a written date) are not. tasks/s: each "
             "extraction alone, the sides taking turns item by item.", ""]
    for model in data["models"]:
        for name, sides in model["sets"].items():
            ref = sides["hand-written"]
            lines += [f"## {model['model']}: {name}", "",
                      "| side | fields right | accuracy ± se | span fields | other fields | items wholly right "
                      "| schema-valid | tasks/s | vs hand-written | drafted tokens kept |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for side, s in sides.items():
                ratio = (f"x{s['tasks_per_s'] / ref['tasks_per_s']:.2f}" if s["tasks_per_s"] and ref["tasks_per_s"]
                         else "")
                lines.append(f"| {side} | {s['fields_right']} of {s['fields']} | {s['field_accuracy']:.3f} ± "
                             f"{s['se']:.3f} | {s['span_accuracy']:.3f} | {s['other_accuracy']:.3f} | "
                             f"{s['items_right']} of {s['items']} | {s['valid']}/{s['items']} | "
                             f"{s['tasks_per_s']} | {ratio} | {'' if side == 'hand-written' else s['drafts_kept']} |")
            lines += ["", "Per field (share right): " + "; ".join(
                f"**{side}** " + ", ".join(f"{f} {v:.2f}" for f, v in s["per_field"].items())
                for side, s in sides.items() if side in ("schema", "hand-written", data.get("default", "schema"))), ""]
            errors = {side: s["errors"] for side, s in sides.items() if s.get("errors")}
            if errors:
                lines += ["Errors (an output that is not schema-valid): " + "; ".join(
                    f"**{side}** " + ", ".join(f"{c} {n}" for c, n in e.items()) for side, e in errors.items()), ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma")
    ap.add_argument("--sets", default="contacts,orders")
    ap.add_argument("--items", type=int, default=120)
    ap.add_argument("--forms", default="schema,fields,none,fields+example,schema+copy,fields+copy")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--name", default="extract_quality")
    args = ap.parse_args()
    data = {"items": args.items, "threads": args.threads, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "forms": args.forms.split(","), "models": []}
    for key in args.models.split(","):
        data["models"].append(run_model(key, args.sets.split(","), args.items, args.forms.split(","), args.threads))
        write_results(args.name, data, markdown(data))  # what is measured so far is kept
    print(markdown(data))


if __name__ == "__main__":
    main()
