"""`nodeagent probe`: what machine this is, which device profile matched, and how it is doing (its health:
heat, the CPU's clock, throttling, power, memory pressure, the clock's sync, the model folder's storage)."""

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
    if match.fell_back:
        rows.append(("fell back", match.fell_back))
    return rows


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:g} %"


def storage_row(s) -> str:  # type: ignore[no-untyped-def]
    if s is None:
        return "-"
    where = (f"{s.kind or 'kind not known'} ({s.device})" if s.device else
             f"no block device of its own ({s.key or 'not found in the mounts'})")
    if s.read_mb_s is None:
        return f"{where}; read speed not measured"
    return f"{where}; {s.read_mb_s:g} MB/s sequential read, measured: {s.method}"


def health_rows(h) -> list[tuple[str, object]]:  # type: ignore[no-untyped-def]
    """The health reading for people: every row, '-' where this platform does not offer it."""
    pi = h.pi_throttle
    power = "-" if h.power_source is None else h.power_source
    if h.battery_pct is not None:
        power += f", battery {h.battery_pct:g} % ({h.battery_status or '?'})"
    if h.low_power_mode is not None:
        power += f", Low Power Mode {'on' if h.low_power_mode else 'off'}"
    return [
        ("temperature", "-" if h.temperature_c is None else f"{h.temperature_c:g} °C ({h.temperature_sensor})"),
        ("cpu clock", "-" if h.cpu_freq_mhz is None else
         f"{h.cpu_freq_mhz:g} of {h.cpu_freq_max_mhz or '?'} MHz"
         + (f" ({h.cpu_freq_ratio:.0%})" if h.cpu_freq_ratio is not None else "")),
        ("pi throttle flags", "-" if pi is None else f"{pi.raw}: now {', '.join(pi.now) or 'none'}; since boot "
                                                      f"{', '.join(pi.since_boot) or 'none'}"),
        ("under-voltage alarm", "-" if h.undervolt_alarm is None else ("RAISED" if h.undervolt_alarm else "clear")),
        ("thermal pressure", h.thermal_pressure or "-"),
        ("power", power),
        ("memory pressure", h.memory_pressure or "-"),
        ("PSI memory (avg10)", "-" if h.psi_memory_some_avg10 is None else
         f"some {_pct(h.psi_memory_some_avg10)}, full {_pct(h.psi_memory_full_avg10)}"),
        ("PSI cpu (avg10)", "-" if h.psi_cpu_some_avg10 is None else
         f"some {_pct(h.psi_cpu_some_avg10)}, full {_pct(h.psi_cpu_full_avg10)}"),
        ("swap used", "-" if h.swap_used_bytes is None else format_bytes(h.swap_used_bytes)),
        ("clock", {True: "synchronised", False: "NOT synchronised (NTP)", None: "-"}[h.clock_synced]),
        ("model storage", storage_row(h.storage)),
    ]


@click.command("probe")
@click.option("--measure", is_flag=True, help="Measure the model folder's read speed again (it is measured once "
                                              "per device, a few seconds, and kept in the state directory).")
@json_option
@click.pass_obj
def command(app: App, measure: bool, as_json: bool) -> None:
    """Probe this device: CPU, memory, cgroup limits, Apple/Pi/GPU facts, llama.cpp support, and its health: heat,
    clock, throttling, power, memory pressure, the clock's sync, the model folder's storage (its read speed
    measured the first time)."""
    from nodeagent.hardware.health import reader_for
    from nodeagent.hardware.storage import forget

    config = app.config
    reader = reader_for(config.hardware_fixture, str(config.model_dir), config.state_dir)
    if measure and not config.hardware_fixture:
        forget(config.state_dir, reader.storage())
    health = reader.full(measure=True)  # measured once per device (a recorded machine never)
    hw, match = app.device.hardware, app.device.match
    if as_json:
        print_json({"hardware": hw, "profile": match, "health": health})
    else:
        print_pairs(probe_rows(hw, match), title="This device")
        print_pairs(health_rows(health), title="Its health now")
