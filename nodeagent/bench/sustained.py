"""`nodeagent bench --sustained DURATION`: the device under work for a long while, as a node serves, so heat shows.

A Pi's Arm cores throttle from 80 °C and an M-series Mac slows under sustained load: a one-minute benchmark on a
cool device says what it does for a minute. This runs the benchmark's workload (extractions and classifications
of the same tickets, in turn) on the node's planned slots, each slot a thread that takes the next task as soon as
its last one ends, for DURATION; then it reports, per window (a minute by default), the tasks and tokens
(prompt and generated) per second with the temperature, the CPU's clock and the throttle flags read at the
window's end, and the ratio of the last window to the first: below 1, the device slowed.

A task that ends after DURATION is not counted (the windows hold what finished within them). ``--cooldown S``
waits S seconds first, so the run starts from a cool device.
"""

from __future__ import annotations

import math
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

from nodeagent.bench.heat import snapshot
from nodeagent.errors import UsageError

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """``20s``, ``5m``, ``1h`` or seconds as a number -> seconds; UsageError for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"bad duration {text!r}", hint="write 20s, 5m, 1h or a number of seconds")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def sustained(node: Any, duration_s: float, window_s: float = 60.0, health: Callable[[], Any] | None = None,
              cooldown_s: float = 0.0, progress: Callable[[str], None] = lambda s: None,
              clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Run the workload on ``node`` (a loaded or loadable ``Node``) for ``duration_s`` and report it per
    ``window_s``. ``health``: a reading of the device's health, taken at the start and at each window's end."""
    from nodeagent.bench.workload import ROUTES, TICKET_SCHEMA, tickets
    from nodeagent.node import make_task
    from nodeagent.tasks.schema import validate_output

    if cooldown_s > 0:
        progress(f"cooling down {cooldown_s:g} s first")
        time.sleep(cooldown_s)
    texts = tickets(64)
    makers = [lambda t: make_task("extract", input=t, schema=TICKET_SCHEMA),
              lambda t: make_task("classify", input=t, labels=ROUTES)]
    node.run(makers[0](texts[0]))  # load, and warm the prompts' shared prefix, as on a serving node
    node.run(makers[1](texts[0]))
    slots = node.plan.settings.slots
    done: list[tuple[float, bool, int, int]] = []  # (when it ended, valid, prompt tokens, generated tokens)
    lock = threading.Lock()
    counter = [0]

    def read() -> dict[str, Any] | None:
        try:
            return snapshot(health()) if health is not None else None
        except Exception:  # noqa: BLE001  (a reading that fails leaves a gap)
            return None

    start_health = read()
    started = clock()
    end = started + duration_s

    def slot() -> None:
        while clock() < end:
            with lock:
                i = counter[0]
                counter[0] += 1
            task = makers[i % 2](texts[i % len(texts)])
            r = node.run(task)
            ended = clock()
            valid = r.status == "ok" and (i % 2 == 1 or validate_output(TICKET_SCHEMA, r.output) is None)
            if ended <= end:
                with lock:
                    done.append((ended - started, valid, r.tokens.prompt, r.tokens.generated))

    threads = [threading.Thread(target=slot, name=f"sustained-{n}", daemon=True) for n in range(slots)]
    for t in threads:
        t.start()
    n_windows = math.ceil(duration_s / window_s - 1e-9)
    readings = []
    for w in range(n_windows):
        edge = started + min(duration_s, (w + 1) * window_s)
        while clock() < edge:
            time.sleep(min(0.25, max(0.0, edge - clock())))
        readings.append(read())
        progress(f"{min(duration_s, (w + 1) * window_s):.0f} of {duration_s:.0f} s: "
                 f"{sum(1 for d in done if d[0] <= (w + 1) * window_s)} tasks")
    for t in threads:
        t.join()
    windows = []
    for w in range(n_windows):
        lo, hi = w * window_s, min(duration_s, (w + 1) * window_s)
        inside = [d for d in done if lo < d[0] <= hi or (w == 0 and d[0] == 0)]
        span = hi - lo
        prompt, generated = sum(d[2] for d in inside), sum(d[3] for d in inside)
        windows.append({"from_s": round(lo, 3), "to_s": round(hi, 3), "tasks": len(inside),
                        "valid": sum(1 for d in inside if d[1]), "tasks_per_s": round(len(inside) / span, 4),
                        "tokens_per_s": round((prompt + generated) / span, 2),
                        "generated_tokens_per_s": round(generated / span, 2), "health": readings[w]})
    full = [w for w in windows if w["to_s"] - w["from_s"] >= window_s - 1e-6] or windows
    first, last = full[0], full[-1]

    def ratio(key: str) -> float | None:
        return round(last[key] / first[key], 4) if len(full) > 1 and first[key] else None

    temps = [w["health"]["temperature_c"] for w in windows if w["health"] and "temperature_c" in w["health"]]
    throttled = sorted({t for w in windows if w["health"] for t in (w["health"].get("throttling") or [])})
    return {"schema": "nodeagent.bench.sustained/1",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": node.model,
            "model_file": node.plan.model, "backend": node.plan.backend, "quant": node.plan.quant,
            "profile": node.device.profile.id, "slots": slots, "duration_s": duration_s, "window_s": window_s,
            "cooldown_s": cooldown_s, "tasks": len(done), "valid": sum(1 for d in done if d[1]),
            "tasks_per_s": round(len(done) / duration_s, 4), "windows": windows,
            "ratio_last_to_first": {"tasks_per_s": ratio("tasks_per_s"), "tokens_per_s": ratio("tokens_per_s")},
            "health_start": start_health, "temperature_c": {"min": min(temps), "max": max(temps)} if temps else None,
            "throttling_seen": throttled}


def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The sustained run for people: a row per window, then the ratio of the last to the first."""
    out = [("model", f"{Path(result['model_file']).name} ({result['backend']}, {result['slots']} slots) on "
                     f"{result['profile']}"),
           ("run", f"{result['duration_s']:g} s in windows of {result['window_s']:g} s"
                   + (f", after {result['cooldown_s']:g} s cooling down" if result["cooldown_s"] else "")
                   + f": {result['tasks']} tasks, {result['valid']} valid")]
    for w in result["windows"]:
        h = w["health"] or {}
        heat = (f"{h['temperature_c']:g} °C" if "temperature_c" in h else "no temperature") + \
            (f", clock {h['cpu_freq_ratio']:.0%}" if "cpu_freq_ratio" in h else "") + \
            (f", throttling: {', '.join(h['throttling'])}" if h.get("throttling") else "")
        out.append((f"{w['from_s']:g}-{w['to_s']:g} s", f"{w['tasks_per_s']:.3g} tasks/s, {w['tokens_per_s']:.1f} "
                                                          f"tokens/s; {heat}"))
    r = result["ratio_last_to_first"]
    out.append(("last / first window", "one window only" if r["tasks_per_s"] is None else
                f"x{r['tasks_per_s']} tasks/s, x{r['tokens_per_s']} tokens/s"
                + (" (the device slowed)" if r["tasks_per_s"] < 0.9 else "")))
    return out


def save(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """JSON, markdown and (with matplotlib) a PNG plot under ``out_dir``, named by the model file."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^\w.-]+", "_", f"{Path(result['model_file']).stem}-sustained-{result['duration_s']:g}s")
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(f"# nodeagent bench --sustained: {Path(result['model_file']).name} on {result['profile']}\n\n"
                        f"Measured {result['created']}.\n\n| measure | result |\n| --- | --- |\n"
                        + "".join(f"| {k} | {v} |\n" for k, v in rows(result)))
    try:
        from nodeagent.bench.plots import plot_sustained
    except ImportError:  # matplotlib is an optional extra
        return paths
    return paths + [plot_sustained(result, out_dir / f"{stem}.png")]
