"""Warm prefixes on disk: the first task after a restart, after a swap and on a fresh slot, against a warm one.

An extraction whose instructions are a long prefix (about 300, 1,000 and 3,000 tokens), on SmolLM2 135M and
Gemma 3 270M (and the synthetic 1B model, ``--models synthetic``, whose prefill rate here is closest to a Pi's):

- **fresh**: a node's first task with nothing stored (the prefix read from its tokens);
- **warm**: a task whose prefix the slot holds in memory (the node's third under the same instructions; the second
  found the prefix recurring and stored it on disk);
- **swap**: the model closed and loaded again in the same process (as a node of several models swaps), then a task:
  the prefix read back from disk;
- **restart**: a new process on the same prefix directory, then a task: the prefix read back from disk.

Each is the task's whole time (``timings.total_s``: the prompt, the answer, its validation), and its prompt's. Each
node first runs a task of other, short instructions with the same schema, so that what else a node's first task
pays (compiling the schema's grammar) is paid and the figures differ by the prefix alone. Target: the first task
with the prefix after a swap or a restart at most 1.2x a warm task's time. The outputs after a restart and a swap
are compared with the warm task's on the same ticket: token for token at temperature 0. The stored state's size is
set beside the prefill it replaces, here and on a Pi 5 and a Pi 4 as their profiles predict (the state read at the
profile's SD card, the prefix's tokens at its published prompt rate).

Usage: python benchmarks/warm_prefixes.py [--models smollm2,gemma3] [--prefixes 300,1000,3000]
   -> benchmarks/results/warm_prefixes.json and .md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import write_results  # noqa: E402

SCHEMA = {"type": "object", "properties": {"product": {"type": "string", "maxLength": 40},
                                           "issue": {"type": "string", "maxLength": 60},
                                           "urgent": {"type": "boolean"}},
          "required": ["product", "issue", "urgent"], "additionalProperties": False}
TICKETS = ["My Pi 5 will not boot since this morning, please help fast.",
           "The keyboard I bought last week has a sticky space bar.",
           "Order 5512: the SD card arrived cracked, I need a new one today.",
           "Monitor flickers when the laptop charger is plugged in."]
RULES = ["Name the product as the customer names it, without brand slogans or model years.",
         "An issue is what is wrong, in a few plain words, never the customer's mood.",
         "A ticket is urgent when the customer cannot work, asks for today, or a safety risk is named.",
         "Orders, serial numbers and prices are not products; leave them out of every field.",
         "When two products are named, the one that fails is the product; the other is context.",
         "Shipping damage is an issue of the product that arrived damaged, not of the courier.",
         "A question about how to use a product is not urgent unless the customer says it blocks them.",
         "Refund requests name the product they are about; the refund itself is not the issue.",
         "Write fields in English even when the ticket mixes languages, keeping product names as written.",
         "Ignore greetings, signatures, quoted earlier messages and disclaimers at the end of an email."]


WARM_UP = "Fill in the form."  # a node's first task, of other instructions: no prefix of the measured ones


def instructions(n_tokens: int, count) -> str:  # noqa: ANN001
    """Extraction guidance of about ``n_tokens`` tokens (``count``: the model's token count of a text)."""
    parts = ["You read support tickets for a hardware shop and fill in the form for the repair desk."]
    i = 0
    while count(" ".join(parts)) < n_tokens:
        parts.append(f"Rule {i + 1}: {RULES[i % len(RULES)]}")
        i += 1
    return " ".join(parts)


def model_path(name: str) -> Path:
    from nodeagent.config import resolve
    from nodeagent.store.pkgindex import test_model_path

    config = resolve(env=dict(os.environ))
    if name == "synthetic":
        from benchmarks.synthetic_model import synthetic_model

        return synthetic_model("Q8_0", models_dir=Path(config.test_models_dir))
    ids = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma-3-270m-it"}
    return test_model_path(ids[name], Path(config.test_models_dir))


def _task(node, text: str, ticket: str) -> dict:  # noqa: ANN001
    r = node.extract(ticket, SCHEMA, instructions=text)
    if r.status != "ok":
        raise SystemExit(f"an extraction failed: {r.error}")
    return {"total_s": r.timings.total_s, "prompt_s": r.timings.prompt_s, "prompt_tokens": r.tokens.prompt,
            "output": r.output, "generated": r.tokens.generated}


def child(model: str, prefix_tokens: int, phase: str) -> dict:
    """One process's part: ``first`` (fresh, the prefix stored, warm, then a swap) or ``restart``."""
    from nodeagent.config import resolve
    from nodeagent.node import Node

    config = resolve(env={**os.environ, "NODEAGENT_CTX": str(max(1024, prefix_tokens + 512))})
    path = str(model_path(model))
    out: dict = {}
    with Node(path, config=config) as node:
        node.load()
        text = instructions(prefix_tokens, lambda t: len(node.load().tokenize(t)))
        store = node.prefix_store(wait_s=60)
        _task(node, WARM_UP, TICKETS[3])  # what else a node's first task pays (the schema's grammar), paid
        if phase == "restart":
            out["restart"] = _task(node, text, TICKETS[2])
            out["restored"] = store.usage()
            return out
        out["fresh"] = _task(node, text, TICKETS[0])
        _task(node, text, TICKETS[1])  # the prefix recurs: stored
        out["warm"] = _task(node, text, TICKETS[2])
        store.flush()
        out["stored"] = store.usage()
        from nodeagent.modelfile import inspect_file

        out["n_params"] = inspect_file(path).n_params
    with Node(path, config=config) as node:  # a swap: the model closed and loaded again in this process
        node.load()
        store = node.prefix_store(wait_s=60)
        _task(node, WARM_UP, TICKETS[3])
        out["swap"] = _task(node, text, TICKETS[2])
        out["swap_store"] = store.usage()
    return out


def run(model: str, prefix_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NODEAGENT_PREFIX_DIR": str(Path(tmp) / "prefixes")}
        parts = {}
        for phase in ("first", "restart"):
            done = subprocess.run([sys.executable, __file__, "--child", model, str(prefix_tokens), phase],
                                  capture_output=True, text=True, env=env, timeout=1800)
            if done.returncode != 0:
                raise SystemExit(f"{model} {prefix_tokens} {phase}: {done.stderr[-2000:]}")
            parts.update(json.loads(done.stdout.strip().splitlines()[-1]))
    warm = parts["warm"]
    row = {"model": model, "prefix_tokens": prefix_tokens, "prompt_tokens": warm["prompt_tokens"],
           "state_bytes": parts["stored"]["state_bytes"], "restored_tokens": parts["restored"]["restored_tokens"],
           "restore_s": parts["restored"]["restore_s"], "n_params": parts["n_params"]}
    for k in ("fresh", "warm", "swap", "restart"):
        row[f"{k}_s"] = round(parts[k]["total_s"], 3)
        row[f"{k}_prompt_s"] = round(parts[k]["prompt_s"], 3)
    for k in ("fresh", "swap", "restart"):
        row[f"{k}_x_warm"] = round(parts[k]["total_s"] / warm["total_s"], 2)
    row["same_output"] = {k: parts[k]["output"] == warm["output"] and parts[k]["generated"] == warm["generated"]
                          for k in ("swap", "restart")}
    row["restored_both"] = parts["swap_store"]["restored"] == 1 and parts["restored"]["restored"] == 1
    return row


def markdown(d: dict) -> str:
    lines = ["# Warm prefixes on disk", "", f"{d['machine']}, {d['when']}. An extraction whose instructions are the "
             "prefix; each figure is the task's whole time (prompt, answer, validation) and, in brackets, its "
             "prompt's, one task each, after a task of other instructions on the same node. Target: after a swap or "
             "a restart at most 1.2x warm.", "",
             "| model | prompt tokens | state MB | fresh s | warm s | swap s | restart s | fresh/warm | swap/warm | "
             "restart/warm | same output |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        same = "yes" if all(r["same_output"].values()) and r["restored_both"] else f"no {r['same_output']}"
        cell = {k: f"{r[f'{k}_s']} ({r[f'{k}_prompt_s']})" for k in ("fresh", "warm", "swap", "restart")}
        lines.append(f"| {r['model']} | {r['prompt_tokens']} | {r['state_bytes'] / 1e6:.1f} | {cell['fresh']} | "
                     f"{cell['warm']} | {cell['swap']} | {cell['restart']} | {r['fresh_x_warm']} | "
                     f"{r['swap_x_warm']} | {r['restart_x_warm']} | {same} |")
    lines += ["", "The same prefixes on a Pi, as the device profiles predict them: the stored state read back at the "
              "profile's disk (`disk_read_mb_s`, an SD card) against the prompt read from its tokens at the profile's "
              "published prompt rate (`prefill_gflop_s`, 2 FLOP a parameter a token; the profiles cite their "
              "sources). Here, the restart's restore took the 'restore s' column.", "",
              "| model | prompt tokens | state MB | restore s here | " + " | ".join(
                  f"{name}: read back s | {name}: prefill s" for name, _ in PIS) + " |",
              "|---|---|---|---|" + "---|---|" * len(PIS)]
    for r in d["rows"]:
        cells = []
        for _, profile_id in PIS:
            read_s, prefill_s = on_a_pi(profile_id, r["state_bytes"], r["restored_tokens"], r["n_params"])
            cells.append(f"{read_s:.2f} | {prefill_s:.0f}")
        lines.append(f"| {r['model']} | {r['prompt_tokens']} | {r['state_bytes'] / 1e6:.1f} | {r['restore_s']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


PIS = [("Pi 5", "rpi5-8gb"), ("Pi 4", "rpi4-8gb")]


def on_a_pi(profile_id: str, state_bytes: int, tokens: int, n_params: int) -> tuple[float, float]:
    """A stored prefix's read at the profile's disk, and its tokens' prefill at the profile's prompt rate."""
    from nodeagent.planner.speed import prefill_tokens_per_s
    from nodeagent.profiles import get_profile

    profile = get_profile(profile_id)
    return (state_bytes / (profile.nominal.disk_read_mb_s * 1e6),
            tokens / prefill_tokens_per_s(n_params, profile))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--prefixes", default="300,1000,3000")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, prefix_tokens, phase = args.child
        print(json.dumps(child(model, int(prefix_tokens), phase)))
        return
    rows = [run(m, int(p)) for m in args.models.split(",") for p in args.prefixes.split(",")]
    d = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "when": time.strftime("%Y-%m-%d"), "rows": rows}
    write_results("warm_prefixes", d, markdown(d))
    print(markdown(d))


if __name__ == "__main__":
    main()
