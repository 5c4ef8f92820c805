"""One benchmark phase in a fresh process, so its load time and peak memory are its own.

Usage (by ``nodeagent.bench.run``): python -m nodeagent.bench.phase JSON_SPEC -> one JSON line on stdout.

- ``load``: plan and load with mmap on or off, the model file's pages first dropped from the page cache
  (cold) or read once (warm); the load and the first token after it (where mmap pays its page faults).
- ``run``: the node on its planned settings with ``slots``: prompt and generation speed at several prompt
  lengths, time to first token, a chat completion for the overhead comparison (slots 1), then extraction and
  classification tasks per minute with ``slots`` tasks at once, every output validated; the peak memory.
- ``raw``: the same chat completions through llama-cpp-python alone, on the same settings.
- ``drafts``: what drafts from the input cost and keep here (``planner/drafts.py`` chooses from it): a step of
  1 + k tokens of one sequence (k up to the longest draft) through the bindings alone; the workload's
  extractions without drafts (the node's own time a step: its steps' time less llama.cpp's), then with drafts of
  the longest length (each draft's tokens and how many the model kept).
- ``prefixes``: a prompt of each length read from its tokens, against its state written to disk and read back into
  an empty slot, the file's pages first dropped from the page cache (what a warm prefix saves, per device).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Iterator

from nodeagent.procmem import process_memory

START = process_memory()


def drop_page_cache(path: str) -> bool:
    """Evict the file's pages from the page cache (no root needed); False where the OS has no way."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def read_through(path: str) -> None:
    with open(path, "rb") as fh:
        while fh.read(16 << 20):
            pass


def _node(spec: dict[str, Any], **settings: Any) -> Any:
    from nodeagent.config import resolve
    from nodeagent.node import Node

    return Node(spec["model"], config=resolve(env=dict(os.environ)), task="classify",
                ctx_tokens=spec["ctx_tokens"], **settings)


def load_phase(spec: dict[str, Any]) -> dict[str, Any]:
    node = _node(spec, slots=1, mmap=spec["mmap"])
    path = node.plan.model
    cold = drop_page_cache(path) if spec["cold"] else (read_through(path) or False)
    started = time.perf_counter()
    runner = node.runner()  # plan, load, the task runner
    loaded_s = time.perf_counter() - started
    session = runner.session
    prompt = session.tokenize("Hello")
    logits = session.prefill(prompt)
    first_s = time.perf_counter() - started
    for _ in range(15):  # the first 16 tokens: where a cold mmap load pays for its page faults
        logits = session.eval([int(logits.argmax())])
    sixteen_s = time.perf_counter() - started
    node.close()
    return {"mmap": spec["mmap"], "cold": spec["cold"], "cache_dropped": cold, "load_s": round(loaded_s, 4),
            "load_and_first_token_s": round(first_s, 4), "load_and_16_tokens_s": round(sixteen_s, 4)}


def prompt_of(session: Any, n_tokens: int, salt: int) -> list[int]:
    from nodeagent.bench.workload import FILLER

    text = f"[{salt}] " + FILLER * (n_tokens // 20 + 2)
    return session.tokenize(text)[:n_tokens]


def speeds(runner: Any, lengths: list[int], gen_tokens: int) -> list[dict[str, Any]]:
    """Prompt tokens/s, generation tokens/s after that prompt, and the time to the first token, per length."""
    session = runner.session
    out = []
    for i, n in enumerate(lengths):
        if n + gen_tokens > session.ctx_per_slot:
            continue
        prompt = prompt_of(session, n, i)
        session.reset()
        t0 = time.perf_counter()
        logits = session.prefill(prompt)
        t1 = time.perf_counter()
        token = int(logits.argmax())
        for _ in range(gen_tokens):
            logits = session.eval([token])
            token = int(logits.argmax())
        t2 = time.perf_counter()
        per_token = (t2 - t1) / gen_tokens
        out.append({"prompt_tokens": n, "prompt_tps": round(n / (t1 - t0), 1),
                    "gen_tps": round(gen_tokens / (t2 - t1), 2), "ttft_s": round(t1 - t0 + per_token, 4)})
    session.reset()
    return out


def chat_messages(i: int) -> list[dict[str, str]]:
    from nodeagent.bench.workload import tickets

    return [{"role": "user", "content": f"Write a short reply to this customer: {tickets(i + 1, seed=11)[i]}"}]


def overhead_prompts(node: Any, rounds: int) -> list[str]:
    from nodeagent.tasks.prompts import render_prompt

    return [render_prompt(node.runner().session, chat_messages(i)).text for i in range(rounds)]


def run_phase(spec: dict[str, Any]) -> dict[str, Any]:
    from nodeagent.bench.workload import ROUTES, TICKET_SCHEMA, tickets
    from nodeagent.node import make_task
    from nodeagent.tasks.schema import validate_output

    slots = spec["slots"]
    node = _node(spec, slots=slots)
    plan = node.plan
    runner = node.runner()
    out: dict[str, Any] = {"slots": slots, "plan": plan.model_dump(mode="json"), "load_s": None}
    if spec.get("probes"):
        out["speeds"] = speeds(runner, spec["lengths"], spec["gen_tokens"])
        times = []
        for i in range(spec["overhead_rounds"]):
            t = time.perf_counter()
            r = node.chat(chat_messages(i), max_tokens=spec["gen_tokens"], temperature=0.0)
            times.append({"s": time.perf_counter() - t, "prompt_tokens": r.prompt_tokens,
                          "completion_tokens": r.completion_tokens})
        out["chat"] = times
    texts = tickets(spec["tasks"] + 1)
    kinds = {"extract": lambda text: make_task("extract", input=text, schema=TICKET_SCHEMA),
             "classify": lambda text: make_task("classify", input=text, labels=ROUTES)}
    out["tasks"] = {}
    for kind, make in kinds.items() if spec["tasks"] else ():
        node.run(make(texts[-1]))  # warm: the prompt's shared prefix is in the cache, as on a serving node
        t = time.perf_counter()
        with ThreadPoolExecutor(slots) as pool:
            results = list(pool.map(lambda text: node.run(make(text)), texts[:-1]))
        wall = time.perf_counter() - t
        valid = sum(r.status == "ok" and (kind != "extract" or validate_output(TICKET_SCHEMA, r.output) is None)
                    for r in results)
        out["tasks"][kind] = {"tasks": len(results), "valid": valid, "wall_s": round(wall, 3),
                              "per_min": round(len(results) / wall * 60, 1),
                              "generated_tokens": sum(r.tokens.generated for r in results),
                              "prompt_tokens": round(sum(r.tokens.prompt for r in results) / len(results)),
                              "errors": sorted({r.error.code for r in results if r.error})}
    mem = process_memory()
    out["memory"] = {"planned_bytes": plan.memory.total_bytes, "peak_rss_bytes": mem.peak_rss_bytes,
                     "rss_bytes": mem.rss_bytes, "anon_bytes": mem.anon_bytes, "file_bytes": mem.file_bytes,
                     "process_start_bytes": START.rss_bytes}
    out["prompts"] = overhead_prompts(node, spec["overhead_rounds"]) if spec.get("probes") else []
    node.close()
    return out


def raw_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """The chat completions of the run phase through llama-cpp-python alone, on the plan's settings."""
    from nodeagent.backends.llamacpp import open_llama
    from nodeagent.planner.types import Settings

    llm = open_llama(Settings.model_validate(spec["settings"]))
    times = []
    for prompt in spec["prompts"]:
        t = time.perf_counter()
        r = llm.create_completion(prompt, max_tokens=spec["gen_tokens"], temperature=0.0, top_k=1)
        times.append({"s": time.perf_counter() - t, "prompt_tokens": r["usage"]["prompt_tokens"],
                      "completion_tokens": r["usage"]["completion_tokens"]})
    llm.close()
    out: dict[str, Any] = {"chat": times}
    if spec.get("scaling"):
        out["batch_scaling"] = batch_scaling(spec["scaling"]["settings"], spec["scaling"]["sequences"],
                                             spec["scaling"]["steps"], spec["scaling"].get("prompt_tokens", 12))
    return out


@contextlib.contextmanager
def bindings(s: dict[str, Any], n_seq_max: int, prompt_tokens: int,
             batch_tokens: int) -> Iterator[tuple[Callable[[list[tuple[int, int, int, bool]]], None], Any, list[int]]]:
    """llama-cpp-python's bindings alone (no nodeagent code in the loop) on a plan's settings with ``n_seq_max``
    sequences, a prompt of ``prompt_tokens`` read into sequence 0: yields ``decode`` (one llama_decode of
    (token, position, sequence, logits) entries, at most ``batch_tokens``), the KV memory and the prompt."""
    import llama_cpp

    from nodeagent.backends.llamacpp import open_llama
    from nodeagent.bench.workload import FILLER
    from nodeagent.planner.types import Settings

    settings = Settings.model_validate(s)
    llm = open_llama(settings.model_copy(update={"n_seq_max": n_seq_max}))
    ctx, mem = llm.ctx, llama_cpp.llama_get_memory(llm.ctx)
    prompt = llm.tokenize(FILLER.encode() * (prompt_tokens // 20 + 2))[:max(1, prompt_tokens)]
    chunk = min(len(prompt), settings.n_batch)
    batch = llama_cpp.llama_batch_init(max(batch_tokens, chunk), 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    try:
        llama_cpp.llama_memory_clear(mem, True)
        for start in range(0, len(prompt), chunk):
            part = prompt[start:start + chunk]
            decode([(t, start + i, 0, i == len(part) - 1) for i, t in enumerate(part)])
        yield decode, mem, prompt
    finally:
        llama_cpp.llama_batch_free(batch)
        llm.close()


def median_step_s(keys: list[int], steps: int, run: Callable[[int, int], None],
                  after: Callable[[int], None]) -> dict[int, float]:
    """Seconds per step for each key: ``run(key, step)`` ``steps`` times, then ``after(key)``; the keys in turn three
    times and the median kept (drift on a shared machine evens out)."""
    times: dict[int, list[float]] = {k: [] for k in keys}
    for _ in range(3):
        for k in keys:
            t = time.perf_counter()
            for step in range(steps):
                run(k, step)
            times[k].append((time.perf_counter() - t) / steps)
            after(k)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def batch_scaling(s: dict[str, Any], counts: list[int], steps: int, prompt_tokens: int = 12) -> list[dict[str, Any]]:
    """llama.cpp's own gain from decoding sequences together, the ceiling of what slots can gain: ``steps``
    llama_decode calls each carrying one token (and its logits) for each of N sequences, on the settings of the
    plan with the most slots, through llama-cpp-python's bindings alone (no nodeagent code in the loop), the
    counts in turn three times and the median kept. The sequences first share a prompt of ``prompt_tokens``
    (the workload's length; the slots share their prompts' prefix cells too): attention over the cells costs
    each step its share, on a CPU as much as a few sequences' weights."""
    import llama_cpp

    with bindings(s, max(s.get("n_seq_max", 1), *counts), prompt_tokens, max(counts)) as (decode, mem, prompt):
        for seq in range(1, max(counts)):  # the others share its cells, as slots share a prompt's prefix
            llama_cpp.llama_memory_seq_cp(mem, 0, seq, 0, len(prompt))

        def rm(n: int) -> None:
            for seq in range(n):
                llama_cpp.llama_memory_seq_rm(mem, seq, len(prompt), -1)

        per_step = median_step_s(counts, steps, lambda n, step: decode(
            [(prompt[step % len(prompt)], len(prompt) + step, seq, True) for seq in range(n)]), rm)
    out = [{"sequences": n, "s_per_step": round(per_step[n], 6), "tokens_per_s": round(n / per_step[n], 1)}
           for n in counts]
    base = out[0]["tokens_per_s"]
    return [{**o, "speedup": round(o["tokens_per_s"] / base, 3)} for o in out]


def draft_phase(spec: dict[str, Any]) -> dict[str, Any]:
    from nodeagent.bench.workload import TICKET_SCHEMA, tickets
    from nodeagent.config import MAX_DRAFT_TOKENS
    from nodeagent.node import make_task
    from nodeagent.planner.drafts import choose_draft, step_cost

    node = _node(spec, slots=1)
    plan = node.plan
    sizes = [1 + k for k in (0, 1, 2, 4, 8, MAX_DRAFT_TOKENS)]
    costs = on_a_thread(step_costs, plan.settings.model_dump(mode="json"), sizes, spec["steps"],
                        spec.get("prompt_tokens", 200))
    by_tokens = {c["tokens"]: c["s_per_step"] for c in costs}
    runner = node.runner()
    texts = tickets(spec["tasks"], seed=11)
    node.run(make_task("extract", input=texts[0], schema=TICKET_SCHEMA))  # the prompt's prefix in the cache
    runner.decoding = replace(runner.decoding, draft_tokens=0)
    steps, generation_s, tokens = runner.steps, 0.0, 0
    for text in texts:
        r = node.run(make_task("extract", input=text, schema=TICKET_SCHEMA))
        generation_s, tokens = generation_s + r.timings.generation_s, tokens + r.tokens.generated
    steps = max(1, runner.steps - steps)
    overhead_s = round(max(0.0, generation_s / steps - step_cost(by_tokens, tokens / steps)), 6)
    runner.decoding = replace(runner.decoding, draft_tokens=MAX_DRAFT_TOKENS)
    runner.drafts.clear()
    for text in texts:
        node.run(make_task("extract", input=text, schema=TICKET_SCHEMA))
    drafts = list(runner.drafts)
    node.close()
    choice = choose_draft(by_tokens, drafts, MAX_DRAFT_TOKENS, overhead_s)
    return {"cost": costs, "node_step_overhead_s": overhead_s, "drafts": len(drafts),
            "drafted_tokens": sum(n for n, _ in drafts), "kept_tokens": sum(k for _, k in drafts),
            "draft_log": [list(d) for d in drafts], "draft_tokens": choice.draft_tokens,
            "gain": round(choice.gain, 3), "reason": choice.reason}


def on_a_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a thread of its own that ends with it. llama.cpp's OpenMP build keeps a thread team for
    each thread that calls it, alive while that thread is: a team left on this thread would slow every step the
    node's engine thread makes after it (two teams on the same cores, about 2x here)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # raised again on the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="bench-bindings")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def step_costs(s: dict[str, Any], sizes: list[int], steps: int, prompt_tokens: int) -> list[dict[str, Any]]:
    """Seconds per llama_decode of one sequence carrying ``n`` tokens with logits for each (a token and a draft
    of n - 1, verified), after a prompt of ``prompt_tokens``, for each n in ``sizes``: through llama-cpp-python's
    bindings alone, the sizes in turn three times and the median kept (drift on a shared machine evens out)."""
    import llama_cpp

    with bindings(s, 1, prompt_tokens, max(sizes)) as (decode, mem, prompt):
        def run(n: int, step: int) -> None:
            decode([(prompt[(step + i) % len(prompt)], len(prompt) + i, 0, True) for i in range(n)])
            llama_cpp.llama_memory_seq_rm(mem, 0, len(prompt), -1)

        per_step = median_step_s(sizes, steps, run, lambda n: None)
    one = per_step.get(1)
    return [{"tokens": n, "s_per_step": round(per_step[n], 6), "relative": round(per_step[n] / one, 3) if one
             else None} for n in sizes]


def prefix_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """A prompt of each length read from its tokens (its prefill), against the same prompt's state written to disk
    (``backends/prefix_store.py``) and read back, its file's pages first dropped from the page cache, into an
    empty slot (a restore): what `plan` weighs a warm prefix by (``store/measured.py``)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="nodeagent-bench-prefixes-") as scratch:
        os.environ["NODEAGENT_PREFIX_DIR"] = scratch  # (this process is the phase's alone)
        os.environ.pop("NODEAGENT_DETERMINISTIC", None)
        node = _node(spec, slots=1)
        session = node.runner().session
        store = node.prefix_store(wait_s=300)
        if store is None or not hasattr(session, "state"):
            node.close()
            return {"kept": False, "lengths": []}
        out = []
        for i, n in enumerate(spec["lengths"]):
            if n + 2 > session.ctx_per_slot:
                continue
            prompt = prompt_of(session, n, 100 + i)
            session.reset()
            started = time.perf_counter()
            session.prefill(prompt)
            prefill_s = time.perf_counter() - started
            state = session.state(prompt)
            if state is None:
                continue
            started = time.perf_counter()
            path = store.write(prompt, state)
            write_s = time.perf_counter() - started
            cold = drop_page_cache(str(path))
            session.reset()
            before = store.tally.restored, store.tally.restore_s
            session.prefill([*prompt, prompt[-1]])  # shares the whole prompt: read back, one token evaluated
            restored = store.tally.restored > before[0]
            restore_s = store.tally.restore_s - before[1]
            out.append({"prompt_tokens": len(prompt), "prefill_s": round(prefill_s, 4),
                        "prefill_tps": round(len(prompt) / prefill_s, 1), "state_bytes": len(state),
                        "bytes_per_token": round(len(state) / len(prompt)), "write_s": round(write_s, 4),
                        "restored": restored, "restore_s": round(restore_s, 4) if restored else None,
                        "cache_dropped": cold,
                        "prefill_over_restore": round(prefill_s / restore_s, 1) if restored and restore_s else None})
        node.close()
    return {"kept": True, "lengths": out}


PHASES = {"load": load_phase, "run": run_phase, "raw": raw_phase, "drafts": draft_phase, "prefixes": prefix_phase}


def main() -> None:
    spec = json.loads(sys.argv[1])
    print(json.dumps(PHASES[spec["phase"]](spec)))


if __name__ == "__main__":
    main()
