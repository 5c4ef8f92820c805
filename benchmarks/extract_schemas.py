"""Extraction on real-world schemas: how many the task contract accepts, against what llguidance itself compiles.

The corpus comes from packages on the package index (`scripts/schema-corpus`: SchemaStore schemas vendored by
check-jsonschema, Kubernetes v1.37 object schemas, AWS CloudFormation resource schemas). For every schema, in
the same run: does llguidance's JSON compiler accept it as it is, and does the extract.v1 contract accept it
(relaxing what the decoder cannot enforce onto the final validation)? Refusals are counted by reason.

With `--run N`, an even sample of N accepted schemas (those under 8 KB) also runs through SmolLM2 and Gemma 3
(context 8192, one generic input): the share of ok results, error results by code, and how many invalid
outputs were passed off as ok (re-validated here against the original schema: must be 0).

Usage: python benchmarks/extract_schemas.py [--limit N] [--run N]
       -> benchmarks/results/extract_schemas.json and .md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import write_results  # noqa: E402
from nodeagent.config import load  # noqa: E402
from nodeagent.tasks.schema import _compile_error, prepare  # noqa: E402


def reason(text: str) -> str:
    """A refusal's reason without the schema-specific parts, for counting."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "…", text)
    text = re.sub(r"\(at [^)]*\)|\d+", "", text)
    return text[:140]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int)
    ap.add_argument("--corpus", type=Path)
    ap.add_argument("--run", type=int, default=0, help="Run a sample of N accepted schemas through both models")
    args = ap.parse_args()
    corpus = args.corpus or load().cache_dir / "schema-corpus"
    files = sorted(corpus.glob("*.json"))[: args.limit]
    if not files:
        sys.exit(f"no corpus in {corpus}: run scripts/schema-corpus")
    rows = []
    started = time.time()
    for f in files:
        schema = json.loads(f.read_text())
        source = f.name.split("-", 1)[0]
        raw = _compile_error(schema) if isinstance(schema, dict) else "not an object"
        try:
            prepared = prepare(schema)
            accepted, why, relaxed = True, None, list(prepared.relaxations)
        except ValueError as exc:
            accepted, why, relaxed = False, str(exc), []
        rows.append({"schema": f.name, "source": source, "llguidance": raw is None, "accepted": accepted,
                     "refusal": why, "relaxations": relaxed})
    compiled = [r for r in rows if r["llguidance"]]
    summary = {
        "schemas": len(rows), "by_source": dict(Counter(r["source"] for r in rows)),
        "llguidance_compiles": len(compiled), "llguidance_rate": round(len(compiled) / len(rows), 4),
        "contract_accepts": sum(r["accepted"] for r in rows),
        "contract_rate": round(sum(r["accepted"] for r in rows) / len(rows), 4),
        "accepted_of_llguidance": round(sum(r["accepted"] for r in compiled) / max(1, len(compiled)), 4),
        "refusals": dict(Counter(reason(r["refusal"]) for r in rows if not r["accepted"]).most_common(15)),
        "relaxations": dict(Counter(re.sub(r" \(.*", "", n) for r in rows for n in r["relaxations"]).most_common(15)),
        "seconds": round(time.time() - started, 1),
    }
    runs = run_sample(files, rows, args.run) if args.run else {}
    md = ["# Real-world schemas: what the extract.v1 contract accepts", "",
          f"{summary['schemas']} schemas from the package index ({', '.join(f'{k} {v}' for k, v in summary['by_source'].items())}; "
          "`scripts/schema-corpus`), each checked in the same run by llguidance's compiler alone and by the contract.",
          "", "| | schemas | share |", "| --- | --- | --- |",
          f"| llguidance compiles as is | {summary['llguidance_compiles']} | {summary['llguidance_rate']} |",
          f"| the contract accepts | {summary['contract_accepts']} | {summary['contract_rate']} |",
          f"| ... of those llguidance compiles | {round(summary['accepted_of_llguidance'] * len(compiled))} | "
          f"{summary['accepted_of_llguidance']} |", "", "Refusals by reason:", ""]
    md += [f"- {n}: {r}" for r, n in summary["refusals"].items()] or ["- none"]
    md += ["", "What the decoder left to the final validation, by kind (schemas can have several):", ""]
    md += [f"- {n}: {r}" for r, n in summary["relaxations"].items()]
    for model, r in runs.items():
        md += ["", f"Run through {model} ({r['schemas']} sampled schemas, context 8192): ok {r['ok']} "
                   f"({r['ok_share']}), errors {r['errors']}, invalid outputs passed as ok: {r['invalid_as_ok']}."]
    write_results("extract_schemas", {"summary": summary, "runs": runs, "rows": rows}, "\n".join(md), indent=1)
    print(json.dumps(summary, indent=1))


INPUT = ("Ticket 4471 from Maria Lopez (maria@example.com), 34, in Porto: the staging cluster's nginx "
         "deployment keeps restarting since the 2.3.1 upgrade; she set replicas to 3, memory to 512Mi, and tagged "
         "the stack env=staging, team=payments. Priority high; due 2026-12-15.")


def run_sample(files: list[Path], rows: list[dict], n: int) -> dict:
    from nodeagent.config import resolve
    from nodeagent.node import Node
    from nodeagent.store.pkgindex import test_model_path
    from nodeagent.tasks.contracts import ExtractTask
    from nodeagent.tasks.schema import validate_output

    accepted = [f for f, r in zip(files, rows) if r["accepted"] and f.stat().st_size < 8_000]
    sample = accepted[:: max(1, len(accepted) // n)][:n]
    out = {}
    for key in ("smollm2-135m-instruct", "gemma-3-270m-it"):
        path = test_model_path(key, load().test_models_dir)
        node = Node(str(path), config=resolve(env={}), ctx_tokens=8192, task="extract")
        codes: Counter = Counter()
        invalid_as_ok = 0
        for f in sample:
            schema = json.loads(f.read_text())
            r = node.run(ExtractTask(input=INPUT, schema=schema))
            if r.status == "ok":
                invalid_as_ok += validate_output(schema, r.output) is not None
            codes["ok" if r.status == "ok" else r.error.code] += 1
            print(json.dumps({"model": key, "schema": f.name, "status": r.status,
                              "code": r.error.code if r.error else None, "seconds": round(r.timings.total_s, 1),
                              "generated": r.tokens.generated}), flush=True)
        node.close()
        ok = codes.pop("ok", 0)
        out[path.name] = {"schemas": len(sample), "ok": ok, "ok_share": round(ok / max(1, len(sample)), 3),
                          "errors": dict(codes), "invalid_as_ok": invalid_as_ok,
                          "sample": [f.name for f in sample]}
    return out


if __name__ == "__main__":
    main()
