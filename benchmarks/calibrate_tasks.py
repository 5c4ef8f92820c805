"""Measure what the task machinery adds to a serving process (the planner's task-runtime term).

llama.cpp's own runtime is calibrated by calibrate_runtime.py. A node that runs typed tasks also holds the
constrained decoder: llguidance's tokenizer (a trie of the whole vocabulary), a compiled grammar and its
matcher per slot, and the validator's modules; and running tasks has a working set of its own (the slot's
decode thread and the task's thread, their allocator arenas, prompt rendering, the logits each step copies).
On the same generated models as calibrate_runtime.py (not the benchmark models: a 259-token vocabulary and the
152,064-token qwen2 tokenizer of the 7B header fixture), a fresh process per measurement:

- ``one``/``four``: loads the model, then builds the task runner's decoder state: one matcher, then three more
  (the part per slot);
- ``running``: plans and loads the model through a Node (one slot, context 2048) and fills the context on the
  main thread, as calibrate_runtime.py does (the KV cache resident: the planner charges it in full), then runs
  8 extractions and 8 classifications, in turn, and 2 chat completions on a worker thread, as a node does: they start the
  slots' decode thread (with its own OpenMP team) and the decoder. The growth of the peak over the resident
  set before them.

(On the 259-token vocabulary the random weights' first extraction tokens are bytes llguidance's copy of that
byte-level vocabulary reads otherwise, so it ends in decoder_error after a few tokens; the decoder's state is
built all the same. On the qwen2 vocabulary every task ends ok.)

The planner's fixed part and part per vocabulary token follow from the larger of the two measures on the two
vocabularies (the largest of three runs each).

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
from benchmarks.results_io import write_results  # noqa: E402

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
matchers = [runner.matcher(grammar)]
llnp.fill_next_token_bitmask(matchers[0], mask)
one = process_memory()
for _ in range(3):
    matchers.append(runner.matcher(grammar))
    llnp.fill_next_token_bitmask(matchers[-1], mask)
four = process_memory()
print(json.dumps({"one": one.rss_bytes - before.rss_bytes, "four": four.rss_bytes - before.rss_bytes,
                  "n_vocab": session.n_vocab}))
"""

RUNNING = r"""
import json, sys
from concurrent.futures import ThreadPoolExecutor
from nodeagent.procmem import process_memory
from nodeagent.config import resolve
from nodeagent.node import Node, make_task
from nodeagent.bench.workload import FILLER, ROUTES, TICKET_SCHEMA, tickets
node = Node(sys.argv[1], config=resolve(env={}), ctx_tokens=2048, slots=1)
llm = node.load().llama  # the llama.cpp context, before the slots' decode thread starts
llm.eval(llm.tokenize((FILLER * 400).encode())[: llm.n_ctx() - 8])  # the whole KV cache resident
before = process_memory()
texts = tickets(8)
with ThreadPoolExecutor(1) as pool:  # a serving node's mix, long enough for the allocator to settle
    results = []
    for text in texts:
        results += list(pool.map(node.run, [make_task("extract", input=text, schema=TICKET_SCHEMA),
                                            make_task("classify", input=text, labels=ROUTES)]))
    for text in texts[:2]:
        pool.submit(node.chat, [{"role": "user", "content": text}], max_tokens=64).result()
after = process_memory()
node.close()
print(json.dumps({"running": after.peak_rss_bytes - before.rss_bytes, "n_vocab": llm.n_vocab(),
                  "statuses": sorted({r.status if r.status == "ok" else r.error.code for r in results})}))
"""


def measure(path: Path, script: str = MEASURE) -> dict:
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, cwd=ROOT)
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
            points[name] = [{**measure(path), **measure(path, RUNNING)} for _ in range(3)]
    # the largest of three runs, of the larger measure: the planner must not fall below a peak
    a, b = (max(max(p["one"], p["running"]) for p in points[k]) for k in ("generated-259", "qwen2-152064"))
    va, vb = points["generated-259"][0]["n_vocab"], points["qwen2-152064"][0]["n_vocab"]
    per_vocab = (b - a) / (vb - va)
    per_slot = max(max((p["four"] - p["one"]) / 3 for p in pts) for pts in points.values())
    result = {"points": points, "fixed_bytes": int(a - per_vocab * va), "per_vocab_bytes": round(per_vocab, 1),
              "per_slot_bytes": int(per_slot)}
    write_results("task_runtime_calibration", result, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "points"}))


if __name__ == "__main__":
    main()
