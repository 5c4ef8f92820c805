"""`nodeagent bench [MODEL]`: load time, speeds, tasks per minute at 1, 2, 4 and 8 slots, memory against the
plan, and the agent's overhead against llama-cpp-python alone, on this device's planned settings, with the
device's heat and throttling around each phase; `--sustained DURATION`: tasks and tokens per second per minute
under sustained work, with the temperature and throttle flags."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from nodeagent.cli.common import App, json_option
from nodeagent.errors import UsageError
from nodeagent.output import print_json, print_pairs

DEFAULT_MODEL = "smollm2-135m-instruct"
GENERATOR_CTX = 2048  # a generator's context per slot in every run, unless --ctx says otherwise


@click.command("bench")
@click.argument("model", required=False)
@click.option("--quick", is_flag=True, help="About a minute: fewer tasks, shorter prompts.")
@click.option("--ctx", "ctx_tokens", type=click.IntRange(min=256), default=None,
              help="Context per slot for every run (default 2048; an embedding model's own, as trained).")
@click.option("--slots", "slot_counts", metavar="N,N,...", default="1,2,4,8", show_default=True,
              help="The slot counts to measure tasks per minute at; 1, the baseline each speedup is over, is "
                   "always measured.")
@click.option("--save", "save_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Also write JSON, markdown and PNG plots (with the plots extra) into this folder.")
@click.option("--apply", "apply", is_flag=True, help="Write the recommended slot count into the config file; the "
                                                     "next plans cite the measurement.")
@click.option("--sustained", "sustained", metavar="DURATION",
              help="Instead: serve the workload for DURATION (20s, 5m, 1h) on the planned slots and report tasks/s "
                   "and tokens/s per window with the temperature and throttle flags, and the last window over the "
                   "first (any backend, the fake one too).")
@click.option("--window", "window", metavar="DURATION", default="60s", show_default=True,
              help="With --sustained: the reporting window.")
@click.option("--cooldown", "cooldown_s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Seconds to wait before each phase after the first (as llama-bench --delay), so one phase's heat "
                   "does not carry into the next; with --sustained, before the run.")
@json_option
@click.pass_obj
def command(app: App, model: str | None, quick: bool, ctx_tokens: int | None, save_dir: Path | None, apply: bool,
            sustained: str | None, window: str, cooldown_s: float, slot_counts: str, as_json: bool) -> None:
    """Benchmark a model on this device (default: the SmolLM2 test model, `nodeagent models fetch-test`).

    Each phase runs in a fresh process: load with mmap on and off, from a cold and a warm page cache; prompt and
    generation tokens/s and time to first token at several prompt lengths; extraction and classification
    tasks per minute at 1, 2, 4 and 8 slots, every output validated; the peak memory against the plan; and the
    same chat completions through llama-cpp-python alone, for the agent's overhead as a ratio. The tasks per
    second are kept in the state directory, where the node's registration reads them for the scheduler.

    On an embedding model: embeddings/s in tasks of 1, 8 and 64 texts, tasks of one text one at a time and in
    flight together (sharing forward batches), and the plan's memory against the peak.
    """
    from nodeagent.bench.run import BenchSpec, bench, save, summary_rows
    from nodeagent.config import apply_setting
    from nodeagent.hardware.health import reader_for
    from nodeagent.store.measured import remember

    if model is None:
        from nodeagent.store.pkgindex import test_model_path

        model = str(test_model_path(DEFAULT_MODEL, app.config.test_models_dir))
    config = app.config
    reader = reader_for(config.hardware_fixture, str(config.model_dir), config.state_dir)
    if sustained is not None:
        if apply:
            raise UsageError("--apply takes the full bench's recommendation; --sustained makes none",
                             hint="drop --apply, or --sustained")
        _sustained(app, reader, model, ctx_tokens, sustained, window, cooldown_s, save_dir, as_json)
        return
    node = app.node(model, task="classify", ctx_tokens=ctx_tokens)
    if node.kind.generates and ctx_tokens is None:
        ctx_tokens = GENERATOR_CTX
        node = app.node(model, task="classify", ctx_tokens=ctx_tokens)
    p = node.plan
    if p.backend != "llamacpp":
        raise UsageError(f"bench measures GGUF models through llama.cpp; {model} plans for {p.backend}",
                         hint="give a .gguf model")
    if not node.device.here:
        raise UsageError("bench measures this machine; drop --profile")
    if "://" in p.model or not Path(p.model).is_file():
        raise UsageError(f"{model} is not on this machine", hint=f"run 'nodeagent pull {model}'")

    if node.kind.ranks:
        raise UsageError(f"{Path(p.model).name} is a reranker: bench measures models that generate or embed",
                         hint="time /v1/rerank or 'nodeagent run rerank' on it instead")
    if node.kind.embeds:
        _embeddings(node, apply, save_dir, as_json)
        return
    reader.full(measure=True)  # the model folder's read speed, once per device (what a cold load reads at)
    result = bench(BenchSpec(model=p.model, quick=quick, ctx_tokens=ctx_tokens, slots=_slot_counts(slot_counts)),
                   node.device, progress,
                   health=reader.read, cooldown_s=cooldown_s)
    written = (save(result, save_dir) if save_dir is not None else []) + [remember(result, app.config.state_dir,
                                                                                  applied=apply)]
    if apply:
        slots = result["recommendation"]["slots"]
        where = apply_setting(app.config.config_file, "slots", slots, model=model, model_file=p.model)
        progress(f"slots = {slots} written to {where}: {result['recommendation']['reason']}")
    for path in written:
        progress(f"wrote {path}")
    if as_json:
        print_json(result)
    else:
        print_pairs(summary_rows(result), title="nodeagent bench")


def _embeddings(node, apply: bool, save_dir: Path | None, as_json: bool) -> None:  # type: ignore[no-untyped-def]
    """`bench` on an embedding model: embeddings/s by task size and tasks in flight (``bench/embed.py``), kept in
    the state directory (the scheduler's throughput, the plan's line)."""
    from nodeagent.bench import embed
    from nodeagent.store.measured import remember

    if apply:
        raise UsageError("--apply writes a generator's measured slot count; an embedding model's tasks share its "
                         "forward batches whatever the slots", hint="drop --apply")
    try:
        result = embed.embed_bench(node, progress)
    finally:
        node.close()
    for path in (embed.save(result, save_dir) if save_dir is not None else []) + [
            remember(result, node.config.state_dir)]:
        progress(f"wrote {path}")
    if as_json:
        print_json(result)
    else:
        print_pairs(embed.rows(result), title="nodeagent bench (embeddings)")


def _slot_counts(text: str) -> tuple[int, ...]:
    """``--slots 2,4``: the counts from 1 to 64, ascending, 1 among them (the baseline)."""
    try:
        counts = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        counts = set()
    if not counts or any(not 1 <= n <= 64 for n in counts):
        raise UsageError(f"--slots {text!r}: give slot counts from 1 to 64, comma-separated",
                         hint="e.g. --slots 1,2,4,8")
    return tuple(sorted(counts | {1}))


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _sustained(app: App, reader, model: str, ctx_tokens: int | None, duration: str, window: str,  # type: ignore[no-untyped-def]
               cooldown_s: float, save_dir: Path | None, as_json: bool) -> None:
    """`bench --sustained`: the workload for DURATION on the node's planned slots, in this process."""
    from nodeagent.bench import sustained as run

    duration_s, window_s = run.parse_duration(duration), run.parse_duration(window)
    node = app.node(model, ctx_tokens=ctx_tokens)
    if not node.kind.generates:
        raise UsageError("--sustained serves the extraction and classification workload, which needs a generator",
                         hint=f"drop --sustained: bench on {model} measures its embeddings/s")
    if ctx_tokens is None:
        node = app.node(model, ctx_tokens=GENERATOR_CTX)
    if not node.device.here:
        raise UsageError("bench measures this machine; drop --profile")
    progress(f"sustained: {node.plan.backend} {node.model} on {node.plan.settings.slots} slots for {duration_s:g} s")
    try:
        result = run.sustained(node, duration_s, window_s, reader.read, cooldown_s, progress)
    finally:
        node.close()
    for path in run.save(result, save_dir) if save_dir is not None else []:
        progress(f"wrote {path}")
    if as_json:
        print_json(result)
    else:
        print_pairs(run.rows(result), title="nodeagent bench --sustained")
