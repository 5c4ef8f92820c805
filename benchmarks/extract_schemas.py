"""Extraction on real-world schemas: how many the task contract accepts, against what llguidance itself compiles.

The corpus comes from packages on the package index (`scripts/schema-corpus`: SchemaStore schemas vendored by
check-jsonschema, Kubernetes v1.37 object schemas, AWS CloudFormation resource schemas). For every schema, in
the same run: does llguidance's JSON compiler accept it as it is, and does the extract.v1 contract accept it
(relaxing what the decoder cannot enforce onto the final validation)? Refusals are counted by reason.

Usage: python benchmarks/extract_schemas.py [--limit N]  -> benchmarks/results/extract_schemas.json and .md
(The sample run through SmolLM2 and Gemma 3 that issue 10 asks for is not part of this script yet.)
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
    out = ROOT / "benchmarks/results"
    (out / "extract_schemas.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
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
    (out / "extract_schemas.md").write_text("\n".join(md) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
