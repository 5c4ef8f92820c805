"""Embedding throughput: nodeagent's embed.v1 path against llama-cpp-python's own ``Llama.embed`` on the same file
and settings, and what sharing forward batches across tasks gains.

- **overhead**: 192 texts in batches of 1, 8 and 64 (BBC News leads, 40 to 150 tokens), embedded by ``Node.embed`` (the
  task's validation, tokenizing, the shared-batch thread, base64 of the vectors, the Result) and by
  ``Llama.embed(normalize=True)`` on a Llama of the same plan's settings. Each side runs in a process of its own
  (two llama.cpp contexts decoding from two threads of one process would each keep an OpenMP team spinning on
  the same cores), the processes taking turns round by round; texts/s of each, and nodeagent's overhead (its
  time over llama-cpp-python's, less one). Target: 5 % or less.
- **tasks sharing batches**: 64 tasks of one text each, run one at a time, then from 8 threads at once (the
  node's tasks in flight share the forward batches): tasks/s of each.

Usage: python benchmarks/embed_throughput.py [--rounds 7] [--quant F32]
   -> benchmarks/results/embed_throughput.json and .md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import write_results  # noqa: E402
from nodeagent.bench.embed import in_flight  # noqa: E402

BATCHES = (1, 8, 64)
TEXTS = 192  # each batch size's texts a round: 192 leads, about 2 s of embedding


def texts(n: int) -> list[str]:
    from benchmarks import public_sets

    data = public_sets.load("bbc_news") or public_sets.fetch("bbc_news")
    return [it["text"] for it in data["items"][:n]]


def side_times(side: str, quant: str) -> dict[str, float]:
    """One round of one side, in this process: each batch size's seconds for TEXTS texts (after a warm-up)."""
    from nodeagent.backends.llamacpp import open_llama
    from nodeagent.config import resolve
    from nodeagent.node import Node
    from nodeagent.store.pkgindex import test_model_path

    config = resolve(env=dict(os.environ))
    corpus = texts(TEXTS)
    out = {}
    with Node(str(test_model_path("all-minilm-l6-v2", Path(config.test_models_dir), quant)), config=config) as node:
        if side == "nodeagent":
            run = lambda c: node.embed(c)  # noqa: E731
        else:
            llama = open_llama(node.plan.settings)  # the plan's settings; the node itself is not loaded
            run = lambda c: llama.embed(c, normalize=True)  # noqa: E731
        for size in BATCHES:
            chunks = [corpus[i:i + size] for i in range(0, TEXTS, size)]
            run(chunks[0])
            started = time.perf_counter()
            for c in chunks:
                run(c)
            out[str(size)] = time.perf_counter() - started
    return out


def overhead(quant: str, rounds: int) -> list[dict]:
    import json
    import subprocess

    times: dict[str, dict[str, list[float]]] = {"nodeagent": {}, "llama-cpp-python": {}}
    for r in range(rounds):
        for side in (("nodeagent", "llama-cpp-python") if r % 2 == 0 else ("llama-cpp-python", "nodeagent")):
            done = subprocess.run([sys.executable, __file__, "--side", side, "--quant", quant], capture_output=True,
                                  text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            for size, seconds in json.loads(done.stdout.strip().splitlines()[-1]).items():
                times[side].setdefault(size, []).append(seconds)
    out = []
    for size in BATCHES:
        med = {k: statistics.median(v[str(size)]) for k, v in times.items()}
        out.append({"batch": size, "texts": TEXTS, "rounds": rounds,
                    "nodeagent_texts_per_s": round(TEXTS / med["nodeagent"], 1),
                    "llama_cpp_python_texts_per_s": round(TEXTS / med["llama-cpp-python"], 1),
                    "overhead_pct": round(100 * (med["nodeagent"] / med["llama-cpp-python"] - 1), 2)})
    return out


def markdown(d: dict) -> str:
    lines = [f"# Embedding throughput: nodeagent against llama-cpp-python ({d['model']})", "",
             f"{d['machine']}, {d['when']}; the same file and settings ({d['settings']}), taking turns; medians of "
             f"{d['rounds']} rounds.", "", "| batch | nodeagent texts/s | llama-cpp-python texts/s | overhead |",
             "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['nodeagent_texts_per_s']} | {r['llama_cpp_python_texts_per_s']} | "
              f"{r['overhead_pct']:+.2f} % |" for r in d["overhead"]]
    s = d["shared"]
    lines += ["", f"Tasks of one text: {s['one_at_a_time_tasks_per_s']}/s one at a time, "
                  f"{s['in_flight_tasks_per_s']}/s from {s['threads']} threads at once (x{s['gain']}, "
                  f"{s['tasks']} tasks in {s['forward_batches']} forward batches).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quant", default="F32")
    ap.add_argument("--side", choices=["nodeagent", "llama-cpp-python"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:  # a child: one round of one side, its times on the last line
        import json

        print(json.dumps(side_times(args.side, args.quant)))
        return
    from nodeagent.config import resolve
    from nodeagent.node import Node
    from nodeagent.store.pkgindex import test_model_path

    config = resolve(env=dict(os.environ))
    path = test_model_path("all-minilm-l6-v2", Path(config.test_models_dir), args.quant)
    with Node(str(path), config=config) as node:
        s = node.plan.settings
        shared_figures = in_flight(node, texts(200)[:64])
    d = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "when": time.strftime("%Y-%m-%d"),
         "model": path.name, "rounds": args.rounds,
         "settings": f"n_ctx {s.n_ctx}, n_batch {s.n_batch}, {s.n_seq_max} sequences, {s.n_threads} threads, "
                     f"flash attention {'on' if s.flash_attn else 'off'}",
         "overhead": overhead(args.quant, args.rounds), "shared": shared_figures}
    write_results("embed_throughput", d, markdown(d))
    print(markdown(d))


if __name__ == "__main__":
    main()
