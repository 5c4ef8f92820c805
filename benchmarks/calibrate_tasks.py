"""Measure what the task machinery adds to a serving process (the planner's task-runtime term).

llama.cpp's own runtime is calibrated by calibrate_runtime.py. A node that runs typed tasks also holds the
constrained decoder: llguidance's tokenizer (a trie of the whole vocabulary), a compiled grammar and its
matcher per slot, and the validator's modules. On the same generated models as calibrate_runtime.py (not the
benchmark models: a 259-token vocabulary and the 152,064-token qwen2 tokenizer of the 7B header fixture), a
fresh process loads the model, then builds the task runner's decoder state: one matcher, then three more.
The fixed part and the part per vocabulary token follow from the two vocabularies; the part per slot from
the matchers.

Usage: python benchmarks/calibrate_tasks.py -> benchmarks/results/task_runtime_calibration.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.calibrate_runtime import tiny_model, tokenizers  # noqa: E402

MEASURE = r"""
import json, sys
from nodeagent.procmem import process_memory
import llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=512, n_threads=2, verbose=False)
from nodeagent.backends.llamacpp_vocab import LlamaCppVocab
session = LlamaCppVocab(llm)
before = process_memory()
import llguidance, llguidance.numpy as llnp
from nodeagent.bench.workload import TICKET_SCHEMA
from nodeagent.tasks.runner import TaskRunner
from nodeagent.tasks.schema import prepare, validate_output
runner = TaskRunner(session)
grammar = prepare(TICKET_SCHEMA, 1000, 64).grammar()
mask = llnp.allocate_token_bitmask(1, session.n_vocab)
matchers = [runner._matcher(grammar)]
llnp.fill_next_token_bitmask(matchers[0], mask)
one = process_memory()
for _ in range(3):
    matchers.append(runner._matcher(grammar))
    llnp.fill_next_token_bitmask(matchers[-1], mask)
four = process_memory()
print(json.dumps({"one": one.rss_bytes - before.rss_bytes, "four": four.rss_bytes - before.rss_bytes,
                  "n_vocab": session.n_vocab}))
"""


def measure(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    small_tok, qwen_tok = tokenizers()
    points = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tok in (("generated-259", small_tok), ("qwen2-152064", qwen_tok)):
            path = Path(tmp) / f"{name}.gguf"
            tiny_model(path, tok, 2)
            points[name] = [measure(path) for _ in range(3)]
    # the largest of three runs: the planner must not fall below a peak
    a, b = (max(p["one"] for p in points[k]) for k in ("generated-259", "qwen2-152064"))
    va, vb = points["generated-259"][0]["n_vocab"], points["qwen2-152064"][0]["n_vocab"]
    per_vocab = (b - a) / (vb - va)
    per_slot = max(max((p["four"] - p["one"]) / 3 for p in pts) for pts in points.values())
    result = {"points": points, "fixed_bytes": int(a - per_vocab * va), "per_vocab_bytes": round(per_vocab, 1),
              "per_slot_bytes": int(per_slot)}
    out = ROOT / "benchmarks" / "results" / "task_runtime_calibration.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "points"}))


if __name__ == "__main__":
    main()
