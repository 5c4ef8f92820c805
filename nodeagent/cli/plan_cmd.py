"""`nodeagent plan MODEL`: fit a model to this machine (or to a device profile) and explain it."""

from __future__ import annotations

import click

from nodeagent.cli.common import App, json_option
from nodeagent.output import format_bytes, print_json, print_lines, print_table
from nodeagent.planner import Plan, Requirements, plan
from nodeagent.planner.kv import KV_TYPE_SIZES
from nodeagent.procmem import process_memory
from nodeagent.profiles import check_match, get_profile
from nodeagent.store import StoreDirs, read_infos, resolve

KV_CHOICE = click.Choice(sorted(KV_TYPE_SIZES))


def process_overhead_bytes() -> int:
    """This process's memory with the runtime imported: what a serving process costs before any model."""
    try:
        import llama_cpp  # noqa: F401  (importing loads the native libraries we want counted)
    except ImportError:
        pass
    return process_memory().rss_bytes


def plan_options(fn):  # type: ignore[no-untyped-def]
    opts = [
        click.option("--profile", "profile_id", help="Plan for this device profile instead of this machine."),
        click.option("--quant", help="Only this quant of a catalog model or hub repository."),
        click.option("--task", type=click.Choice(["extract", "classify", "chat"]), help="Task type (sets the "
                     "default context)."),
        click.option("--ctx", "ctx_tokens", type=click.IntRange(min=1), help="Context length, fixed."),
        click.option("--min-ctx", "min_ctx_tokens", type=click.IntRange(min=1), help="Shortest acceptable context."),
        click.option("--type-k", type=KV_CHOICE, help="K cache type, fixed."),
        click.option("--type-v", type=KV_CHOICE, help="V cache type, fixed (quantized needs flash attention)."),
        click.option("--flash-attn/--no-flash-attn", default=None, help="Flash attention, fixed."),
        click.option("--ubatch", "n_ubatch", type=click.IntRange(min=1), help="Micro-batch size, fixed."),
        click.option("--batch", "n_batch", type=click.IntRange(min=1), help="Batch size, fixed."),
        click.option("--mmap/--no-mmap", "use_mmap", default=None, help="Memory-map the weights, fixed."),
        click.option("--swa-full/--no-swa-full", "swa_full", default=None, help="Full-size sliding-window cache."),
        click.option("--gpu-layers", "n_gpu_layers", type=click.IntRange(min=-1), help="Layers on the GPU, fixed "
                     "(-1: all)."),
        click.option("--allow-ctx-over-trained", is_flag=True, help="Allow a context beyond the trained length."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def make_plan(app: App, model: str, profile_id: str | None, quant: str | None, **fixed) -> Plan:  # type: ignore[no-untyped-def]
    cfg = app.config()
    note = None
    if profile_id:
        profile = get_profile(profile_id)
        hw = app.hardware()
        if not check_match(profile, hw)[0]:
            hw = profile.nominal_hardware()  # planning for another device: a freshly booted one of its kind
            note = (f"planned for a freshly booted {profile.id} ({format_bytes(hw.ram_total_bytes)} of RAM, all of it "
                    "available), not for this machine")
    else:
        profile, hw = app.profile(), app.hardware()
    dirs = StoreDirs.from_env(cfg["model_dir"], cfg["test_models_dir"], app.env)
    infos = read_infos(resolve(model, dirs, cfg["offline"], quant))
    threads = cfg["threads"] if cfg.source("threads") != "default" else None

    def user_set(name: str) -> bool:  # a flag, a variable or the config file: not the profile, not the default
        return not cfg.source(name).startswith(("profile", "default"))

    if user_set("ctx_tokens") and not fixed.get("ctx_tokens") and not fixed.get("min_ctx_tokens"):
        fixed["min_ctx_tokens"] = cfg["ctx_tokens"]
    if user_set("slots") and not fixed.get("slots"):
        fixed["slots"] = cfg["slots"]
    result = plan(infos, hw, profile, Requirements(**fixed), overhead_bytes=process_overhead_bytes(), threads=threads)
    return result.model_copy(update={"reasons": [note, *result.reasons]}) if note else result


def print_plan(p: Plan) -> None:
    s, m = p.settings, p.memory
    verdict = "fits" if p.fits else "DOES NOT FIT"
    print_lines([f"{verdict}: {p.model} ({p.quant}) on profile {p.profile}"])
    print_table(("setting", "value"), [
        ("n_ctx", s.n_ctx), ("type_k / type_v", f"{s.type_k} / {s.type_v}"),
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
@click.argument("model")
@plan_options
@json_option
@click.pass_obj
def command(app: App, model: str, profile_id: str | None, quant: str | None, as_json: bool, **fixed) -> None:  # type: ignore[no-untyped-def]
    """Plan MODEL (a catalog name, a .gguf file, or a hub repo) for this machine: quant, context, KV
    types, flash attention, batch sizes, GPU layers and mmap, with a memory breakdown and reasons."""
    p = make_plan(app, model, profile_id, quant, **fixed)
    if as_json:
        print_json(p)
    else:
        print_plan(p)
    if not p.fits:
        click.echo("warning: nothing fits the budget; see the reasons and alternatives", err=True)
