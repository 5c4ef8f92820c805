"""One memory-accuracy case in a fresh process (so the peak RSS is this case's alone).

Usage: python benchmarks/_case.py MODEL_PATH JSON_SETTINGS -> one JSON line on stdout.
"""

from __future__ import annotations

import json
import sys
import time

from nodeagent.procmem import process_memory

mem_start = process_memory()

import llama_cpp  # noqa: E402,F401  (counted in the process overhead, as in a serving process)

from nodeagent.config import resolve  # noqa: E402
from nodeagent.modelfile import inspect_file  # noqa: E402
from nodeagent.node import Node  # noqa: E402

SCHEMA = {"type": "object", "required": ["name", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 40}}}
# the case's fixed settings, by planner requirement -> the node's setting of the same meaning
SETTING = {"use_mmap": "mmap", "n_ubatch": "ubatch", "n_batch": "batch"}


def main() -> None:
    path, fixed = sys.argv[1], json.loads(sys.argv[2])
    info = inspect_file(path)
    # through the node core, as `nodeagent run` plans and loads: the process overhead is measured at planning,
    # after probing and reading the header, before loading
    settings = {SETTING.get(k, k): v for k, v in fixed.items()}
    node = Node(path, config=resolve(env={}), gpu_layers=0, **settings)
    p = node.plan
    overhead = p.memory.overhead_bytes
    with node.load() as model:
        # a serving node's work first (the plan is a serving node's: the constrained decoder, the slots' decode
        # thread, the task machinery's working set), then the worst case below
        from nodeagent.tasks.contracts import ClassifyTask, ExtractTask

        for task in (ClassifyTask(input="The parcel arrived broken.", labels=["complaint", "praise"]),
                     ExtractTask(input="Ana Lima lives in Porto.", schema=SCHEMA)):
            result = node.run(task)
            if result.status != "ok":
                raise SystemExit(f"{task.type} ended {result.status}: {result.error}")
        llm = model.llama
        n_ctx = llm.n_ctx()
        # worst case: fill the whole context in full batches, so the KV cache, the attention
        # scores at the largest n_kv and every activation are really touched
        tokens = [(i * 7919) % (info.vocab_size - 300) + 256 for i in range(n_ctx - 4)]
        started = time.perf_counter()
        llm.reset()
        for i in range(0, len(tokens), p.settings.n_batch):
            llm.eval(tokens[i : i + p.settings.n_batch])
        fill_s = time.perf_counter() - started
        after = process_memory()
        report = model.report
    naive = info.file_size_bytes + sum(
        2 * 2 * info.key_length * h * n_ctx for h in info.head_count_kv)  # file size + f16 KV
    print(json.dumps({
        "model": info.name, "path": path, "settings": p.settings.model_dump(), "fits": p.fits,
        "planned": p.memory.model_dump(),
        "components": [c.model_dump() for c in report.components],
        "buffers": report.buffers,
        "peak_rss_bytes": after.peak_rss_bytes, "rss_after_bytes": after.rss_bytes,
        "anon_after_bytes": after.anon_bytes, "file_after_bytes": after.file_bytes,
        "overhead_measured_bytes": overhead, "start_rss_bytes": mem_start.rss_bytes,
        "naive_bytes": naive, "load_s": report.load_s, "fill_s": fill_s, "filled_tokens": len(tokens),
    }))


if __name__ == "__main__":
    main()
