"""`nodeagent bench` on an embedding model: embeddings per second through the node, as a user's tasks run.

- **batches**: the benchmark's support tickets (``workload.tickets``) embedded 64 at a time, in tasks of 1, 8 and
  64 texts (``Node.embed``: the task's checks, tokenizing, the shared forward batches, the vectors in base64, the
  Result); embeddings/s and tokens/s of each;
- **tasks in flight**: 64 tasks of one text, one at a time and then from 8 threads at once, whose inputs the node
  puts in shared forward batches: tasks/s of each, the gain, and how many forward batches they took;
- **memory**: the plan's bytes against the process's peak resident set.

It runs in this process, the model loaded once (an encoder's load is a fraction of a second). llama-cpp-python's
own ``embed`` on the same file, for nodeagent's overhead, is ``benchmarks/embed_throughput.py``."""

from __future__ import annotations

import platform
import threading
import time
from pathlib import Path
from typing import Any, Callable

from nodeagent.errors import BackendError

BATCHES = (1, 8, 64)
TEXTS = 64
THREADS = 8


def _embedded(node: Any, texts: list[str]) -> int:
    """Embed ``texts`` in one task; the tokens they took (a failed task is the benchmark's failure)."""
    r = node.embed(texts)
    if r.status != "ok":
        raise BackendError(f"an embedding task failed during the benchmark: {r.error.message if r.error else r}")
    return sum(r.output.tokens)


def batches(node: Any, corpus: list[str]) -> list[dict[str, Any]]:
    """Embeddings/s and tokens/s for tasks of each size in BATCHES over the same ``corpus``."""
    rows = []
    for size in BATCHES:
        chunks = [corpus[i:i + size] for i in range(0, len(corpus), size)]
        started = time.perf_counter()
        tokens = sum(_embedded(node, c) for c in chunks)
        took = time.perf_counter() - started
        rows.append({"batch": size, "texts": len(corpus), "s": round(took, 4),
                     "embeddings_per_s": round(len(corpus) / took, 1), "tokens_per_s": round(tokens / took, 1)})
    return rows


def in_flight(node: Any, corpus: list[str], threads: int = THREADS) -> dict[str, Any]:
    """Tasks of one text each, one at a time and from ``threads`` threads at once (sharing forward batches)."""
    started = time.perf_counter()
    for t in corpus:
        _embedded(node, [t])
    alone = time.perf_counter() - started
    embedder = node.runner().session
    before = embedder.batches
    chunks = [corpus[i::threads] for i in range(threads)]
    errors: list[BaseException] = []

    def run(chunk: list[str]) -> None:
        try:
            for t in chunk:
                _embedded(node, [t])
        except BaseException as exc:  # noqa: BLE001  (raised again on the caller's thread)
            errors.append(exc)

    started = time.perf_counter()
    workers = [threading.Thread(target=run, args=(c,)) for c in chunks]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    together = time.perf_counter() - started
    if errors:
        raise errors[0]
    return {"tasks": len(corpus), "threads": threads, "one_at_a_time_tasks_per_s": round(len(corpus) / alone, 1),
            "in_flight_tasks_per_s": round(len(corpus) / together, 1), "gain": round(alone / together, 2),
            "forward_batches": embedder.batches - before}


def embed_bench(node: Any, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The whole benchmark on a node whose model embeds (``Node.kind.embeds``)."""
    from nodeagent.bench.run import versions
    from nodeagent.bench.workload import tickets
    from nodeagent.procmem import process_memory

    corpus = tickets(TEXTS)
    started = time.perf_counter()
    progress("[1/3] load and a first embedding")
    _embedded(node, corpus[:1])
    loaded_s = time.perf_counter() - started
    progress(f"[2/3] {TEXTS} texts in tasks of {', '.join(map(str, BATCHES))}")
    rows = batches(node, corpus)
    progress(f"[3/3] {TEXTS} tasks of one text, one at a time and from {THREADS} threads at once")
    shared = in_flight(node, corpus)
    p, mem = node.plan, process_memory()
    s = p.settings
    return {
        "schema": "nodeagent.bench-embed/1", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": round(time.perf_counter() - started, 1), "model": node.model, "model_file": p.model,
        "quant": p.quant, "profile": node.device.profile.id, "versions": versions(),
        "machine": f"{platform.machine()}, {node.device.hardware.cores_logical} logical cores",
        "settings": {"n_ctx": s.n_ctx, "n_batch": s.n_batch, "n_seq_max": s.n_seq_max, "n_threads": s.n_threads,
                     "flash_attn": s.flash_attn, "pooling": s.pooling},
        "load_and_first_s": round(loaded_s, 3), "batches": rows, "in_flight": shared,
        "memory": {"planned_bytes": p.memory.total_bytes, "peak_rss_bytes": mem.peak_rss_bytes,
                   "planned_over_peak": round(p.memory.total_bytes / mem.peak_rss_bytes, 4)
                   if mem.peak_rss_bytes else None},
    }


def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary `nodeagent bench` prints."""
    out = [("model", f"{Path(result['model_file']).name} ({result['quant']})"),
           ("load and first embedding", f"{result['load_and_first_s']} s")]
    out += [(f"tasks of {r['batch']}", f"{r['embeddings_per_s']} embeddings/s, {r['tokens_per_s']} tokens/s")
            for r in result["batches"]]
    f = result["in_flight"]
    out.append((f"{f['tasks']} tasks of one text", f"{f['one_at_a_time_tasks_per_s']}/s one at a time, "
                f"{f['in_flight_tasks_per_s']}/s from {f['threads']} threads (x{f['gain']}, "
                f"{f['forward_batches']} forward batches)"))
    m = result["memory"]
    out.append(("memory", f"plan {m['planned_bytes'] / 1e6:.1f} MB, peak {m['peak_rss_bytes'] / 1e6:.1f} MB"))
    return out


def markdown(result: dict[str, Any]) -> str:
    return "\n".join(["# nodeagent bench (embeddings)", "", f"{result['machine']}, {result['created']}", "",
                      "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows(result)]) + "\n"


def save(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """JSON and markdown under ``out_dir``, named by the model file."""
    from nodeagent.bench.run import write_result

    return write_result(result, markdown(result), out_dir, Path(result["model_file"]).stem + "-embed")
