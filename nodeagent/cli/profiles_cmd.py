"""`nodeagent profiles`: the device profiles nodeagent knows."""

from __future__ import annotations

import click

from nodeagent.cli.common import App, json_option
from nodeagent.output import print_json, print_table
from nodeagent.profiles import load_profiles


@click.command("profiles")
@json_option
@click.pass_obj
def command(app: App, as_json: bool) -> None:
    """List device profiles: match rules, memory budget, backends, context defaults."""
    profiles = list(load_profiles().values())
    if as_json:
        print_json(profiles)
        return
    print_table(
        ("id", "budget", "reserve+margin", "backends", "threads", "offload", "fa", "ctx default/max", "kv", "slots"),
        [(p.id, p.memory.budget, f"{p.memory.reserve_mib}+{p.memory.margin_mib} MiB", ",".join(p.runtime.backends),
          p.runtime.threads or "auto", "yes" if p.runtime.gpu_offload else "no",
          "yes" if p.runtime.flash_attn else "no",
          f"{p.context.default_ctx_tokens}/{p.context.max_ctx_tokens}", f"{p.context.type_k}/{p.context.type_v}",
          p.runtime.slots) for p in profiles],
        title="Device profiles",
    )
