"""The Grafana dashboard (contrib/grafana/nodeagent.json) queries only what the node exports: every metric name and
every label in every panel's query is read from the exposition of the real exporters (server/metrics.py with a
fake-backend node, a guard on a recorded machine, a SQLite broker holding a task and a model set; the health
gauges from server/health_metrics.py), parsed with prometheus_client's own parser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import HARDWARE

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "contrib" / "grafana" / "nodeagent.json"
NAME = re.compile(r"\bnodeagent_[a-zA-Z0-9_]+")
# the labels Prometheus adds at scrape time (instance, job) and the histogram's bucket bound
SCRAPE_LABELS = {"instance", "job", "le"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row holds its panels
    return out


def queries(d: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of every panel."""
    return [(p["title"], t["expr"]) for p in panels(d) for t in p.get("targets", []) if t.get("expr")]


def labels_in(expr: str) -> set[str]:
    """The label names an expression groups by or selects on: ``by (a, b)``, ``without (a)``, ``{a="x", b=~"y"}``."""
    found = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        found |= {n.strip() for n in group.split(",") if n.strip()}
    for selector in re.findall(r"\{([^}]*)\}", expr):
        found |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector))
    return found


def exposition(machine: str, tmp_path: Path) -> str:
    """/metrics of a node that has served a request and a task, with a guard reading ``machine``'s recorded
    health, a SQLite broker with a task waiting, and a one-model set."""
    from nodeagent.broker.open import open_broker
    from nodeagent.client import Client
    from nodeagent.config import resolve
    from nodeagent.fleet.guard import Guard, GuardConfig, Readings
    from nodeagent.hardware.health import HealthReader
    from nodeagent.hardware.system import RecordedSystem
    from nodeagent.modelset import Member, ModelSet
    from nodeagent.node import Node, make_task
    from nodeagent.server.metrics import Metrics

    node = Node("fake", config=resolve(env={}))
    reader = HealthReader(RecordedSystem.load(HARDWARE / f"{machine}.json"), lambda: True)
    guard = Guard(GuardConfig(sample_every_s=0, health_every_s=0), read=lambda: Readings(memory_pct=10, cpu_pct=0),
                  health=reader.read)
    guard.may_claim()
    broker = open_broker(f"sqlite://{tmp_path / f'{machine}.db'}", tmp_path)
    try:
        Client(broker).submit(make_task("classify", input="waiting", labels=["a", "b"]))
        models = ModelSet([Member(name="fake", node=node, pinned=False, names={"fake"})])
        metrics = Metrics(node, guard=guard, broker=broker, models=models)
        metrics.request("/v1/chat/completions", 200, 0.1)
        metrics.task(node.classify("hello", ["a", "b"]))
        return metrics.render()
    finally:
        broker.close()
        node.close()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, set[str]]:
    """Every sample name exported, with its label names: on a hot Pi (temperature, throttling, under-voltage,
    PSI) and on a MacBook on battery (the battery gauges), since a value a platform does not offer has no
    sample. Only names that have a sample count: a declared family with none would draw nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    names: dict[str, set[str]] = {}
    for machine in ("rpi5-8gb-hot", "macbook-battery-hot"):
        text = exposition(machine, tmp_path_factory.mktemp(machine))
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_the_dashboard_is_a_grafana_dashboard_with_its_inputs():
    d = dashboard()
    assert d["schemaVersion"] == 39 and d["uid"] == "nodeagent"
    assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"]
    assert [v["name"] for v in d["templating"]["list"]] == ["instance"]
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in panels(d):
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
            assert p["targets"], f"{p['title']} has no query"
    for title, expr in queries(d):
        assert 'instance=~"$instance"' in expr, f"{title}: not filtered by the instance variable"


def test_every_metric_the_dashboard_queries_is_exported(exported):
    used = {name for _, expr in queries(dashboard()) for name in NAME.findall(expr)}
    # not vacuous: the dashboard names many metrics, and the exporters export them
    assert len(used) >= 20, sorted(used)
    assert len(exported) >= 20, sorted(exported)
    missing = sorted(used - set(exported))
    assert not missing, f"the dashboard queries metrics nothing exports: {missing}"
    # and the check fails for a name nothing exports (a counter without its _total, a made-up gauge)
    assert "nodeagent_http_requests" not in exported and "nodeagent_made_up_gauge" not in exported


def test_every_exported_metric_has_a_panel(exported):
    """The other way round: a metric added to the exporters gets a panel (the _created samples are the client's
    own; the histogram's _count and _sum are drawn through its buckets)."""
    used = {name for _, expr in queries(dashboard()) for name in NAME.findall(expr)}
    shown = {n for n in exported if not n.endswith("_created")}
    unshown = shown - used - {"nodeagent_http_request_seconds_count", "nodeagent_http_request_seconds_sum"}
    assert not unshown, f"exported but on no panel of contrib/grafana/nodeagent.json: {sorted(unshown)}"


def test_the_variable_query_uses_an_exported_metric(exported):
    variable = dashboard()["templating"]["list"][0]
    assert set(NAME.findall(variable["definition"])) <= set(exported)


def test_every_label_a_query_uses_is_a_label_of_its_metrics(exported):
    wrong = []
    for title, expr in queries(dashboard()):
        have = set().union(*(exported.get(n, set()) for n in NAME.findall(expr))) | SCRAPE_LABELS
        wrong += [f"{title}: {label} in {expr}" for label in sorted(labels_in(expr) - have)]
    assert not wrong, "\n".join(wrong)


def test_the_label_reader_reads_groupings_and_selectors():
    assert labels_in('sum by (le, route) (rate(x_bucket{instance=~"$i", kind="prompt", a!="b"}[5m]))') == \
        {"le", "route", "instance", "kind", "a"}
    assert labels_in("max without (state) (x)") == {"state"}
