"""The device's health reading (hardware/health.py) and the model folder's storage (hardware/storage.py): each
recorded machine's reading as `nodeagent probe --json` gives it, what Linux offers on this machine, the storage
measured within its bound and cached, and a plan made on the device charging its cold start at the measured
speed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import HARDWARE, cli

from nodeagent.hardware import probe
from nodeagent.hardware.health import PiThrottle, memory_level, read_health, reader_for
from nodeagent.hardware.storage import load_cache, locate, measure, storage_info
from nodeagent.hardware.system import LiveSystem, RecordedSystem

MODELS = "/home/pi/.local/share/nodeagent/models"


def reading(name: str, folder: str = MODELS):
    return reader_for(HARDWARE / f"{name}.json", folder).full()


def test_a_pi_5_hot_and_throttled():
    h = reading("rpi5-8gb-hot")
    assert h.temperature_c == 84.5 and h.temperature_sensor == "thermal_zone0 cpu-thermal"
    assert (h.cpu_freq_mhz, h.cpu_freq_max_mhz, h.cpu_freq_ratio) == (1500.0, 2400.0, 0.625)
    assert h.pi_throttle.raw == "0xe000e"  # found by the Pi 5's glob: soc@107c000000/...:firmware/get_throttled
    assert h.pi_throttle.now == ["frequency capped", "throttled", "soft temperature limit"]
    assert h.pi_throttle.since_boot == h.pi_throttle.now
    assert h.throttling == ["frequency capped", "throttled", "soft temperature limit"]
    assert not h.undervolted and h.undervolt_alarm is None  # no rpi_volt hwmon recorded: not read, not False
    assert h.power_source is None and h.battery_pct is None  # a Pi reports no power supply: never guessed
    assert (h.psi_memory_some_avg10, h.psi_memory_full_avg10, h.psi_cpu_some_avg10) == (0.0, 0.0, 1.84)
    assert h.thermal_pressure is None and h.memory_pressure is None  # macOS's
    assert h.clock_synced is True
    assert (h.storage.device, h.storage.kind) == ("nvme0n1", "nvme")
    assert h.storage.key == "nvme0n1/eui.0025388b21c4d2a7" and h.storage.read_mb_s is None


def test_a_pi_4_under_volted_on_its_sd_card():
    h = reading("rpi4-4gb-undervolted")
    assert h.pi_throttle.raw == "0x50005"
    assert h.pi_throttle.now == ["under-voltage", "throttled"] == h.pi_throttle.since_boot
    assert h.undervolt_alarm is True and h.undervolted
    assert h.throttling == ["throttled"]  # under-voltage is power's, not a throttle reason of its own
    assert h.temperature_c == 52.6 and h.cpu_freq_ratio == pytest.approx(1 / 3)
    assert (h.storage.device, h.storage.kind) == ("mmcblk0", "sd")
    assert h.storage.key == "mmcblk0/035344534331323880a1b2c3d4013b00"  # the card's CID: another card, another key
    assert h.clock_synced is False


def test_a_macbook_on_battery_under_heavy_thermal_pressure():
    h = reading("macbook-battery-hot")
    assert h.thermal_pressure == "heavy" and h.throttling == ["thermal pressure heavy"]
    assert (h.power_source, h.battery_pct, h.battery_status, h.low_power_mode) == ("battery", 20.0, "discharging",
                                                                                   False)
    assert h.on_battery and h.memory_pressure == "normal"
    assert h.swap_used_bytes == int(311.75 * (1 << 20))
    assert h.temperature_c is None and h.cpu_freq_mhz is None  # macOS gives neither without root
    assert h.psi_memory_full_avg10 is None and h.pi_throttle is None
    assert (h.storage.device, h.storage.kind) == ("disk3", "nvme")  # Apple Fabric: the internal SSD


def test_a_mac_at_critical_memory_pressure():
    h = reading("mac-memory-critical")
    assert h.memory_pressure == "critical" and h.swap_used_bytes == int(6144.5 * (1 << 20))
    assert h.power_source == "mains" and h.battery_pct is None and not h.on_battery
    assert h.thermal_pressure == "nominal" and h.throttling == []


def test_a_cool_desktop():
    h = reading("desktop-cool", "/home/me/models")
    assert h.temperature_c == 41.0 and h.temperature_sensor == "thermal_zone1 x86_pkg_temp"  # the CPU's, not acpitz
    assert h.power_source == "mains" and h.battery_pct is None  # the mouse's battery (scope Device) is not ours
    assert h.throttling is None and h.pi_throttle is None
    assert h.swap_used_bytes == (8388604 - 8126460) * 1024
    assert (h.storage.device, h.storage.kind) == ("sda", "ssd")
    tmp = reading("desktop-cool", "/tmp/models").storage  # tmpfs: no block device of its own
    assert tmp.device is None and tmp.kind is None and tmp.key.startswith("tmpfs:")


def test_probe_json_has_the_health_of_a_recorded_machine(isolated_env):
    env = {**isolated_env, "NODEAGENT_HARDWARE_FIXTURE": str(HARDWARE / "rpi5-8gb-hot.json")}
    out = json.loads(cli(["probe", "--json"], env).stdout)
    h = out["health"]
    assert h["temperature_c"] == 84.5 and h["pi_throttle"]["now"][-1] == "soft temperature limit"
    assert h["cpu_freq_mhz"] == 1500.0 and h["battery_pct"] is None and h["clock_synced"] is True
    assert h["storage"]["kind"] == "nvme" and h["storage"]["read_mb_s"] is None  # a recorded machine: never measured
    assert out["hardware"]["storage"]["device"] == "nvme0n1"
    table = cli(["probe"], env).stdout
    assert "84.5 °C (thermal_zone0 cpu-thermal)" in table and "0xe000e" in table and "soft temperature" in table


def test_a_linux_laptop_on_battery_and_under_memory_pressure():
    sys = RecordedSystem(facts={"system": "linux", "machine": "x86_64"}, files={
        "/sys/class/power_supply/AC/type": "Mains\n", "/sys/class/power_supply/AC/online": "0\n",
        "/sys/class/power_supply/BAT0/type": "Battery\n", "/sys/class/power_supply/BAT0/capacity": "23\n",
        "/sys/class/power_supply/BAT0/status": "Discharging\n",
        "/proc/pressure/memory": "some avg10=31.50 avg60=12.00 avg300=3.00 total=1\n"
                                 "full avg10=12.25 avg60=4.00 avg300=1.00 total=1\n"})
    h = read_health(sys)
    assert (h.power_source, h.battery_pct, h.battery_status) == ("battery", 23.0, "discharging")
    assert (h.psi_memory_some_avg10, h.psi_memory_full_avg10) == (31.5, 12.25)
    assert memory_level(h, 20, 10) == "critical" and memory_level(h, 20, 15) == "warn"
    assert memory_level(h, 40, 15) == "normal"
    charging = RecordedSystem(facts=sys.facts, files={**sys.files, "/sys/class/power_supply/BAT0/status": "Charging\n"})
    assert read_health(charging).power_source == "mains"


def test_the_throttle_flags_decode_as_documented():
    t = PiThrottle.decode(0x50005)
    assert t.now == ["under-voltage", "throttled"] and t.since_boot == ["under-voltage", "throttled"]
    assert PiThrottle.decode(0).now == [] and PiThrottle.decode(0x80000).since_boot == ["soft temperature limit"]


def test_a_recorded_glob_matches_as_glob_does():
    sys = RecordedSystem(facts={}, files={"/sys/class/thermal/thermal_zone0/temp": "1", "/sys/class/thermal/"
                                          "thermal_zone10/temp": "2", "/sys/class/thermal/cooling_device0/type": "x"})
    assert sys.glob("/sys/class/thermal/thermal_zone*/temp") == ["/sys/class/thermal/thermal_zone0/temp",
                                                                 "/sys/class/thermal/thermal_zone10/temp"]
    assert sys.glob("/sys/class/thermal/*") == [  # folders too; * never crosses a /
        "/sys/class/thermal/cooling_device0", "/sys/class/thermal/thermal_zone0", "/sys/class/thermal/thermal_zone10"]


def test_this_machine_reads_what_linux_offers_here(isolated_env, tmp_path):
    """`nodeagent probe --json` on this machine: thermal zones, cpufreq, power supplies and PSI where this kernel
    has them, null where it has not; the storage measured once, within its bound, and cached."""
    env = {**isolated_env, "NODEAGENT_MODEL_DIR": str(tmp_path / "models")}
    started = time.monotonic()
    out = json.loads(cli(["probe", "--json"], env).stdout)
    h = out["health"]
    zones = [p for p in Path("/sys/class/thermal").glob("thermal_zone*/temp")]
    assert (h["temperature_c"] is not None) == bool(zones)
    assert (h["cpu_freq_mhz"] is not None) == Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq").exists()
    psi = Path("/proc/pressure/memory")
    if psi.exists():
        some = float(psi.read_text().split()[1].split("=")[1])
        assert h["psi_memory_some_avg10"] is not None and abs(h["psi_memory_some_avg10"] - some) < 50
        assert 0 <= h["psi_cpu_some_avg10"] <= 100
    else:
        assert h["psi_memory_some_avg10"] is None
    assert (h["power_source"] is None) == (not any(Path("/sys/class/power_supply").glob("*/type")))
    assert h["thermal_pressure"] is None and h["memory_pressure"] is None and h["low_power_mode"] is None
    from nodeagent.clock import wall_synced

    assert h["clock_synced"] == wall_synced()
    s = h["storage"]
    assert s["read_mb_s"] > 0 and s["method"] and s["measured_at"]
    assert time.monotonic() - started < 15  # two interpreter starts and one bounded measurement
    cached = load_cache(Path(isolated_env["NODEAGENT_HOME"]))
    assert cached[s["key"]]["read_mb_s"] == s["read_mb_s"]
    again = json.loads(cli(["probe", "--json"], env).stdout)["health"]["storage"]
    assert again["measured_at"] == s["measured_at"]  # measured once per device, then read from storage.json


def test_the_storage_measurement_takes_under_5_s_and_says_how(tmp_path):
    folder = tmp_path / "models"
    t = time.monotonic()
    m = measure(folder)
    assert time.monotonic() - t < 5
    assert m["read_mb_s"] > 1 and m["bytes"] > 0 and "temporary file" in m["method"]
    assert list(tmp_path.iterdir()) == []  # written in the folder above (none is made), and gone
    folder.mkdir()
    big = folder / "model.gguf"
    with open(big, "wb") as fh:
        for _ in range(12):
            fh.write(os.urandom(8 << 20))
    t = time.monotonic()
    m = measure(folder)
    assert time.monotonic() - t < 5
    assert "of model.gguf read" in m["method"] and m["bytes"] == 96 << 20
    assert "O_DIRECT" in m["method"] or "posix_fadvise" in m["method"]


def test_storage_is_measured_once_per_device_and_a_recorded_machine_never(tmp_path):
    state = tmp_path / "state"
    live = storage_info(LiveSystem(), str(tmp_path / "models"), state, measure_now=True)
    assert live.read_mb_s and live.key in load_cache(state)
    again = storage_info(LiveSystem(), str(tmp_path / "other"), state, measure_now=True)
    assert again.key == live.key and again.measured_at == live.measured_at  # the same device: not measured again
    recorded = RecordedSystem.load(HARDWARE / "rpi4-4gb-undervolted.json")
    assert storage_info(recorded, MODELS, state, measure_now=True).read_mb_s is None
    assert set(load_cache(state)) == {live.key}


def test_a_plan_on_the_device_charges_its_cold_start_at_the_measured_speed(header_7b, tmp_path):
    """The Pi 5's profile says 90 MB/s; its NVMe measured at 31.5 MB/s (a slow drive) is what the plan charges,
    and says so; without a measurement the profile's figure."""
    from nodeagent.config import resolve
    from nodeagent.hardware.storage import remember
    from nodeagent.node import Node

    env = {"NODEAGENT_HOME": str(tmp_path / "state"), "NODEAGENT_MODEL_DIR": MODELS,
           "NODEAGENT_HARDWARE_FIXTURE": str(HARDWARE / "rpi5-8gb-hot.json"), "NODEAGENT_OFFLINE": "1"}

    def cold(config):
        plan = Node(str(header_7b), config=config).plan
        return next(r for r in plan.reasons if r.startswith("cold start")), plan

    said, plan = cold(resolve(env=env))
    assert "90 MB/s (rpi5-8gb's disk)" in said
    key = locate(RecordedSystem.load(HARDWARE / "rpi5-8gb-hot.json"), MODELS).key
    remember(tmp_path / "state", key, {"read_mb_s": 31.5, "measured_at": 1.0, "method": "recorded"})
    said, plan = cold(resolve(env=env))
    weights = plan.memory.weights_mapped_bytes + plan.memory.weights_anon_bytes + plan.memory.weights_gpu_bytes
    assert "31.5 MB/s (measured on this device's nvme nvme0n1)" in said
    assert f"about {weights / 31.5e6:.0f} s" in said


def test_probe_records_the_storage_of_its_disk_path():
    hw = probe(RecordedSystem.load(HARDWARE / "desktop-cool.json"), disk_path="/home/me/models")
    assert hw.storage.kind == "ssd" and hw.storage.device == "sda"
    assert probe(RecordedSystem.load(HARDWARE / "rpi4-4gb.json"), disk_path="/models").storage.device is None


def test_on_macos_diskutil_is_asked_once_and_kept(tmp_path):
    """This machine's volume on macOS (a LiveSystem whose system and commands are a recorded Mac's): diskutil runs
    once, and later processes read its answer from storage.json."""
    mac = RecordedSystem.load(HARDWARE / "macbook-battery-hot.json")
    asked: list[list[str]] = []

    class Mac(LiveSystem):
        def system(self) -> str:
            return "darwin"

        def command(self, argv: list[str]) -> str | None:
            asked.append(argv)
            return mac.command(argv)

    first = storage_info(Mac(), "/Users/me/models", tmp_path)
    again = storage_info(Mac(), "/Users/me/other", tmp_path)
    assert (first.device, first.kind) == (again.device, again.kind) == ("disk3", "nvme")
    assert asked == [["diskutil", "info", "/"]]
    assert load_cache(tmp_path)["volume /"]["key"] == first.key
    storage_info(Mac(), "/Volumes/USB/models", tmp_path)
    assert asked[-1] == ["diskutil", "info", "/Volumes/USB"]  # another volume: asked for it
