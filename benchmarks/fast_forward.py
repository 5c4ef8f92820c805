"""Extraction at the speed of its grammar: forced tokens in the sampled token's step (``fast_forward``) and drafts
from the input verified in one step (``draft_tokens``), against one model step per token, on the same
extractions, taking turns in one run.

Modes: ``off`` (neither), ``forced`` (forced tokens only), ``drafts`` (drafts only), ``on`` (both). The draft
length is the one `nodeagent bench`'s drafts phase chooses for the model on this machine (run here first, in a
process of its own, and reported: a step's cost by its tokens, what the model kept); where it finds that drafts
do not pay, the ``drafts`` and ``on`` modes use drafts of ``--draft-tokens`` anyway, to show what they cost, and
the node itself runs ``forced``.

The inputs are contact cards whose seven true values are known (name, age, city, email, company, role, phone;
generated, seeded), so the benchmark also reports field accuracy against the truth for each mode: the fast path
must not cost correctness. For each model and slot count, one node; the modes alternate batch by batch on it
(same KV cache, same load on a shared machine). Per mode: extraction tasks/s (at 4 slots, four tasks at once on
the node's slots), the model steps per output token, the share of output tokens forced, schema-valid outputs,
outputs identical to the plain decode's, fields right.

The synthetic model (``synthetic``: TinyLlama's shape with random weights, benchmarks/synthetic_model.py) writes
noise, so its fields are never right; it is there for the speed of a bandwidth-bound 1B model.

Usage: python benchmarks/fast_forward.py [--models smollm2,gemma,synthetic] [--slots 1,4] [--items 24]
       [--rounds 2] [--synthetic-slots 1,4] [--draft-tokens 4]
   -> benchmarks/results/fast_forward.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# OMP_WAIT_POLICY is left as the node runs (unset): PASSIVE adds a fixed wake-up cost to every step
# (benchmarks/results/contention.md), which would flatter anything that saves steps.

from benchmarks.results_io import write_results  # noqa: E402
from nodeagent.config import resolve  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma-3-270m-it"}
CONTACT = {"type": "object", "additionalProperties": False,
           "required": ["name", "age", "city", "email", "company", "role", "phone"],
           "properties": {"name": {"type": "string", "maxLength": 60}, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 120},
                          "city": {"type": "string", "maxLength": 40}, "email": {"type": "string", "maxLength": 60},
                          "company": {"type": "string", "maxLength": 40}, "role": {"type": "string", "maxLength": 40},
                          "phone": {"type": "string", "maxLength": 24}}}
FIRST = ["Alice", "Bruno", "Chloé", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kemal", "Lena"]
LAST = ["Martin", "Rossi", "Nowak", "Tanaka", "Silva", "Berg", "Okafor", "Dubois", "Kim", "Novak"]
CITIES = ["Paris", "Lisbon", "Kraków", "Osaka", "Bogotá", "Tromsø", "Nairobi", "Leeds", "Graz"]
COMPANIES = ["Acme Robotics", "Blue Fern Labs", "Northwind", "Kite & Co", "Orbital Foods", "Pinecone Systems"]
ROLES = ["data engineer", "head of sales", "nurse", "CTO", "product designer", "teacher", "accountant"]


def contact_cards(n: int, seed: int = 5) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        truth = {"name": f"{first} {last}", "age": rng.randint(21, 70), "city": rng.choice(CITIES),
                 "email": f"{first.lower()}.{last.lower()}@example.org", "company": rng.choice(COMPANIES),
                 "role": rng.choice(ROLES), "phone": f"+{rng.randint(30, 49)} {rng.randint(100, 999)} "
                                                    f"{rng.randint(1000, 9999)}"}
        text = (f"Met {truth['name']} ({truth['age']}) at the {truth['city']} fair. {first} works as "
                f"{truth['role']} at {truth['company']}; reach them at {truth['email']} or {truth['phone']}.")
        out.append((text, truth))
    return out


class Counting:
    """The decoder's own counts (tokens, forced tokens, model steps), summed per mode: wraps tasks.runner.decode."""

    def __init__(self) -> None:
        import nodeagent.tasks.runner as runner_mod

        self.mod, self.inner = runner_mod, runner_mod.decode
        self.lock = threading.Lock()
        self.sums = dict.fromkeys(COUNTS, 0)
        runner_mod.decode = self

    def __call__(self, *args, **kwargs):
        d = self.inner(*args, **kwargs)
        with self.lock:
            for k, v in zip(COUNTS, (len(d.tokens), d.forced, d.steps, d.drafted, d.accepted)):
                self.sums[k] += v
        return d

    def take(self) -> dict:
        with self.lock:
            out, self.sums = self.sums, dict.fromkeys(COUNTS, 0)
        return out


COUNTS = ("tokens", "forced", "steps", "drafted", "accepted")
MODES = {"off": (False, False), "forced": (True, False), "drafts": (False, True), "on": (True, True)}


def model_path(key: str) -> Path:
    if key.startswith("synthetic"):  # TinyLlama's shape, random Q8_0 weights: bandwidth-bound as a 1B model is
        from benchmarks.synthetic_model import synthetic_model

        return synthetic_model("Q8_0")
    return test_model_path(MODELS[key], resolve(env=dict(os.environ))["test_models_dir"])


def bench_drafts(path: Path, tasks: int) -> dict:
    """`nodeagent bench`'s drafts phase for the model, in a process of its own (as bench runs it)."""
    spec = {"phase": "drafts", "model": str(path), "ctx_tokens": 2048, "tasks": tasks, "steps": 24}
    proc = subprocess.run([sys.executable, "-m", "nodeagent.bench.phase", json.dumps(spec)], capture_output=True,
                          text=True, check=True, cwd=ROOT)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.pop("draft_log")
    return out


def measure(key: str, slots: int, items: int, rounds: int, draft_tokens: int, counting: "Counting") -> dict:
    from nodeagent.node import Node
    from nodeagent.tasks.contracts import ExtractTask

    path = model_path(key)
    node = Node(str(path), config=resolve(env={}), task="extract", slots=slots)
    runners = node._ensure_runners()
    cards = contact_cards(items)
    got: dict[str, dict] = {m: {"seconds": [], "outputs": {}, "valid": 0, "fields_right": 0, "counts": []}
                            for m in MODES}

    def one(i: int) -> tuple[int, object]:
        text, _ = cards[i]
        return i, node.run(ExtractTask(input=text, schema=CONTACT))

    node.run(ExtractTask(input=cards[0][0], schema=CONTACT))  # loaded, the prompt's prefix cached
    counting.take()
    with ThreadPoolExecutor(slots) as pool:
        for r in range(rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                for runner in runners:
                    runner.decoding = replace(runner.decoding, fast_forward=MODES[mode][0],
                                              draft_tokens=draft_tokens if MODES[mode][1] else 0)
                started = time.perf_counter()
                results = list(pool.map(one, range(items)))
                got[mode]["seconds"].append(time.perf_counter() - started)
                got[mode]["counts"].append(counting.take())
                if r == 0:
                    for i, res in results:
                        ok = res.status == "ok"
                        got[mode]["outputs"][i] = json.dumps(res.output, sort_keys=True) if ok else None
                        got[mode]["valid"] += ok
                        if ok:
                            truth = cards[i][1]
                            got[mode]["fields_right"] += sum(str(res.output.get(k)).strip().lower() ==
                                                             str(v).strip().lower() for k, v in truth.items())
    node.close()
    out = {"model": path.name, "slots": slots, "items": items, "rounds": rounds, "draft_tokens": draft_tokens,
           "fields": items * len(CONTACT["required"])}
    for mode in MODES:
        g = got[mode]
        c = {k: sum(x[k] for x in g["counts"]) for k in COUNTS}
        secs = statistics.median(g["seconds"])
        share = lambda n: round(n / c["tokens"], 3) if c["tokens"] else 0.0  # noqa: E731
        out[mode] = {"tasks_per_s": round(items / secs, 3), "seconds_median": round(secs, 2),
                     "seconds": [round(s, 2) for s in g["seconds"]], "valid": g["valid"],
                     "fields_right": g["fields_right"], "forced_share": share(c["forced"]),
                     "drafted_share": share(c["drafted"]), "accepted_share": share(c["accepted"]),
                     "acceptance": round(c["accepted"] / c["drafted"], 3) if c["drafted"] else None,
                     "steps_per_token": share(c["steps"]),
                     "identical_to_off": sum(g["outputs"][i] == got["off"]["outputs"][i] for i in range(items)),
                     "speedup": None}
    for mode in MODES:
        out[mode]["speedup"] = round(out[mode]["tasks_per_s"] / out["off"]["tasks_per_s"], 3)
    out["fields_right_se"] = round(_se(got["off"]["fields_right"], out["fields"]), 2)
    return out


def _se(right: int, n: int) -> float:
    """The standard error of a fields-right count of ``n`` fields (a binomial over the fields)."""
    p = right / n if n else 0.0
    return (n * p * (1 - p)) ** 0.5


def markdown(d: dict) -> str:
    lines = ["# Extraction at the speed of its grammar: forced tokens and drafts from the input", "",
             f"Measured on {d['machine']}, {d['when']}. Contact-card extractions (7 fields, true values known), "
             "the modes taking turns batch by batch on one node (off: neither; forced: forced tokens in the sampled "
             "token's step; drafts: drafts from the input; on: both); tasks/s is the median batch's, the speed-up "
             "against off in the same run.", "",
             "## What `nodeagent bench` measured of drafts here", "",
             "| model | a step of 1 + k tokens, against 1 (k = 1, 2, 4, 8, 16) | drafted tokens kept | draft length "
             "chosen | its reason |", "| --- | --- | ---: | ---: | --- |"]
    for m, b in d["bench"].items():
        rel = ", ".join(f"x{c['relative']}" for c in b["cost"][1:])
        kept = b["kept_tokens"] / b["drafted_tokens"] if b["drafted_tokens"] else 0.0
        lines.append(f"| {m} | {rel} | {kept:.0%} | {b['draft_tokens']} | {b['reason']} |")
    lines += ["", "## Extraction tasks/s by mode", "",
              "| model | slots | draft length | tasks/s off | forced | drafts | on | steps per output token off / "
              "forced / drafts / on | forced share | drafted / kept share (acceptance) | schema-valid off / on | "
              "fields right off / forced / drafts / on (± 1 s.e.) | identical to off: forced / drafts / on |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | --- | --- | --- |"]
    for r in d["runs"]:
        m = {k: r[k] for k in MODES}
        acc = m["on"]["acceptance"]
        lines.append(
            f"| {r['model']} | {r['slots']} | {r['draft_tokens']} | {m['off']['tasks_per_s']} | "
            + " | ".join(f"{m[k]['tasks_per_s']} (x{m[k]['speedup']})" for k in ("forced", "drafts", "on"))
            + f" | {' / '.join(str(m[k]['steps_per_token']) for k in MODES)} | {m['on']['forced_share']:.0%} | "
            f"{m['on']['drafted_share']:.0%} / {m['on']['accepted_share']:.0%} "
            f"({'-' if acc is None else f'{acc:.0%}'}) | {m['off']['valid']}/{r['items']} / {m['on']['valid']}/"
            f"{r['items']} | {' / '.join(str(m[k]['fields_right']) for k in MODES)} of {r['fields']} "
            f"(± {r['fields_right_se']}) | "
            + " / ".join(f"{m[k]['identical_to_off']}/{r['items']}" for k in ("forced", "drafts", "on")) + " |")
    lines += ["", "Shares are of the output tokens: forced (taken without a model step), drafted (evaluated as "
              "drafts) and kept (drafted tokens the model agreed with); acceptance is kept over drafted. An output "
              "that differs from the plain decode's differs because a batch of several tokens sums in another order "
              "than single steps (llama.cpp's floating point), as with slots: forced tokens are the only ones the "
              "grammar allows, and a drafted token is kept only where it is the model's best. The synthetic model "
              "writes noise (random weights), so its fields are never right and it keeps no drafts; it is there "
              "for the speed of a bandwidth-bound 1B model.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma,synthetic")
    ap.add_argument("--slots", default="1,4")
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--synthetic-slots", default="1,4", help="the slot counts for the synthetic model")
    ap.add_argument("--synthetic-items", type=int, default=8)
    ap.add_argument("--draft-tokens", type=int, default=4,
                    help="the draft length for the drafts and on modes where bench finds drafts do not pay")
    args = ap.parse_args()
    runs, benched = [], {}
    counting = Counting()
    for key in args.models.split(","):
        synthetic = key.startswith("synthetic")
        b = benched[model_path(key).name] = bench_drafts(model_path(key), 8 if synthetic else args.items)
        for slots in (args.synthetic_slots if synthetic else args.slots).split(","):
            runs.append(measure(key, int(slots), args.synthetic_items if synthetic else args.items, args.rounds,
                                b["draft_tokens"] or args.draft_tokens, counting))
    d = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "when": time.strftime("%Y-%m-%d"),
         "bench": benched, "runs": runs}
    write_results("fast_forward", d, markdown(d))
    print(markdown(d))


if __name__ == "__main__":
    main()
