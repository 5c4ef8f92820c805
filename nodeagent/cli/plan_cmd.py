"""`nodeagent plan MODEL`: fit a model to this machine (or to a device profile) and explain it."""

from __future__ import annotations

from typing import get_args

import click

from nodeagent.cli.common import PLANNER_FLAGS, App, json_option, options, setting_options
from nodeagent.output import format_bytes, print_json, print_lines, print_table
from nodeagent.planner import Plan
from nodeagent.planner.types import TaskType

# The planner's settings take their flags from the settings registry (cli/common.py); the rest are the plan's
PLAN_OPTIONS = [
    click.option("--profile", "profile", help="Plan for this device profile instead of this machine (the same as "
                                              "the global --profile)."),
    click.option("--quant", help="Only this quant of a catalog model or hub repository."),
    click.option("--task", type=click.Choice(list(get_args(TaskType))), help="Task type (sets the default context)."),
    setting_options(*PLANNER_FLAGS),
    click.option("--swa-full/--no-swa-full", "swa_full", default=None, help="Full-size sliding-window cache."),
    click.option("--allow-ctx-over-trained", is_flag=True, help="Allow a context beyond the trained length."),
    click.option("--allow-ctx-over-profile", is_flag=True, help="Allow a context beyond the profile's maximum."),
]
plan_options = options(*PLAN_OPTIONS)


def print_plan(p: Plan) -> None:
    s, m = p.settings, p.memory
    verdict = "fits" if p.fits else "DOES NOT FIT"
    print_lines([f"{verdict}: {p.model} ({p.quant}) on profile {p.profile}, backend {p.backend}"])
    print_table(("setting", "value"), [
        ("n_ctx", s.n_ctx if s.slots == 1 else f"{s.n_ctx} ({s.ctx_per_slot} per slot)"), ("type_k / type_v", f"{s.type_k} / {s.type_v}"),
        ("flash_attn", s.flash_attn), ("n_gpu_layers", s.n_gpu_layers), ("use_mmap", s.use_mmap),
        ("n_batch / n_ubatch", f"{s.n_batch} / {s.n_ubatch}"), ("swa_full", s.swa_full),
        ("n_threads", s.n_threads), ("slots", s.slots),
        ("n_seq_max", s.n_seq_max)], title="Settings")
    print_table(("component", "bytes", "size"), [
        (name, f"{value:,}", format_bytes(value)) for name, value in m.model_dump().items()], title="Memory")
    b = p.budget
    print_lines([f"budget: host {format_bytes(b.host_limit_bytes)}"
                 + (f", GPU {format_bytes(b.gpu_limit_bytes)}" if b.gpu_limit_bytes else "")
                 + f", margin {format_bytes(b.margin_bytes)} ({b.source})", "reasons:"]
                + [f"  - {r}" for r in p.reasons] + (["would fit instead:"] if p.alternatives else [])
                + [f"  - {a}" for a in p.alternatives])


@click.command("plan")
@click.argument("models", nargs=-1, required=True, metavar="MODEL [MODEL...]")
@plan_options
@json_option
@click.pass_obj
def command(app: App, models: tuple[str, ...], as_json: bool, **options) -> None:  # type: ignore[no-untyped-def]
    """Plan MODEL (a catalog name, a .gguf file, a hub repo or an mlx-lm directory) for this machine: quant,
    context, KV types, flash attention, batch sizes, GPU layers and mmap, with a memory breakdown and reasons.
    Several: each one's plan and the set's against one budget (the process overhead charged once)."""
    plans = [app.node(m, **options).plan for m in models]
    if len(plans) == 1:
        p = plans[0]
        print_json(p) if as_json else print_plan(p)
        if not p.fits:
            click.echo("warning: nothing fits the budget; see the reasons and alternatives", err=True)
        return
    from nodeagent.planner.modelset import plan_set

    whole = plan_set(list(models), plans)
    if as_json:
        print_json({"models": plans, "set": whole})
        return
    print_table(("model", "quant", "ctx per slot", "slots", "plan", "adds"),
                [(m, p.quant, p.settings.ctx_per_slot, p.settings.slots, format_bytes(p.memory.total_bytes),
                  format_bytes(whole.added_bytes[m])) for m, p in zip(models, plans)], title="Models")
    verdict = "all at once" if whole.fits_together else "one at a time" if whole.fits_one_at_a_time else \
        "DOES NOT FIT"
    print_lines([f"the set: {format_bytes(whole.total_bytes)} of {format_bytes(whole.budget_bytes)}: {verdict}",
                 "reasons:"] + [f"  - {r}" for r in whole.reasons])
