"""PNG plots of a bench result (matplotlib, the optional ``plots`` extra).

- tokens/s against the prompt's length (prompt and generation);
- memory against context for each KV type: the planner's prediction, with the measured peaks of the run;
- planned against measured memory at each slot count;
- tasks per minute against slots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

MIB = 1 << 20


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(result: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    title = f"{Path(result['model_file']).name} on {result['profile']}"
    paths = []
    sp = result["speeds"]
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [s["prompt_tokens"] for s in sp]
    ax.plot(x, [s["gen_tps"] for s in sp], "o-", label="generation")
    ax2 = ax.twinx()
    ax2.plot(x, [s["prompt_tps"] for s in sp], "s--", color="tab:orange", label="prompt")
    ax.set(xlabel="prompt tokens (context filled)", ylabel="generation tokens/s", title=title)
    ax2.set_ylabel("prompt tokens/s")
    fig.legend(loc="upper right")
    paths.append(_save(fig, out_dir / f"{stem}-tokens-per-s.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for kv, curve in memory_curves(result).items():
        ax.plot([c for c, _ in curve], [b / MIB for _, b in curve], "o-", label=f"planned, KV {kv}")
    s = result["slots"]
    ax.scatter([r["n_ctx"] for r in s], [r["memory"]["peak_rss_bytes"] / MIB for r in s], color="black", zorder=3,
               label="measured peak (the runs' plans)")
    ax.set(xscale="log", xlabel="context (cells, all slots)", ylabel="MiB", title=title)
    ax.legend()
    paths.append(_save(fig, out_dir / f"{stem}-memory-vs-context.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    n = [str(r["slots"]) for r in s]
    width = 0.38
    pos = range(len(n))
    ax.bar([p - width / 2 for p in pos], [r["memory"]["planned_bytes"] / MIB for r in s], width, label="planned")
    ax.bar([p + width / 2 for p in pos], [r["memory"]["peak_rss_bytes"] / MIB for r in s], width, label="peak RSS")
    ax.set_xticks(list(pos), n)
    ax.set(xlabel="slots", ylabel="MiB", title=title)
    ax.legend()
    paths.append(_save(fig, out_dir / f"{stem}-planned-vs-measured.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in ("extract", "classify"):
        ax.plot([r["slots"] for r in s], [r["tasks"][kind]["per_min"] for r in s], "o-", label=kind)
    ax.set(xlabel="slots", ylabel="tasks per minute", title=title, xticks=[r["slots"] for r in s])
    ax.legend()
    paths.append(_save(fig, out_dir / f"{stem}-tasks-vs-slots.png"))
    return paths


def memory_curves(result: dict[str, Any]) -> dict[str, list[tuple[int, int]]]:
    """The planner's total at contexts 512-8192 for each KV type, on the one-slot plan's other settings."""
    from nodeagent.config import resolve
    from nodeagent.node import Node

    one = result["plans"]["1"]
    out: dict[str, list[tuple[int, int]]] = {}
    for kv in ("f16", "q8_0", "q4_0"):
        curve = []
        for ctx in (512, 1024, 2048, 4096, 8192):
            node = Node(one["model"], config=resolve(env={}), ctx_tokens=ctx, type_k=kv, type_v=kv, slots=1,
                        flash_attn=True, mmap=one["settings"]["use_mmap"], task="classify")
            curve.append((ctx, node.plan.memory.total_bytes))
        out[kv] = curve
    return out


def plot_sustained(result: dict[str, Any], path: Path) -> Path:
    """A sustained run: tasks/s and tokens/s per window (both from 0), with the temperature (where read) on a third
    axis and the windows where the device throttled shaded."""
    w = result["windows"]
    unit, per = ("minutes", 60.0) if result["duration_s"] >= 300 else ("seconds", 1.0)
    mid = [(x["from_s"] + x["to_s"]) / 2 / per for x in w]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    lines = ax.plot(mid, [x["tasks_per_s"] for x in w], "o-", label="tasks/s")
    ax.set(xlabel=f"{unit} into the run", ylabel="tasks/s", ylim=(0, None), xlim=(0, result["duration_s"] / per),
           title=f"{Path(result['model_file']).name} on {result['profile']}, sustained {result['duration_s']:g} s")
    ax2 = ax.twinx()
    lines += ax2.plot(mid, [x["tokens_per_s"] for x in w], "s--", color="tab:orange", label="tokens/s")
    ax2.set(ylabel="tokens/s (prompt and generated)", ylim=(0, None))
    temps = [(m, x["health"]["temperature_c"]) for m, x in zip(mid, w)
             if x["health"] and "temperature_c" in x["health"]]
    if temps:
        ax3 = ax.twinx()
        ax3.spines["right"].set_position(("axes", 1.15))
        lines += ax3.plot([m for m, _ in temps], [t for _, t in temps], "^:", color="tab:red", label="CPU °C")
        ax3.set_ylabel("CPU °C")
    for x in w:
        if x["health"] and x["health"].get("throttling"):
            ax.axvspan(x["from_s"] / per, x["to_s"] / per, color="tab:red", alpha=0.12, lw=0)
    ax.legend(lines, [ln.get_label() for ln in lines], loc="lower left")
    return _save(fig, path)
