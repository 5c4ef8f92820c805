"""`nodeagent bench [MODEL]`: load time, speeds, tasks per minute at 1, 2 and 4 slots, memory against the
plan, and the agent's overhead against llama-cpp-python alone, on this device's planned settings."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from nodeagent.cli.common import App, json_option
from nodeagent.errors import UsageError
from nodeagent.output import print_json, print_pairs

DEFAULT_MODEL = "smollm2-135m-instruct"


@click.command("bench")
@click.argument("model", required=False)
@click.option("--quick", is_flag=True, help="About a minute: fewer tasks, shorter prompts.")
@click.option("--ctx", "ctx_tokens", type=click.IntRange(min=256), default=2048, show_default=True,
              help="Context per slot for every run.")
@click.option("--save", "save_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Also write JSON, markdown and PNG plots (with the plots extra) into this folder.")
@click.option("--apply", "apply", is_flag=True, help="Write the recommended slot count into the config file; the "
                                                     "next plans cite the measurement.")
@json_option
@click.pass_obj
def command(app: App, model: str | None, quick: bool, ctx_tokens: int, save_dir: Path | None, apply: bool,
            as_json: bool) -> None:
    """Benchmark a model on this device (default: the SmolLM2 test model, `nodeagent models fetch-test`).

    Each phase runs in a fresh process: load with mmap on and off, from a cold and a warm page cache; prompt and
    generation tokens/s and time to first token at several prompt lengths; extraction and classification
    tasks per minute at 1, 2 and 4 slots, every output validated; the peak memory against the plan; and the
    same chat completions through llama-cpp-python alone, for the agent's overhead as a ratio. The tasks per
    second are kept in the state directory, where the node's registration reads them for the scheduler.
    """
    from nodeagent.bench.run import BenchSpec, bench, save, summary_rows
    from nodeagent.store.measured import remember
    from nodeagent.config import apply_setting

    if model is None:
        from nodeagent.store.pkgindex import test_model_path

        model = str(test_model_path(DEFAULT_MODEL, app.config.test_models_dir))
    node = app.node(model, task="classify", ctx_tokens=ctx_tokens)
    p = node.plan
    if p.backend != "llamacpp":
        raise UsageError(f"bench measures GGUF models through llama.cpp; {model} plans for {p.backend}",
                         hint="give a .gguf model")
    if not node.device.here:
        raise UsageError("bench measures this machine; drop --profile")
    if "://" in p.model or not Path(p.model).is_file():
        raise UsageError(f"{model} is not on this machine", hint=f"run 'nodeagent pull {model}'")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = bench(BenchSpec(model=p.model, quick=quick, ctx_tokens=ctx_tokens), node.device, progress)
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
