"""The scheduler's policy on a simulated fleet of 1,000 nodes, against two baselines in the same run.

The fleet is drawn (seeded) from the recorded hardware fixtures, scaled to every size of each family: Raspberry
Pi 4 (1, 2, 4, 8 GB) and Pi 5 (2, 4, 8, 16 GB), M1 8 GB, M2 Pro 16 GB and M3 Max 64 GB, each planned with its
device profile. The models are ten, from 135M to 8B: the two test models and the 7B header fixture (real GGUF
headers), and seven catalog models whose headers are generated from their published architectures (layers,
widths, heads, vocabulary; Q4_K weights, Q6_K output) with the gguf package. Every fit is the real planner's
(``fleet/scheduler.planner_fit``, the scheduler's own), and every node's throughput the planner's figure
(``planner/speed.py``: the memory's spec bandwidth over the weights).

Demand: Poisson arrivals per model, seeded, whose mix shifts every 90 minutes (three hot models at a time, the
rest at a trickle), sized against the fleet's capacity for each model. Each node serves the models it holds,
sharing its time between them by their backlog; a model it loads serves nothing until its weights are read
(pulled first when not on the node's disk), so swaps cost capacity.

Heat: a share of the Pis (20 %, seeded) run throttled for the whole run, at 60 % of their clock (a closed case, no
fan), and serve 60 % of the planner's figure; their guards report it (``freq_ratio`` in the node record).

Policies, from the same start (each node holding one model that fits it, drawn as an operator would start it):
- static: every node keeps its first model (today, without a scheduler);
- greedy: each round, for the models with the deepest backlog, one more replica on the node with the least free
  memory that still fits it, evicting the smallest-backlog models where none has room; replicas of models
  with no backlog dropped (first-fit by free memory, as GPUStack's binpack places);
- nodeagent: ``fleet/placement.place`` with its defaults (residency 300 s, gain x2), each throttled node's
  throughput derated by its clock ratio;
- nodeagent (no derating): the same policy blind to the throttling (every clock ratio 1.0): the backlog with and
  without derating.

Reports placement time per round (target under 1 s for 1,000 nodes and 10 models), rounds where a host was over
its plan (target 0), rounds where a model with waiting tasks that fits somewhere had no node (target 0), swaps
per hour, and the backlog over time (target: a lower peak than both baselines, with fewer swaps than greedy).

Usage: python benchmarks/scheduler_sim.py [--nodes 1000] [--hours 6] [--seed 1]
    -> benchmarks/results/scheduler_sim.{json,md}
"""

from __future__ import annotations

import argparse
import gzip
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.results_io import write_results  # noqa: E402

GIB = 1 << 30
FIX = ROOT / "tests" / "fixtures"
DT_S = 10.0  # the simulation's step
ROUND_S = 60.0  # a scheduler round
PHASE_S = 90 * 60.0  # the demand mix shifts this often
LOAD_BPS = {"rpi": 100e6, "apple": 2e9}  # reading weights from an SD card or USB disk, from a Mac's SSD
PULL_BPS = 50e6  # a download
HOT_SHARE, COLD_SHARE = 0.18, 0.01  # of a model's whole-fleet capacity: three hot models, seven cold
THROTTLED_SHARE, THROTTLED_RATIO = 0.20, 0.60  # of the Pis: throttled all along, at this share of their clock
# (family, GB, fixture, profile, share of the fleet)
KINDS = [("pi4", 1, "rpi4-4gb.json", "rpi4-4gb", 0.05), ("pi4", 2, "rpi4-4gb.json", "rpi4-4gb", 0.08),
         ("pi4", 4, "rpi4-4gb.json", "rpi4-4gb", 0.12), ("pi4", 8, "rpi4-4gb.json", "rpi4-8gb", 0.10),
         ("pi5", 2, "rpi5-8gb.json", "rpi5-8gb", 0.05), ("pi5", 4, "rpi5-8gb.json", "rpi5-8gb", 0.10),
         ("pi5", 8, "rpi5-8gb.json", "rpi5-8gb", 0.15), ("pi5", 16, "rpi5-8gb.json", "rpi5-16gb", 0.05),
         ("m1", 8, "m1-8gb.json", "apple-m1-8gb", 0.15), ("m2pro", 16, "m2-pro-16gb.json", "apple-m2-pro-16gb", 0.10),
         ("m3max", 64, "m3-max-64gb-wired.json", "apple-m3-max-64gb", 0.05)]
# generated headers: catalog id -> (arch, layers, width, heads, kv heads, ffn, vocabulary), from the published
# configs of each model
GENERATED = {
    "smollm2-360m-instruct": ("llama", 32, 960, 15, 5, 2560, 49152),
    "qwen2.5-0.5b-instruct": ("qwen2", 24, 896, 14, 2, 4864, 151936),
    "llama-3.2-1b-instruct": ("llama", 16, 2048, 32, 8, 8192, 128256),
    "qwen2.5-1.5b-instruct": ("qwen2", 28, 1536, 12, 2, 8960, 151936),
    "llama-3.2-3b-instruct": ("llama", 28, 3072, 24, 8, 8192, 128256),
    "qwen2.5-3b-instruct": ("qwen2", 36, 2048, 16, 2, 11008, 151936),
    "llama-3.1-8b-instruct": ("llama", 32, 4096, 32, 8, 14336, 128256),
}


def model_files(tmp: Path) -> dict[str, Path]:
    from gguf import GGMLQuantizationType
    from ggufgen import write_header_only

    from nodeagent.config import load
    from nodeagent.store.pkgindex import test_model_path

    d = load().test_models_dir
    files = {"smollm2-135m-instruct": test_model_path("smollm2-135m-instruct", d),
             "gemma-3-270m-it": test_model_path("gemma-3-270m-it", d)}
    seven = tmp / "deepseek-r1-distill-qwen-7b.gguf"
    with gzip.open(FIX / "deepseek-r1-distill-qwen-7b-q4_k_m.header.gguf.gz") as src, open(seven, "wb") as dst:
        shutil.copyfileobj(src, dst)
    for name, (arch, n_layer, n_embd, n_head, n_kv, n_ff, vocab) in GENERATED.items():
        path = tmp / f"{name}.gguf"
        # Q4_K rows hold 256 values: widths that are not a multiple take Q8_0, as llama.cpp's Q4_K_M falls back
        qtype = GGMLQuantizationType.Q4_K if n_embd % 256 == 0 else GGMLQuantizationType.Q8_0
        write_header_only(path, arch, n_layer, n_embd, n_head, n_kv, n_ff, vocab, ctx=32768, qtype=qtype)
        files[name] = path
    files["deepseek-r1-distill-qwen-7b"] = seven
    return files


def fleet(n: int, rng: random.Random):
    """n nodes: (id, family, HardwareInfo, profile id)."""
    from nodeagent.hardware import probe
    from nodeagent.hardware.system import RecordedSystem

    base = {}
    out = []
    weights = [k[4] for k in KINDS]
    for i in range(n):
        family, gb, fixture, profile, _ = rng.choices(KINDS, weights)[0]
        key = (family, gb)
        if key not in base:
            hw = probe(RecordedSystem.load(FIX / "hardware" / fixture))
            scale = gb * GIB / hw.ram_total_bytes
            update = {"ram_total_bytes": int(hw.ram_total_bytes * scale),
                      "ram_available_bytes": int(hw.ram_available_bytes * scale)}
            if hw.apple is not None:
                update["apple"] = hw.apple.model_copy(update={
                    "unified_memory_bytes": int(hw.apple.unified_memory_bytes * scale),
                    "metal_working_set_bytes": int(hw.apple.metal_working_set_bytes * scale)})
            base[key] = hw.model_copy(update=update)
        out.append((f"{family}-{gb}gb-{i:04d}", family, base[key], profile))
    return out


class Sim:
    """One policy's run: each node's held models (model -> ready at), the queues, the counters."""

    def __init__(self, name, nodes, models, fit, views, first, rates, hours, policy_fn):
        self.name, self.nodes, self.models, self.fit, self.views = name, nodes, models, fit, views
        self.speed = {nid: v.freq_ratio for nid, v in views.items()}  # what each node really serves at
        self.rates, self.hours, self.policy_fn = rates, hours, policy_fn
        self.held = {nid: {m: 0.0} for nid, m in first.items() if m}
        self.since = {nid: {m: -3600.0} for nid, m in first.items() if m}
        self.on_disk = {nid: {m} for nid, m in first.items() if m}
        self.backlog = {m: 0.0 for m in models}
        self.arrived_round = {m: 0 for m in models}
        self.rate_est = {m: 0.0 for m in models}
        self.swaps = 0
        self.round_s: list[float] = []
        self.over_plan = 0
        self.uncovered = 0
        self.series: list[tuple[float, float]] = []
        self.served = 0

    def step_arrivals(self, t: float, rng: random.Random) -> None:
        for m in self.models:
            lam = self.rates(m, t) * DT_S
            k = _poisson(lam, rng)
            self.backlog[m] += k
            self.arrived_round[m] += k

    def step_service(self, t: float) -> None:
        for nid, held in self.held.items():
            ready = [m for m, at in held.items() if at <= t and self.backlog[m] > 0]
            if not ready:
                continue
            total = sum(self.backlog[m] for m in ready)
            view = self.views[nid]
            for m in ready:
                share = DT_S * self.backlog[m] / total
                done = min(self.backlog[m], share * self.fit(view, m).tasks_per_s * self.speed[nid])
                self.backlog[m] -= done
                self.served += done

    def round(self, t: float) -> None:
        for m in self.models:  # the arrival rate over the last round, smoothed as the scheduler's tracker does
            inst = self.arrived_round[m] / ROUND_S
            keep = 0.5 ** (ROUND_S / 60.0)
            self.rate_est[m] = keep * self.rate_est[m] + (1 - keep) * inst
            self.arrived_round[m] = 0
        t0 = time.perf_counter()
        target = self.policy_fn(self, t)
        self.round_s.append(time.perf_counter() - t0)
        if target is None:
            return
        for nid in set(self.held) | set(target):
            old, new = self.held.get(nid, {}), target.get(nid, {})
            view = self.views[nid]
            keep = {m: at for m, at in old.items() if m in new}
            for m in new:
                if m in keep:
                    continue
                w = self.fit(view, m).added_bytes
                load = w / LOAD_BPS["apple" if view.host.startswith("m") else "rpi"]
                pull = 0.0 if m in self.on_disk.setdefault(nid, set()) else w / PULL_BPS
                self.on_disk[nid].add(m)
                keep[m] = t + load + pull
                self.since.setdefault(nid, {})[m] = t
                self.swaps += 1
            self.held[nid] = keep
            self.since[nid] = {m: s for m, s in self.since.get(nid, {}).items() if m in keep}
        # checks after the round: no host over its plan; no model with work uncovered where it fits somewhere
        for nid, held in self.held.items():
            if held:
                view = self.views[nid]
                f0 = self.fit(view, next(iter(held)))
                used = f0.overhead_bytes + sum(self.fit(view, m).added_bytes for m in held)
                if used > f0.budget_bytes:
                    self.over_plan += 1
        covered = {m for held in self.held.values() for m in held}
        for m in self.models:
            if self.backlog[m] >= 1 and m not in covered and self.fits_somewhere[m]:
                self.uncovered += 1


def _poisson(lam: float, rng: random.Random) -> int:
    if lam <= 0:
        return 0
    if lam > 50:
        return max(0, int(round(rng.gauss(lam, math.sqrt(lam)))))
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def static_policy(sim: Sim, t: float):
    return None


def greedy_policy(sim: Sim, t: float):
    """First-fit by free memory (binpack): one more replica per round for each model its replicas cannot drain
    within the round, on the fitting node with the least free memory; where none has room, the smallest-backlog
    models of the first node it fits on alone are evicted."""
    held = {nid: dict(h) for nid, h in sim.held.items()}
    views, fit = sim.views, sim.fit

    def used(nid):
        h = held.get(nid, {})
        if not h:
            return 0
        v = views[nid]
        return fit(v, next(iter(h))).overhead_bytes + sum(fit(v, m).added_bytes for m in h)

    cap = {m: 0.0 for m in sim.models}
    for nid, h in held.items():
        for m in h:
            cap[m] += fit(views[nid], m).tasks_per_s
    for m in sorted(sim.models, key=lambda m: -sim.backlog[m]):
        if sim.backlog[m] <= cap[m] * ROUND_S:
            continue
        best = None
        for nid in sim.fitting[m]:
            if m in held.get(nid, {}):
                continue
            v = views[nid]
            f = fit(v, m)
            free = f.budget_bytes - used(nid) - (0 if held.get(nid) else f.overhead_bytes)
            if free >= f.added_bytes and (best is None or free < best[0]):
                best = (free, nid)
        if best is None:
            for nid in sim.fitting[m]:
                h = held.get(nid, {})
                if m in h:
                    continue
                lesser = sorted((x for x in h if sim.backlog[x] < sim.backlog[m]), key=lambda x: sim.backlog[x])
                v = views[nid]
                f = fit(v, m)
                evicted = []
                while lesser and f.budget_bytes - used(nid) < f.added_bytes:
                    x = lesser.pop(0)
                    del h[x]
                    evicted.append(x)
                if f.budget_bytes - used(nid) - (0 if h else f.overhead_bytes) >= f.added_bytes:
                    best = (0, nid)
                    break
                for x in evicted:  # no room even so: put them back
                    h[x] = 0.0
        if best is not None:
            held.setdefault(best[1], {})[m] = t
            cap[m] += fit(views[best[1]], m).tasks_per_s
    return held


def nodeagent_policy(sim: Sim, t: float, derate: bool = True):
    from nodeagent.fleet.placement import ModelDemand, place

    views = [v.model_copy(update={"held": dict(sim.since.get(v.id, {})), "on_disk": sorted(sim.on_disk.get(v.id, ())),
                                  **({} if derate else {"freq_ratio": 1.0})})
             for v in sim.views.values()]
    demand = [ModelDemand(model=m, waiting=int(sim.backlog[m]), arrivals_per_s=sim.rate_est[m]) for m in sim.models]
    return place(views, demand, sim.fit, t).assignments


def blind_policy(sim: Sim, t: float):
    """nodeagent's policy blind to throttling: every node at its full clock."""
    return nodeagent_policy(sim, t, derate=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    from nodeagent.config import load
    from nodeagent.fleet.placement import NodeView
    from nodeagent.fleet.scheduler import planner_fit

    rng = random.Random(args.seed)
    config = load({}, {"NODEAGENT_OFFLINE": "1"})
    with tempfile.TemporaryDirectory() as tmp:
        files = model_files(Path(tmp))
        nodes = fleet(args.nodes, rng)
        devices = {nid: (hw, profile, None) for nid, _, hw, profile in nodes}
        fit_by_file = planner_fit(devices, config)

        def fit(view, model):  # the policy speaks catalog names; the planner reads each one's header file
            return fit_by_file(view, str(files[model]))

        heat = random.Random(args.seed + 2)  # its own draws: the fleet and the first models stay as they were
        throttled = {nid for nid, family, _, _ in nodes if family.startswith("pi") and heat.random() < THROTTLED_SHARE}
        views = {nid: NodeView(id=nid, host=nid, allow_pull=True,
                               freq_ratio=THROTTLED_RATIO if nid in throttled else 1.0) for nid, _, _, _ in nodes}
        biggest = max(nodes, key=lambda n: n[2].ram_total_bytes)[0]
        models = sorted(files, key=lambda m: fit(views[biggest], m).added_bytes)
        t0 = time.perf_counter()
        fitting = {m: [nid for nid in views if fit(views[nid], m).fits] for m in models}
        plan_s = time.perf_counter() - t0
        # what the fleet really serves of each model: the throttled Pis at their clock's share
        capacity = {m: sum(fit(views[nid], m).tasks_per_s * views[nid].freq_ratio for nid in fitting[m])
                    for m in models}
        first = {}
        for nid in views:
            options = [m for m in models if nid in set(fitting[m])]
            first[nid] = rng.choice(options) if options else None
        hot_sets = [rng.sample(models, 3) for _ in range(int(args.hours * 3600 / PHASE_S) + 1)]

        def rates(m: str, t: float) -> float:
            """A hot model asks for 18 % of what every node it fits on could serve of it, the others 1 %: about
            60 % of the fleet's time in all, more for the hot ones than a random first model per node gives."""
            return (HOT_SHARE if m in hot_sets[int(t // PHASE_S)] else COLD_SHARE) * capacity[m]

        results = {}
        for name, fn in (("static", static_policy), ("greedy", greedy_policy), ("nodeagent", nodeagent_policy),
                         ("nodeagent (no derating)", blind_policy)):
            sim = Sim(name, nodes, models, fit, views, first, rates, args.hours, fn)
            sim.fitting = {m: fitting[m] for m in models}
            sim.fits_somewhere = {m: bool(fitting[m]) for m in models}
            arrivals = random.Random(args.seed + 1)  # the same arrivals for every policy
            t = 0.0
            started = time.perf_counter()
            while t < args.hours * 3600:
                if t % ROUND_S == 0:
                    sim.round(t)
                sim.step_arrivals(t, arrivals)
                sim.step_service(t)
                t += DT_S
                if t % ROUND_S == 0:
                    sim.series.append((t, sum(sim.backlog.values())))
            rounds = sorted(sim.round_s[1:]) or [0.0]
            results[name] = {
                "peak_backlog": round(max(b for _, b in sim.series)),
                "mean_backlog": round(sum(b for _, b in sim.series) / len(sim.series)),
                "final_backlog": round(sim.series[-1][1]),
                "served": round(sim.served),
                "swaps": sim.swaps, "swaps_per_hour": round(sim.swaps / args.hours, 1),
                "rounds_over_plan": sim.over_plan, "model_rounds_uncovered": sim.uncovered,
                "round_s": {"first": round(sim.round_s[0], 4), "median": round(rounds[len(rounds) // 2], 4),
                            "p95": round(rounds[int(0.95 * (len(rounds) - 1))], 4), "max": round(rounds[-1], 4)},
                "backlog_series": [(int(a), round(b)) for a, b in sim.series[:: max(1, len(sim.series) // 72)]],
                "wall_s": round(time.perf_counter() - started, 1),
            }
            print(f"{name}: peak backlog {results[name]['peak_backlog']}, swaps {sim.swaps}, "
                  f"round median {results[name]['round_s']['median']} s", file=sys.stderr)
        kinds: dict[str, int] = {}
        for nid, family, hw, profile in nodes:
            kinds[f"{family} {hw.ram_total_bytes / GIB:.0f} GB ({profile})"] = kinds.get(
                f"{family} {hw.ram_total_bytes / GIB:.0f} GB ({profile})", 0) + 1
        pis = sum(1 for _, family, _, _ in nodes if family.startswith("pi"))
        data = {"nodes": args.nodes, "hours": args.hours, "seed": args.seed, "round_s": ROUND_S, "step_s": DT_S,
                "throttled": {"pis": pis, "throttled": len(throttled), "clock_ratio": THROTTLED_RATIO},
                "models": {m: {"fits_on_nodes": len(fitting[m]),
                               "planned_gib_on_m2pro": round(next((fit(views[n], m).added_bytes for n in views
                                                                   if n.startswith("m2pro")), 0) / GIB, 2),
                               "fleet_tasks_per_s": round(capacity[m], 1)} for m in models},
                "fleet": dict(sorted(kinds.items())), "fit_table_s": round(plan_s, 2), "policies": results}
    write_results("scheduler_sim", data, markdown(data))
    print(markdown(data))


def markdown(d: dict) -> str:
    p = d["policies"]
    lines = [f"# The scheduler on a simulated fleet of {d['nodes']:,} nodes", "",
             f"Produced by `benchmarks/scheduler_sim.py` (seed {d['seed']}): {d['hours']:g} h simulated in "
             f"{d['step_s']:g} s steps, a placement round every {d['round_s']:g} s, the same arrivals for each "
             "policy. Every fit is the real planner's on each device's recorded probe (scaled to its size) and "
             "profile; throughput is the planner's figure (on the throttled Pis, that figure at their clock's share).",
             "",
             "| policy | peak backlog | mean backlog | final backlog | served | swaps/h | rounds over plan | "
             "model-rounds uncovered | round median / p95 / max s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in p.items():
        rs = r["round_s"]
        lines.append(f"| {name} | {r['peak_backlog']:,} | {r['mean_backlog']:,} | {r['final_backlog']:,} | "
                     f"{r['served']:,} | {r['swaps_per_hour']} | {r['rounds_over_plan']} | "
                     f"{r['model_rounds_uncovered']} | {rs['median']} / {rs['p95']} / {rs['max']} |")
    ours = p["nodeagent"]
    th, blind = d.get("throttled"), p.get("nodeagent (no derating)")
    if th and blind:
        lines += ["", f"Throttled: {th['throttled']} of the {th['pis']} Pis at {th['clock_ratio']:.0%} of their clock. "
                  f"nodeagent derating their throughput by it: peak backlog {ours['peak_backlog']:,}, mean "
                  f"{ours['mean_backlog']:,}; blind to it: peak {blind['peak_backlog']:,}, mean "
                  f"{blind['mean_backlog']:,} (x{ours['peak_backlog'] / max(1, blind['peak_backlog']):.3f} and "
                  f"x{ours['mean_backlog'] / max(1, blind['mean_backlog']):.3f} with derating)."]
    lines += ["", f"nodeagent's peak backlog: x{ours['peak_backlog'] / max(1, p['static']['peak_backlog']):.3f} "
              f"static's, x{ours['peak_backlog'] / max(1, p['greedy']['peak_backlog']):.3f} greedy's; swaps "
              f"x{ours['swaps'] / max(1, p['greedy']['swaps']):.3f} greedy's. The planner's fit of every model on every "
              f"node took {d['fit_table_s']} s once (cached per device kind and model, as the scheduler caches it); "
              f"nodeagent's first round after it {ours['round_s']['first']} s.", "",
             "| model | nodes it fits | planned GiB on an M2 Pro 16 GB | fleet tasks/s if every fitting node held it |",
             "| --- | --- | --- | --- |"]
    for m, x in d["models"].items():
        lines.append(f"| {m} | {x['fits_on_nodes']} | {x['planned_gib_on_m2pro']} | {x['fleet_tasks_per_s']:,} |")
    lines += ["", "| device | nodes |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in d["fleet"].items()]
    lines += ["", "Backlog over time (tasks waiting, sampled):", "", "| minute | " + " | ".join(p) + " |",
              "| --- |" + " --- |" * len(p)]
    series = {name: dict(r["backlog_series"]) for name, r in p.items()}
    for t in sorted(series["nodeagent"]):
        lines.append(f"| {t // 60} | " + " | ".join(f"{series[n].get(t, '')}" for n in p) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
