"""The guard acting on the device's health (fleet/guard.py), with recorded machines and an injected clock: heat
with its hysteresis, battery by policy, memory pressure (the model set's hold, then a pause), under-voltage as an
alert; what its status carries into the node record, the health gauges and /readyz's words
(server/health_metrics.py), `nodeagent status`, and worker processes on a hot and a cool recorded machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import HARDWARE, Clock, cli
from test_fleet_processes import QUIET_GUARD
from test_modelset import member, task

from nodeagent.broker.open import open_broker
from nodeagent.client import Client
from nodeagent.fleet.guard import Guard, GuardConfig, Readings
from nodeagent.hardware.health import HealthReader
from nodeagent.hardware.system import RecordedSystem
from nodeagent.modelset import ModelSet
from nodeagent.server.health_metrics import HealthCollector, readiness
from nodeagent.tasks.contracts import ClassifyTask

MIB = 1 << 20


class Machine:
    """A recorded machine whose readings a test changes: files, sysctl values, notify states, command outputs."""

    def __init__(self, name: str) -> None:
        self.sys = RecordedSystem.load(HARDWARE / f"{name}.json")
        self.reader = HealthReader(self.sys, lambda: True)

    def read(self):
        return self.reader.read()


def guard(machine: Machine, clock: Clock, posted: list | None = None, **config) -> Guard:
    return Guard(GuardConfig(sample_every_s=0, health_every_s=0, webhook="http://alerts.example/hook"
                             if posted is not None else None, **config),
                 read=lambda: Readings(memory_pct=10, cpu_pct=0), clock=clock, health=machine.read,
                 post=lambda url, event: posted.append(event) if posted is not None else None, node_id="n1")


def test_a_hot_pi_pauses_and_resumes_only_when_cool_and_after_the_least_pause():
    m, clock = Machine("rpi5-8gb-hot"), Clock()
    g = guard(m, clock)
    assert not g.may_claim() and g.state == "paused" and g.pause == "heat"
    assert g.reason == "heat: the Pi's soft temperature limit, the Pi's firmware throttles"  # 84.5 < 85: flags
    s = g.status()
    assert s["pause"] == "heat" and s["thermal"] == "hot" and s["temperature_c"] == 84.5
    assert s["throttled"] == ["frequency capped", "throttled", "soft temperature limit"]
    assert s["freq_ratio"] == 0.625 and s["health"]["pi_throttle"]["raw"] == "0xe000e"
    assert json.loads(json.dumps(s)) == s  # what the worker puts in the node record
    files = m.sys.files
    throttle = "/sys/devices/platform/soc@107c000000/soc@107c000000:firmware/get_throttled"
    files[throttle] = "e0000\n"  # the flags clear now (since boot stays)
    files["/sys/class/thermal/thermal_zone0/temp"] = "79000\n"
    clock.now += 5
    assert not g.may_claim() and "cooling down (79.0 °C, claims again at 75 °C" in g.reason
    files["/sys/class/thermal/thermal_zone0/temp"] = "74000\n"
    clock.now += 5
    assert not g.may_claim() and g.reason == "heat: cooling down (at least 50 s more)"  # cool, but the least pause
    clock.now += 50
    assert g.may_claim() and g.state == "ok" and g.pause is None
    assert g.status()["thermal"] == "cool" and g.status()["freq_ratio"] == 1.0  # no flag: the governor's clock
    files["/sys/class/thermal/thermal_zone0/temp"] = "86000\n"  # past the limit itself, flags clear
    clock.now += 5
    assert not g.may_claim() and g.reason == "heat: 86.0 °C >= 85 °C"
    events = [e for e in g.events if e.get("to") == "paused"]
    assert len(events) == 2 and all(e["reason"].startswith("heat") for e in events)


def test_the_temperature_limit_and_the_margin_are_settings():
    m, clock = Machine("desktop-cool"), Clock()  # 41 °C
    assert guard(m, clock).may_claim()
    g = guard(m, clock, temp_c=40.0, cool_c=0.5, heat_pause_s=0)
    assert not g.may_claim() and g.reason == "heat: 41.0 °C >= 40 °C"
    m.sys.files["/sys/class/thermal/thermal_zone1/temp"] = "39400\n"
    clock.now += 1
    assert g.may_claim()


def test_an_under_volted_pi_raises_an_alert_but_is_not_paused():
    m, clock, posted = Machine("rpi4-4gb-undervolted"), Clock(), []
    g = guard(m, clock, posted)
    assert g.may_claim() and g.state == "ok"  # its throttle comes with the under-voltage: the supply's, not heat
    alerts = [e for e in g.events if e.get("event") == "nodeagent.alert"]
    assert [a["alert"] for a in alerts] == ["under-voltage"] and alerts[0]["node"] == "n1"
    for _ in range(50):
        if posted:
            break
        time.sleep(0.01)
    assert posted and posted[0]["alert"] == "under-voltage"  # the webhook got the same JSON
    clock.now += 5
    g.may_claim()
    assert len([e for e in g.events if e.get("event") == "nodeagent.alert"]) == 1  # once an episode, not a reading
    s = g.status()
    assert s["undervolted"] is True and s["throttled"] == ["throttled"]
    assert s["freq_ratio"] == pytest.approx(0.333, abs=1e-3)  # throttled: the clock is the truth
    m.sys.files["/sys/devices/platform/soc/soc:firmware/get_throttled"] = "50000\n"
    m.sys.files["/sys/class/hwmon/hwmon1/in0_lcrit_alarm"] = "0\n"
    clock.now += 5
    g.may_claim()
    m.sys.files["/sys/devices/platform/soc/soc:firmware/get_throttled"] = "50005\n"
    clock.now += 5
    g.may_claim()
    assert len([e for e in g.events if e.get("event") == "nodeagent.alert"]) == 2  # a new episode


def test_under_voltage_since_boot_alone_alerts_once_at_start():
    m, clock = Machine("rpi4-4gb-undervolted"), Clock()
    m.sys.files["/sys/devices/platform/soc/soc:firmware/get_throttled"] = "50000\n"
    m.sys.files["/sys/class/hwmon/hwmon1/in0_lcrit_alarm"] = "0\n"
    g = guard(m, clock)
    assert g.may_claim()
    assert [e["alert"] for e in g.events if e.get("event") == "nodeagent.alert"] == ["under-voltage since boot"]


def test_a_macbook_pauses_for_heat_then_for_its_battery_by_policy():
    m, clock = Machine("macbook-battery-hot"), Clock()
    g = guard(m, clock)
    assert not g.may_claim() and g.pause == "heat" and g.reason == "heat: thermal pressure heavy"
    assert g.status()["on_battery"] is True and g.status()["battery_pct"] == 20.0
    m.sys.notify["com.apple.system.thermalpressurelevel"] = 1  # moderate: below the level
    clock.now += 61
    assert not g.may_claim() and g.pause == "battery" and g.reason == "battery: on battery at 20 % < 30 %"
    assert g.status()["thermal"] == "warm"
    batt = "pmset -g batt"
    m.sys.commands[batt] = m.sys.commands[batt].replace("20%; discharging", "32%; discharging")
    clock.now += 5
    assert not g.may_claim() and "claims again at 35 % or on mains" in g.reason  # the hysteresis
    m.sys.commands[batt] = "Now drawing from 'AC Power'\n -InternalBattery-0 (id=1)\t32%; charging; present: true\n"
    clock.now += 5
    assert g.may_claim() and g.status()["on_battery"] is False
    # the same machine under the other policies
    m2 = Machine("macbook-battery-hot")
    m2.sys.notify["com.apple.system.thermalpressurelevel"] = 0
    assert guard(m2, Clock(), on_battery="serve").may_claim()
    assert guard(m2, Clock(), battery_min_pct=15).may_claim()
    m2.sys.commands[batt] = m2.sys.commands[batt].replace("20%", "90%")
    g = guard(m2, Clock(), on_battery="drain")
    assert not g.may_claim() and g.reason == "battery: on battery power (NODEAGENT_ON_BATTERY=drain)"
    m2.sys.notify["com.apple.system.thermalpressurelevel"] = 3
    assert not guard(m2, Clock(), on_battery="serve", thermal_pressure="trapping").may_claim()
    m2.sys.notify["com.apple.system.thermalpressurelevel"] = 1
    assert not guard(m2, Clock(), on_battery="serve", thermal_pressure="moderate").may_claim()


def test_memory_pressure_holds_model_loads_at_warn_and_pauses_at_critical():
    m, clock = Machine("mac-memory-critical"), Clock()
    g = guard(m, clock)
    assert not g.may_claim() and g.pause == "pressure"
    assert g.reason == "pressure: memory pressure critical (macOS)"
    assert g.hold_models() == "memory pressure critical (macOS): no further model is loaded, idle ones are unloaded"
    m.sys.sysctls["kern.memorystatus_vm_pressure_level"] = "2"  # warn: claims again, still loads nothing new
    clock.now += 5
    assert g.may_claim() and g.hold_models().startswith("memory pressure warn")
    assert g.status()["memory_pressure"] == "warn" and g.status()["hold_models"]
    m.sys.sysctls["kern.memorystatus_vm_pressure_level"] = "1"
    clock.now += 5
    assert g.may_claim() and g.hold_models() is None
    held = [(e["to"], e["reason"].split(":")[0]) for e in g.events if e["to"] in ("hold models", "load models")]
    assert held == [("hold models", "memory pressure critical (macOS)"),  # every change logged, with its reason
                    ("hold models", "memory pressure warn (macOS)"), ("load models", "memory pressure eased")]


def test_linux_psi_over_its_threshold_counts_as_critical():
    m, clock = Machine("desktop-cool"), Clock()
    m.sys.files["/proc/pressure/memory"] = ("some avg10=45.00 avg60=20.00 avg300=5.00 total=9\n"
                                            "full avg10=12.50 avg60=3.00 avg300=1.00 total=9\n")
    g = guard(m, clock)
    assert not g.may_claim() and g.pause == "pressure"
    assert g.reason == "pressure: memory pressure critical (PSI memory some 45 %, full 12.5 % of the last 10 s)"
    assert guard(m, clock, psi_full_pct=20).may_claim()  # the threshold is a setting: warn only, then
    assert guard(m, clock, psi_full_pct=20).status()["memory_pressure"] == "warn"


def test_the_model_set_loads_nothing_more_under_pressure_and_unloads_its_idle_models():
    clock, why = Clock(), [None]
    a, b, c = member("a", 100), member("b", 100), member("c", 100, pinned=True)
    s = ModelSet([a, b, c], budget_bytes=1000 * MIB, keep_alive_s=600, wait_s=0, clock=clock)
    s.hold = lambda: why[0]
    s.start()
    assert s.run(task(), model="a").status == "ok"
    clock.now += 1
    assert s.run(task(), model="b").status == "ok"
    why[0] = "memory pressure warn (macOS): no further model is loaded, idle ones are unloaded"
    assert s.reap() == ["a"]  # b served last stays, c is pinned
    assert (a.loaded, b.loaded, c.loaded) == (False, True, True)
    r = s.run(task(), model="a")
    assert r.status == "error" and r.error.code == "model_unavailable" and r.error.retryable
    assert "no model loads now: memory pressure warn" in r.error.message
    assert s.run(task(), model="b").status == "ok"  # what it holds it serves
    why[0] = None
    assert s.run(task(), model="a").status == "ok" and a.loaded


def test_the_health_gauges_and_readiness(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    m, clock = Machine("rpi5-8gb-hot"), Clock()
    g = guard(m, clock)
    g.may_claim()
    registry = CollectorRegistry()
    registry.register(HealthCollector(g))
    text = generate_latest(registry).decode()
    assert "nodeagent_temperature_celsius 84.5" in text and "nodeagent_throttled 1.0" in text
    assert "nodeagent_cpu_freq_ratio 0.625" in text and "nodeagent_memory_pressure 0.0" in text
    assert "nodeagent_psi_memory_full_avg10 0.0" in text and "nodeagent_undervolted 0.0" in text
    assert 'nodeagent_health_pause{cause="heat"} 1.0' in text and 'nodeagent_health_pause{cause="battery"} 0.0' in text
    samples = [line.split()[0] for line in text.splitlines() if not line.startswith("#")]
    assert "nodeagent_on_battery" not in samples and "nodeagent_battery_pct" not in samples  # no supply: no sample
    assert readiness(g) == "paused: heat: the Pi's soft temperature limit, the Pi's firmware throttles"
    mac = Machine("macbook-battery-hot")
    registry = CollectorRegistry()
    registry.register(HealthCollector(read=mac.read))  # no guard (serve without a broker): a fresh reading
    text = generate_latest(registry).decode()
    assert "nodeagent_on_battery 1.0" in text and "nodeagent_battery_pct 20.0" in text
    assert "nodeagent_throttled 1.0" in text
    assert "nodeagent_temperature_celsius" not in [line.split()[0] for line in text.splitlines() if line[0] != "#"]
    cool = guard(Machine("desktop-cool"), Clock())
    assert cool.may_claim() and readiness(cool) is None and readiness(None) is None
    crit = guard(Machine("mac-memory-critical"), Clock())
    crit.may_claim()
    assert readiness(crit) == "paused: pressure: memory pressure critical (macOS)"
    registry = CollectorRegistry()
    registry.register(HealthCollector(crit))
    assert "nodeagent_memory_pressure 2.0" in generate_latest(registry).decode()


def test_status_shows_each_nodes_health(tmp_path):
    from nodeagent.broker.base import NodeRecord
    from nodeagent.fleet.status import fleet_status

    b = open_broker(f"sqlite://{tmp_path / 'queue.db'}", tmp_path)
    hot, volt = guard(Machine("rpi5-8gb-hot"), Clock()), guard(Machine("rpi4-4gb-undervolted"), Clock())
    for name, g in (("pi5", hot), ("pi4", volt)):
        g.may_claim()
        b.register(NodeRecord(id=name, hostname=name, agent_version="t", os="linux", arch="aarch64", backend="fake",
                              state="ready", heartbeat_s=10))
        b.heartbeat(name, {"guard": g.state, "guard_status": g.status()})
    data = fleet_status(b, 30)
    by = {n.id: n.health for n in data.nodes}
    assert by["pi5"].pause == "heat" and by["pi5"].temperature_c == 84.5 and by["pi5"].freq_ratio == 0.625
    assert by["pi4"].undervolted is True and by["pi4"].pause is None
    assert any(a.startswith("node pi4 is under-volted") for a in data.alerts)
    env = {"NODEAGENT_HOME": str(tmp_path), "NODEAGENT_CONFIG": str(tmp_path / "c.toml"), "COLUMNS": "300"}
    proc = cli(["status", "--broker", f"sqlite://{tmp_path / 'queue.db'}"], env)
    rows = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.count("│") >= 8}
    assert "Node health" in proc.stdout
    assert "heat: the Pi's soft temperature limit" in rows["pi5"] and "84.5 °C (hot)" in rows["pi5"]
    assert "frequency capped, throttled, soft temperature limit" in rows["pi5"] and "62%" in rows["pi5"]
    assert "UNDER-VOLTAGE, throttled" in rows["pi4"] and "33%" in rows["pi4"]
    assert "alert: node pi4 is under-volted" in proc.stderr
    shown = json.loads(cli(["status", "--broker", f"sqlite://{tmp_path / 'queue.db'}", "--json"], env).stdout)
    assert {n["id"]: n["health"]["temperature_c"] for n in shown["nodes"]} == {"pi5": 84.5, "pi4": 52.6}
    b.close()


def test_the_scheduler_reads_a_nodes_health_from_its_record():
    from nodeagent.broker.base import NodeRecord
    from nodeagent.fleet.scheduler import health_of

    hot = guard(Machine("rpi5-8gb-hot"), Clock())
    hot.may_claim()
    r = NodeRecord(id="pi5", hostname="pi5", agent_version="t", os="linux", arch="aarch64", backend="fake",
                   guard=hot.state, guard_status=hot.status())
    h = health_of(r)
    assert h["paused"].startswith("heat: the Pi's soft") and h["freq_ratio"] == 0.625 and h["warm"]
    mac = guard(Machine("macbook-battery-hot"), Clock(), thermal_pressure="trapping")
    mac.may_claim()
    h = health_of(r.model_copy(update={"guard": mac.state, "guard_status": mac.status()}))
    assert h["paused"].startswith("battery:") and h["on_battery"] and h["warm"] and h["freq_ratio"] == 1.0
    cpu = r.model_copy(update={"guard": "paused", "guard_status": {"pause": "cpu", "reason": "CPU 95% > 90%"}})
    assert health_of(cpu)["paused"] == ""  # other processes' CPU is not the device's health
    old = r.model_copy(update={"guard": "ok", "guard_status": {}})  # an older node's record
    assert health_of(old) == {"paused": "", "holding": "", "freq_ratio": 1.0, "on_battery": False, "warm": False}


def _worker(url: str, env: dict, home) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nodeagent", "worker", "--model", "fake", "--broker", url,
                             "--heartbeat", "0.3", "--lease", "2"],
                            env={**os.environ, **QUIET_GUARD, **env, "NODEAGENT_HOME": str(home)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_worker_on_a_hot_machine_claims_nothing_and_its_record_says_why(isolated_env, tmp_path):
    url = f"sqlite://{tmp_path / 'queue.db'}"
    broker = open_broker(url, tmp_path)
    client = Client(broker)
    ids = [client.submit(ClassifyTask(input=f"item {i}", labels=["a", "b"])) for i in range(3)]
    hot = _worker(url, {**isolated_env, "NODEAGENT_HARDWARE_FIXTURE": str(HARDWARE / "rpi5-8gb-hot.json")},
                  tmp_path / "hot")
    try:
        record = None
        deadline = time.time() + 60
        while time.time() < deadline:
            nodes = broker.nodes()
            if nodes and nodes[0].guard_status.get("pause"):
                record = nodes[0]
                break
            time.sleep(0.1)
        assert record is not None, hot.stderr.read() if hot.poll() is not None else "no heartbeat with a pause"
        time.sleep(1.0)  # several claim rounds
        assert all(broker.get(i).state == "ready" for i in ids)  # claimed nothing
        assert record.guard == "paused" and record.guard_status["pause"] == "heat"
        assert record.guard_status["reason"].startswith("heat: the Pi's soft temperature limit")
        assert record.guard_status["health"]["temperature_c"] == 84.5
    finally:
        hot.send_signal(signal.SIGTERM)
        hot.communicate(timeout=30)
    cool = _worker(url, {**isolated_env, "NODEAGENT_HARDWARE_FIXTURE": str(HARDWARE / "desktop-cool.json")},
                   tmp_path / "cool")
    try:
        results = [client.wait(i, timeout=60) for i in ids]
        assert all(r is not None and r.status == "ok" for r in results)  # the cool machine serves them
        deadline = time.time() + 30
        while time.time() < deadline:  # its next heartbeat
            cool_record = next(n for n in broker.nodes() if n.id != record.id)
            if "thermal" in cool_record.guard_status:
                break
            time.sleep(0.1)
        assert cool_record.guard == "ok" and cool_record.guard_status["pause"] is None, cool_record.guard_status
        # the hot worker, stopped, says so: the final beat lands last
        assert next(n for n in broker.nodes() if n.id == record.id).state == "stopped"
        assert cool_record.guard_status["thermal"] == "cool"
        assert cool_record.guard_status["health"]["temperature_c"] == 41.0
    finally:
        cool.send_signal(signal.SIGTERM)
        cool.communicate(timeout=30)
    broker.close()


def test_the_policies_are_settings_and_a_fixture_drives_the_workers_guard(tmp_path):
    from nodeagent.config import resolve
    from nodeagent.fleet.guard import guard_for

    config = resolve(env={"NODEAGENT_ON_BATTERY": "drain", "NODEAGENT_GUARD_TEMP_C": "70",
                          "NODEAGENT_GUARD_THERMAL_PRESSURE": "moderate", "NODEAGENT_BATTERY_MIN_PCT": "50",
                          "NODEAGENT_GUARD_PSI_FULL_PCT": "5", "NODEAGENT_HOME": str(tmp_path),
                          "NODEAGENT_HARDWARE_FIXTURE": str(HARDWARE / "desktop-cool.json")})
    g = guard_for(config, "n1")
    c = g.config
    assert (c.on_battery, c.temp_c, c.thermal_pressure, c.battery_min_pct, c.psi_full_pct) == ("drain", 70.0,
                                                                                               "moderate", 50.0, 5.0)
    assert (c.cool_c, c.heat_pause_s, c.psi_some_pct) == (10.0, 60.0, 20.0)  # the settings' one defaults
    g.read = lambda: Readings(memory_pct=1, cpu_pct=0)
    assert g.may_claim() and g.health.temperature_sensor == "thermal_zone1 x86_pkg_temp"  # the recorded machine's
    assert GuardConfig().on_battery == "pause" and GuardConfig().temp_c == 85.0
