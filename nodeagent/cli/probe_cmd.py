"""`nodeagent probe`: what machine this is, and which device profile matched."""

from __future__ import annotations

import click

from nodeagent.cli.common import App, json_option
from nodeagent.output import format_bytes, print_json, print_pairs


def probe_rows(hw, match) -> list[tuple[str, object]]:  # type: ignore[no-untyped-def]
    rows: list[tuple[str, object]] = [
        ("os", f"{hw.os} {hw.os_release or ''}".strip()),
        ("arch", hw.arch),
        ("cpu", hw.cpu_model),
        ("cores", f"{hw.cores_logical} logical, {hw.cores_physical or '?'} physical"),
        ("ram", f"{format_bytes(hw.ram_total_bytes)} total, {format_bytes(hw.ram_available_bytes)} available"),
        ("swap", f"{format_bytes(hw.swap_total_bytes)} total, {format_bytes(hw.swap_free_bytes)} free"),
    ]
    if hw.cgroup:
        cg = hw.cgroup
        rows.append(("cgroup", f"memory.max {format_bytes(cg.memory_max_bytes)}, "
                               f"current {format_bytes(cg.memory_current_bytes)}, cpu {cg.cpu_max_cores or 'max'}"))
    if hw.apple:
        a = hw.apple
        rows += [("apple chip", a.chip),
                 ("p/e cores", f"{a.performance_cores or '?'} performance, {a.efficiency_cores or '?'} efficiency"),
                 ("unified memory", format_bytes(a.unified_memory_bytes)),
                 ("metal working set", f"{format_bytes(a.metal_working_set_bytes)} ({a.metal_working_set_source})")]
    if hw.raspberry_pi:
        pi = hw.raspberry_pi
        rows += [("raspberry pi", pi.model),
                 ("pi revision", f"{pi.revision} (board {pi.board}, {pi.soc}, {format_bytes(pi.ram_bytes)})")]
    for g in hw.gpus:
        rows.append((f"gpu {g.index}", f"{g.name}, {format_bytes(g.memory_total_bytes)} "
                                       f"({format_bytes(g.memory_free_bytes)} free), driver {g.driver}"))
    if hw.disk_path:
        rows.append(("disk free", f"{format_bytes(hw.disk_free_bytes)} at {hw.disk_path}"))
    lc = hw.llama_cpp
    rows.append(("llama.cpp", f"{lc.version} (gpu offload {'yes' if lc.gpu_offload else 'no'}, "
                              f"mmap {'yes' if lc.mmap else 'no'}, mlock {'yes' if lc.mlock else 'no'})"
                 if lc.installed else "not installed"))
    rows.append(("profile", f"{match.profile_id}: {'; '.join(match.reasons)}"))
    return rows


@click.command("probe")
@json_option
@click.pass_obj
def command(app: App, as_json: bool) -> None:
    """Probe this device: CPU, memory, cgroup limits, Apple/Pi/GPU facts, llama.cpp support."""
    hw, match = app.device.hardware, app.device.match
    if as_json:
        print_json({"hardware": hw, "profile": match})
    else:
        print_pairs(probe_rows(hw, match), title="This device")
