"""Forced tokens in the sampled token's step (``fast_forward``) against one model step per token, on the same
extractions, taking turns in one run.

The inputs are contact cards whose seven true values are known (name, age, city, email, company, role, phone;
generated, seeded), so the benchmark also reports field accuracy against the truth for each mode: the fast path
must not cost correctness. For each model and slot count, one node; the modes alternate batch by batch on it
(same KV cache, same load on a shared machine). Per mode: extraction tasks/s (at 4 slots, four tasks at once on
the node's slots), the model steps per output token, the share of output tokens forced, schema-valid outputs,
outputs identical to the plain decode's, fields right.

The synthetic model (``synthetic``: TinyLlama's shape with random weights, benchmarks/synthetic_model.py) writes
noise, so its fields are never right; it is there for the speed of a bandwidth-bound 1B model.

Usage: python benchmarks/fast_forward.py [--models smollm2,gemma,synthetic] [--slots 1,4] [--items 24]
       [--rounds 2] [--synthetic-slots 1]
   -> benchmarks/results/fast_forward.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
        self.sums = {"tokens": 0, "forced": 0, "steps": 0}
        runner_mod.decode = self

    def __call__(self, *args, **kwargs):
        d = self.inner(*args, **kwargs)
        with self.lock:
            self.sums["tokens"] += len(d.tokens)
            self.sums["forced"] += d.forced
            self.sums["steps"] += d.steps
        return d

    def take(self) -> dict:
        with self.lock:
            out, self.sums = self.sums, {"tokens": 0, "forced": 0, "steps": 0}
        return out


def measure(key: str, slots: int, items: int, rounds: int) -> dict:
    from nodeagent.node import Node
    from nodeagent.tasks.contracts import ExtractTask

    if key.startswith("synthetic"):  # TinyLlama's shape, random Q8_0 weights: bandwidth-bound as a 1B model is
        from benchmarks.synthetic_model import synthetic_model

        path = synthetic_model("Q8_0")
    else:
        path = test_model_path(MODELS[key], resolve(env=dict(os.environ))["test_models_dir"])
    node = Node(str(path), config=resolve(env={}), task="extract", slots=slots)
    runners = node._ensure_runners()
    cards = contact_cards(items)
    counting = Counting()
    modes = {"off": False, "on": True}
    got: dict[str, dict] = {m: {"seconds": [], "outputs": {}, "valid": 0, "fields_right": 0, "counts": []}
                            for m in modes}

    def one(i: int) -> tuple[int, object]:
        text, _ = cards[i]
        return i, node.run(ExtractTask(input=text, schema=CONTACT))

    node.run(ExtractTask(input=cards[0][0], schema=CONTACT))  # loaded, the prompt's prefix cached
    counting.take()
    with ThreadPoolExecutor(slots) as pool:
        for r in range(rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for mode in order:
                for runner in runners:
                    runner.fast_forward = modes[mode]
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
    out = {"model": path.name, "slots": slots, "items": items, "rounds": rounds,
           "fields": items * len(CONTACT["required"])}
    for mode in modes:
        g = got[mode]
        c = {k: sum(x[k] for x in g["counts"]) for k in ("tokens", "forced", "steps")}
        secs = statistics.median(g["seconds"])
        out[mode] = {"tasks_per_s": round(items / secs, 3), "seconds_median": round(secs, 2),
                     "seconds": [round(s, 2) for s in g["seconds"]], "valid": g["valid"],
                     "fields_right": g["fields_right"],
                     "forced_share": round(c["forced"] / c["tokens"], 3) if c["tokens"] else 0.0,
                     "steps_per_token": round(c["steps"] / c["tokens"], 3) if c["tokens"] else 0.0}
    same = sum(got["on"]["outputs"][i] == got["off"]["outputs"][i] for i in range(items))
    out["identical_outputs"] = same
    out["speedup"] = round(out["on"]["tasks_per_s"] / out["off"]["tasks_per_s"], 3)
    return out


def markdown(d: dict) -> str:
    lines = ["# Forced tokens in the sampled token's step (fast_forward)", "",
             f"Measured on {d['machine']}, {d['when']}. Contact-card extractions (7 fields, true values known), "
             "the modes taking turns batch by batch on one node; tasks/s is the median batch's.", "",
             "| model | slots | tasks/s off | tasks/s on | speed-up | steps per output token off / on | forced share "
             "| schema-valid off / on | fields right off / on | outputs identical |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | --- | ---: |"]
    for r in d["runs"]:
        lines.append(f"| {r['model']} | {r['slots']} | {r['off']['tasks_per_s']} | {r['on']['tasks_per_s']} | "
                     f"x{r['speedup']} | {r['off']['steps_per_token']} / {r['on']['steps_per_token']} | "
                     f"{r['on']['forced_share']:.0%} | {r['off']['valid']}/{r['items']} / {r['on']['valid']}/"
                     f"{r['items']} | {r['off']['fields_right']}/{r['fields']} / {r['on']['fields_right']}/"
                     f"{r['fields']} | {r['identical_outputs']}/{r['items']} |")
    lines += ["", "An output that differs from the plain decode's differs because a batch of several tokens sums "
              "in another order than single steps (llama.cpp's floating point), as with slots; forced tokens are "
              "the ones the grammar allows alone, so the text they write is the same.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma,synthetic")
    ap.add_argument("--slots", default="1,4")
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--synthetic-slots", default="1", help="the slot counts for the synthetic model (slow here)")
    ap.add_argument("--synthetic-items", type=int, default=8)
    args = ap.parse_args()
    runs = []
    for key in args.models.split(","):
        synthetic = key.startswith("synthetic")
        for slots in (args.synthetic_slots if synthetic else args.slots).split(","):
            runs.append(measure(key, int(slots), args.synthetic_items if synthetic else args.items, args.rounds))
    d = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "when": time.strftime("%Y-%m-%d"), "runs": runs}
    write_results("fast_forward", d, markdown(d))
    print(markdown(d))


if __name__ == "__main__":
    main()
