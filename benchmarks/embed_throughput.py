"""Embedding throughput: nodeagent's embed.v1 path against llama-cpp-python's own ``Llama.embed`` on the same file
and settings, and what sharing forward batches across tasks gains.

- **overhead**: 192 texts in batches of 1, 8 and 64 (BBC News leads, 40 to 150 tokens), embedded by ``Node.embed`` (the
  task's validation, tokenizing, the shared-batch thread, base64 of the vectors, the Result) and by
  ``Llama.embed(normalize=True)`` on a Llama of the same plan's settings. Each side runs in a process of its own
  (two llama.cpp contexts decoding from two threads of one process would each keep an OpenMP team spinning on
  the same cores), the processes taking turns round by round; texts/s of each, and nodeagent's overhead (its
  time over llama-cpp-python's, less one). Target: 5 % or less.
- **in one process**: the same, both sides in one process on one context: the node's own ``Llama`` (its batching
  thread idle meanwhile) called by ``Llama.embed`` from the benchmark's thread, the sides taking turns, a pause
  between them; what is left is the node's own work around the same decode (no second context, no second process).
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
PAUSE_S = 0.5  # between the sides in one process: longer than an idle OpenMP team spins


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


def rows(times: dict[str, dict[str, list[float]]], rounds: int) -> list[dict]:
    """Each batch size's texts/s of each side (medians over the rounds) and nodeagent's overhead."""
    out = []
    for size in BATCHES:
        med = {k: statistics.median(v[str(size)]) for k, v in times.items()}
        out.append({"batch": size, "texts": TEXTS, "rounds": rounds,
                    "nodeagent_texts_per_s": round(TEXTS / med["nodeagent"], 1),
                    "llama_cpp_python_texts_per_s": round(TEXTS / med["llama-cpp-python"], 1),
                    "overhead_pct": round(100 * (med["nodeagent"] / med["llama-cpp-python"] - 1), 2)})
    return out


def overhead_in_one_process(node, rounds: int) -> list[dict]:
    """Both sides on the node's own context, in this process: each batch size's texts by ``Node.embed``, then by
    ``Llama.embed`` on the node's ``Llama`` (its batching thread idle meanwhile), the first side alternating round
    by round. Each side runs from its own thread (the node's batching thread; this one), so each has its own
    OpenMP team: a pause between the sides lets the other's team stop spinning (as separate processes do)."""
    corpus = texts(TEXTS)
    node.embed(corpus[:1])  # loaded
    llama = node.runner().session.llama
    sides = {"nodeagent": lambda c: node.embed(c), "llama-cpp-python": lambda c: llama.embed(c, normalize=True)}
    times: dict[str, dict[str, list[float]]] = {k: {} for k in sides}
    for r in range(rounds):
        for size in BATCHES:
            chunks = [corpus[i:i + size] for i in range(0, TEXTS, size)]
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                time.sleep(PAUSE_S)
                sides[name](chunks[0])  # (its team awake, as in the other process's warm-up)
                started = time.perf_counter()
                for c in chunks:
                    sides[name](c)
                times[name].setdefault(str(size), []).append(time.perf_counter() - started)
    return rows(times, rounds)


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
    return rows(times, rounds)


def markdown(d: dict) -> str:
    lines = [f"# Embedding throughput: nodeagent against llama-cpp-python ({d['model']})", "",
             f"{d['machine']}, {d['when']}; the same file and settings ({d['settings']}), taking turns; medians of "
             f"{d['rounds']} rounds.", "", "| batch | nodeagent texts/s | llama-cpp-python texts/s | overhead |",
             "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['nodeagent_texts_per_s']} | {r['llama_cpp_python_texts_per_s']} | "
              f"{r['overhead_pct']:+.2f} % |" for r in d["overhead"]]
    lines += ["", "In one process, on one context (the node's own, the sides taking turns; medians of "
                  f"{d['rounds']} rounds). Each side's rate here is its rate beside the other's thread in one process, "
                  "not alone (compare the rates with the table above): the overhead is the node's own work on the "
                  "same decode.", "", "| batch | nodeagent texts/s | llama-cpp-python texts/s | overhead |",
              "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['nodeagent_texts_per_s']} | {r['llama_cpp_python_texts_per_s']} | "
              f"{r['overhead_pct']:+.2f} % |" for r in d["overhead_one_process"]]
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
        one_process = overhead_in_one_process(node, args.rounds)
    d = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "when": time.strftime("%Y-%m-%d"),
         "model": path.name, "rounds": args.rounds,
         "settings": f"n_ctx {s.n_ctx}, n_batch {s.n_batch}, {s.n_seq_max} sequences, {s.n_threads} threads, "
                     f"flash attention {'on' if s.flash_attn else 'off'}",
         "overhead": overhead(args.quant, args.rounds), "overhead_one_process": one_process,
         "shared": shared_figures}
    write_results("embed_throughput", d, markdown(d))
    print(markdown(d))


if __name__ == "__main__":
    main()
