"""The scheduler's policy, apart from its loop: made-up fleets and demand (sizes and speeds given), then fleets
recorded from real hardware planned by the real planner. Overcommit never, coverage where a model fits, capacity
following demand, churn bounded, spread over hosts, lost nodes' models placed elsewhere."""

from __future__ import annotations

import random

import pytest

from nodeagent.fleet.placement import Fit, ModelDemand, NodeView, Policy, place

GIB = 1 << 30
OVERHEAD = GIB // 4


def sized(sizes: dict[str, float], budgets: dict[str, float], speed: dict[str, float] | None = None):
    """A fit function: model sizes and node budgets in GiB, tasks/s per node (default 1)."""
    speed = speed or {}

    def fit(node: NodeView, model: str) -> Fit:
        size, budget = int(sizes[model] * GIB), int(budgets[node.id] * GIB)
        return Fit(fits=OVERHEAD + size <= budget, added_bytes=size, overhead_bytes=OVERHEAD, budget_bytes=budget,
                   tasks_per_s=speed.get(node.id, 1.0), why="" if OVERHEAD + size <= budget else "too large")
    return fit


def nodes(*ids: str, host=None, **kw) -> list[NodeView]:
    return [NodeView(id=i, host=host or i, allow_pull=True, **kw) for i in ids]


def host_bytes(result, fleet, fit) -> dict[str, int]:
    by_id = {n.id: n for n in fleet}
    used: dict[str, int] = {}
    for nid, held in result.assignments.items():
        if held:
            n = by_id[nid]
            first = fit(n, next(iter(held)))
            used[n.host] = used.get(n.host, 0) + first.overhead_bytes + sum(fit(n, m).added_bytes for m in held)
    return used


def test_a_model_with_work_is_placed_where_it_fits_and_says_why():
    fleet = nodes("pi4", "mac")
    fit = sized({"big": 6, "small": 0.5}, {"pi4": 3.4, "mac": 10.7})
    r = place(fleet, [ModelDemand(model="big", waiting=1204)], fit, now=1000.0)
    assert r.assignments["mac"] == {"big": 1000.0} and r.assignments["pi4"] == {}
    said = " ".join(r.reasons)
    assert "big placed on mac: 1,204 tasks waiting" in said and "of 10.7 GiB" in said
    assert "not on pi4: too large" in said
    assert r.loads == 1 and not r.unplaced


def test_a_model_that_fits_nowhere_is_reported_not_forced():
    fleet = nodes("pi4")
    r = place(fleet, [ModelDemand(model="huge", waiting=5)], sized({"huge": 40}, {"pi4": 3.4}), now=0.0)
    assert r.assignments["pi4"] == {} and "fits on no node" in r.unplaced["huge"]


def test_capacity_follows_demand_and_spreads_over_hosts():
    # two node processes on each of three hosts; each host holds two models at most
    fleet = [NodeView(id=f"{h}-{i}", host=h, allow_pull=True) for h in ("a", "b", "c") for i in (0, 1)]
    budgets = {n.id: 4.0 for n in fleet}
    fit = sized({"deep": 1.5, "shallow": 1.5}, budgets)
    demand = [ModelDemand(model="deep", waiting=3000), ModelDemand(model="shallow", waiting=10)]
    r = place(fleet, demand, fit, now=0.0, policy=Policy(target_drain_s=100))
    holders = [nid for nid, held in r.assignments.items() if "deep" in held]
    assert len(holders) > len([nid for nid, held in r.assignments.items() if "shallow" in held]) >= 1
    # the deep model reached every host before any host got it twice
    hosts = [n.split("-")[0] for n in holders]
    assert set(hosts) == {"a", "b", "c"}
    for used in host_bytes(r, fleet, fit).values():
        assert used <= 4 * GIB


def test_never_over_a_hosts_budget_on_random_fleets():
    rng = random.Random(7)
    for _ in range(200):
        hosts = [f"h{i}" for i in range(rng.randint(1, 6))]
        fleet = [NodeView(id=f"{h}-{j}", host=h, allow_pull=rng.random() < 0.8,
                          on_disk=[m for m in "abcde" if rng.random() < 0.3])
                 for h in hosts for j in range(rng.randint(1, 3))]
        budgets = {}
        for h in hosts:
            b = rng.choice([2, 4, 8, 16])
            for n in fleet:
                if n.host == h:
                    budgets[n.id] = b
        sizes = {m: rng.choice([0.2, 0.7, 1.5, 3, 5, 9]) for m in "abcde"}
        fit = sized(sizes, budgets, {n.id: rng.uniform(0.5, 4) for n in fleet})
        # some already held (possibly too much for the host: the policy must drop what does not fit)
        fleet = [n.model_copy(update={"held": {m: -1000.0 for m in rng.sample("abcde", rng.randint(0, 2))}})
                 for n in fleet]
        demand = [ModelDemand(model=m, waiting=rng.choice([0, 1, 50, 5000]), arrivals_per_s=rng.random())
                  for m in "abcde"]
        r = place(fleet, demand, fit, now=0.0)
        for h, used in host_bytes(r, fleet, fit).items():
            assert used <= budgets[next(n.id for n in fleet if n.host == h)] * GIB
        for m, why in r.unplaced.items():  # unplaced only when no permitted node could hold it
            assert not any(m in held for held in r.assignments.values())
        for d in demand:
            if d.waiting and any(fit(n, d.model).fits and (n.allow_pull or d.model in n.on_disk) for n in fleet):
                assert any(d.model in held for held in r.assignments.values()) or d.model in r.unplaced


def test_stable_demand_makes_no_churn_and_residency_holds():
    fleet = nodes("n1", "n2", "n3")
    fit = sized({"a": 3, "b": 3, "c": 3}, {"n1": 4, "n2": 4, "n3": 4})
    demand = [ModelDemand(model="a", waiting=100), ModelDemand(model="b", waiting=90),
              ModelDemand(model="c", waiting=80)]
    r = place(fleet, demand, fit, now=0.0)
    assert sorted(m for held in r.assignments.values() for m in held) == ["a", "b", "c"]
    for t in (10.0, 20.0, 1000.0):  # the same demand again and again: nothing moves
        fleet = [n.model_copy(update={"held": r.assignments[n.id]}) for n in fleet]
        r = place(fleet, demand, fit, now=t)
        assert r.loads == 0 and r.unloads == 0
    # a shift too small for the gain threshold moves nothing either
    shifted = [ModelDemand(model="a", waiting=150), ModelDemand(model="b", waiting=90),
               ModelDemand(model="c", waiting=80)]
    r2 = place(fleet, shifted, fit, now=2000.0)
    assert r2.loads == 0


def test_a_model_without_work_gives_way_but_not_within_its_residency_to_a_covered_model():
    fleet = [NodeView(id="n1", host="n1", allow_pull=True, held={"idle": 0.0}),
             NodeView(id="n2", host="n2", allow_pull=True, held={"busy": 0.0})]
    fit = sized({"idle": 3, "busy": 3}, {"n1": 4, "n2": 4})
    demand = [ModelDemand(model="busy", waiting=10_000), ModelDemand(model="idle", waiting=0)]
    early = place(fleet, demand, fit, now=60.0)  # idle placed a minute ago: it stays (busy is covered)
    assert early.assignments["n1"] == {"idle": 0.0}
    later = place(fleet, demand, fit, now=600.0)
    assert later.assignments["n1"] == {"busy": 600.0} and "no work waiting for it" in " ".join(later.reasons)


def test_an_uncovered_model_takes_room_from_one_without_work_even_within_residency():
    fleet = [NodeView(id="n1", host="n1", allow_pull=True, held={"idle": 50.0})]
    fit = sized({"idle": 3, "new": 3}, {"n1": 4})
    r = place(fleet, [ModelDemand(model="new", waiting=3)], fit, now=60.0)
    assert r.assignments["n1"] == {"new": 60.0}


def test_a_model_with_work_is_never_uncovered_for_another():
    fleet = [NodeView(id="n1", host="n1", allow_pull=True, held={"a": 0.0})]
    fit = sized({"a": 3, "b": 3}, {"n1": 4})
    r = place(fleet, [ModelDemand(model="a", waiting=1), ModelDemand(model="b", waiting=10_000)], fit, now=1e6)
    assert r.assignments["n1"] == {"a": 0.0} and "b" in r.unplaced


def test_lost_nodes_lose_their_models_to_healthy_ones():
    fleet = [NodeView(id="dead", host="x", healthy=False, held={"a": 0.0}), *nodes("alive")]
    fit = sized({"a": 1}, {"dead": 4, "alive": 4})
    r = place(fleet, [ModelDemand(model="a", waiting=5)], fit, now=10.0)
    assert "dead" not in r.assignments and r.assignments["alive"] == {"a": 10.0}
    assert any("dead is unhealthy or lost" in x for x in r.reasons)


def test_pulls_only_where_allowed_and_the_file_on_disk_is_preferred():
    fleet = [NodeView(id="fast-no-file", host="a", allow_pull=False),
             NodeView(id="slow-with-file", host="b", on_disk=["m"]),
             NodeView(id="fast-may-pull", host="c", allow_pull=True)]
    fit = sized({"m": 1}, {n.id: 4 for n in fleet}, {"fast-no-file": 9, "slow-with-file": 1, "fast-may-pull": 9})
    r = place(fleet, [ModelDemand(model="m", waiting=1)], fit, now=0.0)
    assert r.assignments["slow-with-file"] == {"m": 0.0}
    assert r.assignments["fast-no-file"] == {} and r.assignments["fast-may-pull"] == {}
    none = place(fleet[:1], [ModelDemand(model="m", waiting=1)], fit, now=0.0)
    assert "may pull" in none.unplaced["m"]


def test_a_node_holding_the_models_warm_prefixes_is_preferred_after_the_file():
    """Between nodes that both have the file, the one holding the model's warm prefixes gets it (its prompts'
    prefixes read back, not read again); the file on disk still comes first (a download costs more)."""
    fleet = [NodeView(id="a", host="a", on_disk=["m"]), NodeView(id="b", host="b", on_disk=["m"], prefixes=["m"]),
             NodeView(id="c", host="c", on_disk=["m"])]
    fit = sized({"m": 1}, {n.id: 4 for n in fleet})
    r = place(fleet, [ModelDemand(model="m", waiting=1)], fit, now=0.0)
    assert r.assignments["b"] == {"m": 0.0} and r.assignments["a"] == r.assignments["c"] == {}
    fleet = [NodeView(id="a", host="a", on_disk=["m"]), NodeView(id="b", host="b", allow_pull=True, prefixes=["m"])]
    r = place(fleet, [ModelDemand(model="m", waiting=1)], fit, now=0.0)
    assert r.assignments["a"] == {"m": 0.0}


def test_the_scheduler_reads_warm_prefixes_from_a_nodes_record():
    from nodeagent.broker.base import NodeRecord
    from nodeagent.fleet.scheduler import warm_prefixes

    base = {"id": "n", "hostname": "h", "agent_version": "t", "os": "linux", "arch": "x86_64", "backend": "fake"}
    record = NodeRecord.model_validate({**base, "prefixes": {
        "held": {"prefixes": 2, "restored": 0}, "restored": {"prefixes": None, "restored": 3},
        "none": {"prefixes": 0, "restored": 0}, "odd": {"prefixes": "many"}, "worse": "x"}})
    assert warm_prefixes(record) == ["held", "restored"]


def test_a_model_the_node_refused_goes_elsewhere():
    fleet = [NodeView(id="n1", host="n1", allow_pull=True, held={"m": 0.0}, refused={"m": "out of memory"}),
             *nodes("n2")]
    fit = sized({"m": 1}, {"n1": 4, "n2": 4})
    r = place(fleet, [ModelDemand(model="m", waiting=1)], fit, now=5.0)
    assert r.assignments["n1"] == {} and r.assignments["n2"] == {"m": 5.0}


@pytest.mark.parametrize("profile,fixture", [("rpi4-4gb", "rpi4-4gb.json"), ("apple-m2-pro-16gb", "m2-pro-16gb.json")])
def test_recorded_hardware_planned_by_the_real_planner(profile, fixture):
    """The scheduler's own fit (the pure planner on a node's recorded probe): a 7B lands on the Mac, not the Pi."""
    from pathlib import Path

    from nodeagent.config import load
    from nodeagent.fleet.scheduler import planner_fit
    from nodeagent.hardware import probe
    from nodeagent.hardware.system import RecordedSystem

    hw = probe(RecordedSystem.load(Path(__file__).parent / "fixtures" / "hardware" / fixture))
    node = NodeView(id=profile, host=profile, allow_pull=True)
    fit = planner_fit({profile: (hw, profile, None)}, load({}, {}))
    f = fit(node, "deepseek-r1-distill-qwen-7b")
    small = fit(node, "smollm2-135m-instruct")
    assert small.fits and small.tasks_per_s > 0 and small.added_bytes < 1 * GIB
    assert f.fits == (profile == "apple-m2-pro-16gb")
    if f.fits:
        assert 3 * GIB < f.added_bytes < 8 * GIB and f.settings["quant"]


# -- the device's health (as each node's guard reports it) -------------------------------------------------------------
def test_a_node_paused_for_heat_takes_nothing_new_and_counts_no_capacity():
    fleet = [NodeView(id="hot", host="hot", allow_pull=True, paused="heat: the Pi's soft temperature limit",
                      held={"small": 0.0}),
             NodeView(id="cool", host="cool", allow_pull=True)]
    fit = sized({"small": 0.5, "other": 0.5}, {"hot": 4, "cool": 4, "tight": 4})
    r = place(fleet, [ModelDemand(model="small", waiting=50), ModelDemand(model="other", waiting=50)], fit, now=0.0)
    assert r.assignments["hot"] == {"small": 0.0}  # it keeps what it holds (a pause is short) ...
    assert set(r.assignments["cool"]) == {"small", "other"}  # ... but the demand is covered where work gets done
    said = " ".join(r.reasons)
    assert "hot is paused (heat: the Pi's soft temperature limit): it takes no new model and keeps small" in said
    assert "not on hot: heat: the Pi's soft temperature limit" in said
    alone = place([fleet[0]], [ModelDemand(model="other", waiting=5)], fit, now=0.0)
    assert alone.assignments["hot"] == {"small": 0.0} and "all paused" in alone.unplaced["other"]
    holding = NodeView(id="tight", host="tight", allow_pull=True, holding="memory pressure warn (macOS)")
    assert place([holding], [ModelDemand(model="other", waiting=5)], fit, now=0.0).assignments["tight"] == {}


def test_a_throttled_node_is_derated_by_its_clock():
    """Two nodes of the same speed: one at 50 % of its clock counts half; a model that needs 1.5 nodes' worth gets
    both (the throttled one cannot cover it alone), and the reason says why it counted half."""
    fleet = [NodeView(id="slow", host="slow", allow_pull=True, freq_ratio=0.5),
             NodeView(id="fast", host="fast", allow_pull=True)]
    fit = sized({"m": 0.5}, {"slow": 4, "fast": 4}, {"slow": 2.0, "fast": 2.0})
    policy = Policy(target_drain_s=100)
    r = place(fleet, [ModelDemand(model="m", waiting=300)], fit, now=0.0, policy=policy)  # wants 3 tasks/s
    assert "m" in r.assignments["slow"] and "m" in r.assignments["fast"]
    assert any("its CPU at 50% of its clock (throttled): counted at 1.00 of its 2.00 tasks/s" in x for x in r.reasons)
    full = [NodeView(id=n.id, host=n.host, allow_pull=True) for n in fleet]  # the same demand, both at full clock
    r2 = place(full, [ModelDemand(model="m", waiting=300)], fit, now=0.0, policy=policy)
    assert sum("m" in h for h in r2.assignments.values()) == 2
    r3 = place(fleet, [ModelDemand(model="m", waiting=150)], fit, now=0.0, policy=policy)  # wants 1.5 tasks/s
    assert r3.assignments == {"slow": {}, "fast": {"m": 0.0}}  # the one at full clock covers it alone


def test_between_nodes_that_fit_mains_and_a_cool_device_are_preferred():
    fit = sized({"m": 0.5}, {"a": 4, "b": 4, "c": 4}, {"a": 3.0, "b": 2.0, "c": 1.0})
    fleet = [NodeView(id="a", host="a", allow_pull=True, on_battery=True),
             NodeView(id="b", host="b", allow_pull=True, warm=True),
             NodeView(id="c", host="c", allow_pull=True)]
    r = place(fleet, [ModelDemand(model="m", waiting=5)], fit, now=0.0)
    assert r.assignments["c"] == {"m": 0.0}  # mains and cool, though the slowest
    r = place(fleet[:2], [ModelDemand(model="m", waiting=5)], fit, now=0.0)
    assert r.assignments["b"] == {"m": 0.0}  # mains (warm) before battery
