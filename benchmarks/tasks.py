"""Typed tasks on real models, compared side by side in one run.

Classification: label scoring (nodeagent) vs the naive way (llama-cpp-python
chat completion with a JSON response format listing the labels): tasks/s,
p50/p95 latency and accuracy on benchmarks/data/labelled.json (110 texts
written by the team). Extraction: over 200 generated, varied inputs (unicode,
quotes, empty and very long texts; flat, nested and array schemas, enums,
bounded numbers), the share of schema-valid outputs from constrained decoding
vs unconstrained generation with the schema in the prompt.

Usage: python benchmarks/tasks.py [--models smollm2,gemma] [--extract N]
Writes benchmarks/results/tasks.json and tasks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import rewrite_markdown, write_results  # noqa: E402
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spin-waiting threads if the machine is shared

from benchmarks.stats import pct  # noqa: E402
from nodeagent.config import resolve  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402
from nodeagent.tasks.contracts import ClassifyTask, ExtractTask  # noqa: E402
from nodeagent.tasks.prompts import classify_messages, extract_messages, fallback_for, render_prompt  # noqa: E402
from nodeagent.tasks.schema import validate_output  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma-3-270m-it"}
# the unconstrained baseline's output cap: these schemas' objects take under 60 tokens, and the whole output
# must parse as JSON, so a longer answer is invalid anyway
UNCONSTRAINED_MAX_TOKENS = 128

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
               "properties": {"name": {"type": "string", "maxLength": 60},
                              "age": {"type": "integer", "minimum": 0, "maximum": 130},
                              "city": {"type": "string", "maxLength": 60}}},
    "order": {"type": "object", "additionalProperties": False, "required": ["order", "items", "total"],
              "properties": {"order": {"type": "object", "additionalProperties": False, "required": ["id", "status"],
                                       "properties": {"id": {"type": "string", "maxLength": 20},
                                                      "status": {"enum": ["open", "shipped", "cancelled"]}}},
                             "items": {"type": "array", "maxItems": 5,
                                       "items": {"type": "object", "additionalProperties": False,
                                                 "required": ["sku", "qty"],
                                                 "properties": {"sku": {"type": "string", "maxLength": 16},
                                                                "qty": {"type": "integer", "minimum": 1,
                                                                        "maximum": 99}}}},
                             "total": {"type": "number", "minimum": 0, "maximum": 100000}}},
    "review": {"type": "object", "additionalProperties": False, "required": ["rating", "sentiment", "pros", "cons"],
               "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5},
                              "sentiment": {"enum": ["positive", "negative", "mixed"]},
                              "pros": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}},
                              "cons": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}},
                              "price": {"type": "number", "minimum": 0, "maximum": 10000}}},
    "place": {"type": "object", "additionalProperties": False, "required": ["city", "country", "lat", "lon"],
              "properties": {"city": {"type": "string", "maxLength": 60},
                             "country": {"enum": ["France", "Germany", "Japan", "Brazil", "Vietnam", "Poland",
                                                  "Other"]},
                             "lat": {"type": "number", "minimum": -90, "maximum": 90},
                             "lon": {"type": "number", "minimum": -180, "maximum": 180}}},
}
NAMES = ["Alice Martin", "Zoë Dubois", "Łukasz Nowak", "Nguyễn Ngọc Anh", "José Ángel Pérez", "王芳", "Ольга Иванова",
         "O'Brien \"Danny\" Walsh", "Søren Kierkegaard", "Amélie Poulain"]
CITIES = ["Paris", "Kraków", "Hà Nội", "São Paulo", "Zürich", "東京", "Reykjavík", "Dún Laoghaire"]
FILLER = ("The committee reviewed the minutes, the budget and the schedule for the coming quarter, and agreed to "
          "revisit the remaining items at the next session. ")


def extraction_inputs(n: int, seed: int = 7) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    while len(out) < n:
        i = len(out)
        name, city = rng.choice(NAMES), rng.choice(CITIES)
        kind = ["person", "order", "review", "place"][i % 4]
        if i % 25 == 0:
            text = "n/a"  # an input with nothing to extract (an empty one is refused by the contract)
        elif kind == "person":
            text = f"{name} ({rng.randint(1, 99)}) lives in {city} and said: \"I'd rather not 'quote' myself.\""
        elif kind == "order":
            items = ", ".join(f"{rng.randint(1, 9)} x SKU-{rng.randint(100, 999)}" for _ in range(rng.randint(1, 4)))
            text = f"Order #{rng.randint(1000, 9999)} is {rng.choice(['open', 'shipped', 'cancelled'])}: {items}. " \
                   f"Total {rng.randint(5, 900)}.{rng.randint(0, 99):02d} €."
        elif kind == "review":
            text = f"{rng.randint(1, 5)}/5 — {rng.choice(['Great', 'Awful', 'OK-ish'])} blender. Pros: quiet, cheap; " \
                   f"cons: «small jar». Paid ${rng.randint(10, 300)}."
        else:
            text = f"We met in {city} ({rng.uniform(-60, 60):.4f}, {rng.uniform(-150, 150):.4f}) — ça va? 😀"
        if i % 10 == 9:
            text = FILLER * 40 + text  # very long input, about 1.4k tokens
        out.append((kind, text))
    return out




def run_model(key: str, n_extract: int, n_classify: int | None = None) -> dict:
    import llama_cpp

    from nodeagent.node import Node

    path = test_model_path(MODELS[key], resolve(env=dict(os.environ))["test_models_dir"])
    # planned for classification, as `nodeagent run classify` plans: label branches run as parallel sequences.
    # Two nodes of the same plan, one per method, so each keeps its own KV cache and the methods can
    # alternate item by item: on a shared, noisy machine both then see the same load
    config = resolve(env={})
    node = Node(str(path), config=config, task="classify", ctx_tokens=4096)
    naive_node = Node(str(path), config=config, task="classify", ctx_tokens=4096)
    assert naive_node.plan.settings == node.plan.settings
    p = node.plan
    runner = node.runner()
    session = runner.session
    llm: llama_cpp.Llama = naive_node.load().llama
    fallback = fallback_for(session)
    if fallback:
        # a model without a chat template: llama-cpp-python's chat completion would use its own default format
        # (llama-2); give it the template nodeagent renders, so the methods differ in method, not in prompt
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        llm.chat_handler = Jinja2ChatFormatter(fallback.template, eos_token=session.eos_text,
                                               bos_token=session.bos_text).to_chat_handler()

    def naive_prompt(messages: list[dict]) -> list[int]:
        # tokens, not text: a template that writes the BOS itself would otherwise get a second one
        return session.tokenize(render_prompt(session, messages).text)

    data = json.loads((ROOT / "benchmarks/data/labelled.json").read_text())
    cls = {"scoring": {"latency_s": [], "correct": 0}, "naive": {"latency_s": [], "correct": 0, "invalid": 0}}
    items = data["items"] if n_classify is None else random.Random(3).sample(data["items"], n_classify)
    # each method reuses the KV cache of its own previous prompt (llama-cpp-python does that for completions,
    # nodeagent's session for tasks); neither gets the other's prompt for free
    for item in items:
        labels = data["tasks"][item["task"]]
        task = ClassifyTask(input=item["text"], labels=labels)
        t0 = time.perf_counter()
        r = runner.run(task)
        cls["scoring"]["latency_s"].append(time.perf_counter() - t0)
        cls["scoring"]["correct"] += r.status == "ok" and r.output.label == item["label"]
        # the naive way: llama-cpp-python's chat completion with a JSON response format listing the labels
        schema = {"type": "object", "properties": {"label": {"enum": labels}}, "required": ["label"]}
        t0 = time.perf_counter()
        out = llm.create_chat_completion(classify_messages(task), max_tokens=24, temperature=0,
                                         response_format={"type": "json_object", "schema": schema})
        cls["naive"]["latency_s"].append(time.perf_counter() - t0)
        try:
            label = json.loads(out["choices"][0]["message"]["content"])["label"]
        except (ValueError, KeyError, TypeError):
            label = None
            cls["naive"]["invalid"] += 1
        cls["naive"]["correct"] += label == item["label"]
    n = len(items)
    classification = {}
    for method, d in cls.items():
        total = sum(d["latency_s"])
        classification[method] = {"tasks": n, "tasks_per_s": round(n / total, 3), "p50_s": round(pct(d["latency_s"], .5), 4),
                                  "p95_s": round(pct(d["latency_s"], .95), 4), "accuracy": round(d["correct"] / n, 3),
                                  **({"invalid": d["invalid"]} if "invalid" in d else {})}
    classification["speedup_tasks_per_s"] = round(classification["scoring"]["tasks_per_s"]
                                                  / classification["naive"]["tasks_per_s"], 2)

    ext = {"constrained": {"valid": 0, "errors": {}, "latency_s": []},
           "unconstrained": {"valid": 0, "latency_s": []}}
    inputs = extraction_inputs(n_extract)
    for kind, text in inputs:
        task = ExtractTask(input=text, schema=SCHEMAS[kind])
        t0 = time.perf_counter()
        r = runner.run(task)
        ext["constrained"]["latency_s"].append(time.perf_counter() - t0)
        if r.status == "ok" and validate_output(SCHEMAS[kind], r.output) is None:
            ext["constrained"]["valid"] += 1
        else:
            code = r.error.code if r.error else "invalid"
            ext["constrained"]["errors"][code] = ext["constrained"]["errors"].get(code, 0) + 1
        t0 = time.perf_counter()
        out = llm.create_completion(naive_prompt(extract_messages(task)), max_tokens=UNCONSTRAINED_MAX_TOKENS,
                                    temperature=0)
        ext["unconstrained"]["latency_s"].append(time.perf_counter() - t0)
        try:
            value = json.loads(out["choices"][0]["text"].strip())
            ext["unconstrained"]["valid"] += validate_output(SCHEMAS[kind], value) is None
        except ValueError:
            pass
    extraction = {m: {"inputs": len(inputs), "schema_valid": d["valid"], "valid_share": round(d["valid"] / len(inputs), 3),
                      "p50_s": round(pct(d["latency_s"], .5), 3), "p95_s": round(pct(d["latency_s"], .95), 3),
                      **({"errors": d["errors"]} if "errors" in d else {})} for m, d in ext.items()}
    node.close()
    naive_node.close()
    return {"model": path.name, "quant": p.quant, "n_ctx": p.settings.n_ctx, "threads": p.settings.n_threads,
            "n_seq_max": p.settings.n_seq_max,
            "chat_template": f"fallback: {fallback.name}" if fallback else "the model's own",
            "classification": classification, "extraction": extraction}


def markdown(results: list[dict]) -> str:
    lines = ["# Typed tasks", "", "Produced by `benchmarks/tasks.py` on this machine (CPU, llama-cpp-python); both "
             "methods of each comparison ran in the same process over the same items, alternating item by item, "
             "each on its own instance of the same plan (so each keeps its own KV cache and both see the same "
             "machine load).", "",
             f"## Classification ({results[0]['classification']['scoring']['tasks']} labelled texts: sentiment and topic)", "",
             "Label scoring: one prompt pass, then the labels' inner trie nodes as one batch of parallel sequences "
             "(n_seq_max below); the naive way: llama-cpp-python's chat completion with a JSON response format "
             "whose schema lists the labels (greedy). Each method reuses the KV prefix of its own previous prompt.",
             "",
             "| model | method | tasks/s | p50 s | p95 s | accuracy | unparsable |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for m in ("scoring", "naive"):
            c = r["classification"][m]
            name = f"label scoring (n_seq_max {r.get('n_seq_max', 1)})" if m == "scoring" else "chat + JSON format"
            lines.append(f"| {r['model']} | {name} | {c['tasks_per_s']} | {c['p50_s']} | {c['p95_s']} | "
                         f"{c['accuracy']} | {c.get('invalid', 0)} |")
        lines.append(f"| {r['model']} | speed-up | {r['classification']['speedup_tasks_per_s']}x | | | | |")
    lines += ["", "Prompts (both methods, both tasks) go through the chat template nodeagent renders: "
              + "; ".join(f"{r['model']} {r.get('chat_template', 'not recorded')}" for r in results) + "."]
    lines += ["", "1-minute load average before and after each model's run: "
              + "; ".join(f"{r['model']} {r['load_avg_1m'][0]} / {r['load_avg_1m'][1]}" for r in results
                          if "load_avg_1m" in r) + "."]
    lines += ["", "## Extraction (generated varied inputs)", "",
              f"Unconstrained generation: the same prompt (schema included), greedy, at most "
              f"{UNCONSTRAINED_MAX_TOKENS} tokens, the whole output parsed as JSON and validated.", "",
              "| model | method | inputs | schema-valid | share | p50 s | p95 s | error results |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for m in ("constrained", "unconstrained"):
            e = r["extraction"][m]
            errors = ", ".join(f"{k}: {v}" for k, v in e.get("errors", {}).items()) if m == "constrained" else "n/a"
            lines.append(f"| {r['model']} | {m} | {e['inputs']} | {e['schema_valid']} | {e['valid_share']} | "
                         f"{e['p50_s']} | {e['p95_s']} | {errors or 'none'} |")
    lines += ["", "A constrained task that does not finish returns an error result with no output (never a partial "
              "object); the unconstrained outputs are counted valid only when the whole text parses and validates."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma")
    ap.add_argument("--extract", type=int, default=200)
    ap.add_argument("--classify", type=int, default=None, help="Only N of the labelled texts (smoke runs)")
    ap.add_argument("--out", default="tasks", help="Result file name (without extension)")
    ap.add_argument("--markdown-only", action="store_true", help="Rewrite the .md from the .json, run nothing")
    args = ap.parse_args()
    if args.markdown_only:
        rewrite_markdown(args.out, markdown)
        return
    results = []
    for key in args.models.split(","):
        load_before = os.getloadavg()[0]
        results.append(run_model(key, args.extract, args.classify))
        # what else the machine was doing: the 1-minute load average (2 cores here) before and after
        results[-1]["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        write_results(args.out, results, markdown(results), indent=1)
        print(json.dumps(results[-1]["classification"]), json.dumps({k: v["valid_share"] for k, v in
                                                                     results[-1]["extraction"].items()}),
              file=sys.stderr)


if __name__ == "__main__":
    main()
