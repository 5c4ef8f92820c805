"""Typed tasks on real models, compared side by side in one run.

Classification: label scoring (nodeagent) vs the naive way (llama-cpp-python
chat completion with a JSON response format listing the labels): tasks/s,
p50/p95 latency and accuracy on benchmarks/data/labelled.json (110 texts
written by the team). Extraction: over 200 generated, varied inputs (unicode,
quotes, empty and very long texts; flat, nested and array schemas, enums,
bounded numbers), the share of schema-valid outputs from constrained decoding
vs unconstrained generation with the schema in the prompt.

Usage: python benchmarks/tasks.py [--models smollm2,gemma] [--extract N] [--extract-only]
Writes benchmarks/results/tasks.json and tasks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import read_results, rewrite_markdown, write_results  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spin-waiting threads if the machine is shared

from benchmarks.stats import pct  # noqa: E402
from benchmarks.task_classify import classify_sets, multi_label_run, summarise, summarise_multi  # noqa: E402
from benchmarks.task_inputs import MODELS, MULTI_PAIRS, RAW_DIR, SCHEMAS, UNCONSTRAINED_MAX_TOKENS, extraction_inputs  # noqa: E402
from benchmarks.task_report import _commit, markdown, write_facts  # noqa: E402
from nodeagent.config import resolve  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402
from nodeagent.tasks.contracts import ExtractTask  # noqa: E402
from nodeagent.tasks.prompts import extract_messages, fallback_for, render_prompt  # noqa: E402
from nodeagent.tasks.schema import validate_output  # noqa: E402


def run_model(key: str, n_extract: int, n_classify: int | None = None, sets: list[str] = (),
              n_multi: int = MULTI_PAIRS, classify: bool = True) -> dict:
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

    head = {"model": path.name, "quant": p.quant, "n_ctx": p.settings.n_ctx, "threads": p.settings.n_threads,
            "n_seq_max": p.settings.n_seq_max,
            "chat_template": f"fallback: {fallback.name}" if fallback else "the model's own"}
    if classify:
        head["classification"] = classify_sets(node.plan, config, path, runner, llm, n_classify, sets)
    if n_multi:
        raw = multi_label_run(runner, n_multi)
        RAW_DIR.mkdir(parents=True, exist_ok=True)
        (RAW_DIR / f"tasks-multi-{path.stem}.json").write_text(json.dumps(raw))
        head["multi_label"] = summarise_multi(raw)
    if not n_extract:
        node.close()
        naive_node.close()
        return head
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
        # unconstrained generation needs the schema in its prompt, whatever nodeagent's default form is
        shown = task.model_copy(update={"prompt": "schema"})
        out = llm.create_completion(naive_prompt(extract_messages(shown)), max_tokens=UNCONSTRAINED_MAX_TOKENS,
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
    return {**head, "extraction": extraction}


def main() -> None:
    from benchmarks.public_sets import SETS

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma")
    ap.add_argument("--extract", type=int, default=200, help="Extraction inputs; 0 keeps the saved extraction "
                                                             "figures of each model and runs classification only")
    ap.add_argument("--classify", type=int, default=None, help="Only N texts of each set (smoke runs)")
    ap.add_argument("--sets", default=",".join(SETS), help="Public labelled sets, besides the project's own")
    ap.add_argument("--out", default="tasks", help="Result file name (without extension)")
    ap.add_argument("--markdown-only", action="store_true", help="Rewrite the .md from the .json, run nothing")
    ap.add_argument("--multi", type=int, default=MULTI_PAIRS, help="Two-label texts (and as many single ones) "
                    "for multi-label; 0 keeps the saved multi-label figures")
    ap.add_argument("--multi-only", action="store_true", help="Only the multi-label measurement: keep the saved "
                    "classification figures")
    ap.add_argument("--extract-only", action="store_true", help="Only the extraction measurement: keep the saved "
                    "classification and multi-label figures")
    ap.add_argument("--from-raw", action="store_true", help="Compute the classification figures again from the "
                    "raw records of the saved run (RAW_DIR), run nothing")
    args = ap.parse_args()
    if args.from_raw:
        results = read_results(args.out)
        for r in results:
            raw = json.loads((RAW_DIR / f"tasks-{Path(r['model']).stem}.json").read_text())
            r["classification"] = {name: summarise(rec) for name, rec in raw.items()}
            multi = RAW_DIR / f"tasks-multi-{Path(r['model']).stem}.json"
            if multi.exists():
                r["multi_label"] = summarise_multi(json.loads(multi.read_text()))
        write_results(args.out, results, indent=1)
    if args.markdown_only or args.from_raw:
        rewrite_markdown(args.out, markdown)
        if args.out == "tasks":
            write_facts(read_results(args.out))
        return
    try:
        saved = {r["model"]: r for r in read_results(args.out)}
    except (OSError, ValueError):
        saved = {}
    results = []
    n_extract = 0 if args.multi_only else args.extract
    for key in args.models.split(","):
        load_before = os.getloadavg()[0]
        results.append(run_model(key, n_extract, args.classify, [x for x in args.sets.split(",") if x],
                                 0 if args.extract_only else args.multi,
                                 classify=not (args.multi_only or args.extract_only)))
        # what else the machine was doing: the 1-minute load average (2 cores here) before and after
        results[-1]["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        earlier = saved.get(results[-1]["model"], {})
        others = args.multi_only or args.extract_only  # the figures this run did not measure are kept
        for part, kept in (("classification", others), ("load_avg_1m", others),
                           ("multi_label", args.extract_only or not args.multi)):
            if kept and part in earlier:
                results[-1][part] = earlier[part]
        if not n_extract:
            if "extraction" in earlier:
                results[-1]["extraction"] = earlier["extraction"]
                results[-1]["extraction_from"] = earlier.get("extraction_from", "an earlier run of this benchmark")
        results[-1]["created"] = time.strftime("%Y-%m-%d")
        results[-1]["commit"] = _commit()
        # the figures first: a summary that fails loses nothing. A model this run leaves out keeps its saved
        # figures (the summary says when each model was measured)
        fresh = {r["model"]: r for r in results}
        merged = [fresh.pop(m, r) for m, r in saved.items()] + list(fresh.values())
        write_results(args.out, merged, indent=1)
        try:
            rewrite_markdown(args.out, markdown)
            if args.out == "tasks":
                write_facts(merged)
        except Exception as exc:  # the figures are saved: the summary can be rendered again (--markdown-only)
            print(f"the summary could not be rendered ({exc!r}); run --markdown-only", file=sys.stderr)


if __name__ == "__main__":
    main()
