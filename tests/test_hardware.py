"""probe() on recorded machines: every platform path reads through the injected source."""

from __future__ import annotations

import pytest
from conftest import HARDWARE

from nodeagent.hardware import RecordedSystem, probe
from nodeagent.hardware.raspberrypi import decode_revision
from nodeagent.profiles import match_profile

GIB = 1 << 30


def load(name: str):
    return probe(RecordedSystem.load(HARDWARE / f"{name}.json"), disk_path="/models")


def test_rpi4_4gb():
    hw = load("rpi4-4gb")
    assert hw.raspberry_pi.model == "Raspberry Pi 4 Model B Rev 1.4"
    assert hw.raspberry_pi.board == "4B" and hw.raspberry_pi.soc == "BCM2711"
    assert hw.raspberry_pi.ram_bytes == 4 * GIB
    assert hw.cpu_model == "ARM Cortex-A72"
    assert hw.apple is None and hw.gpus == []
    assert hw.cgroup is None  # no memory.max anywhere
    assert match_profile(hw).profile_id == "rpi4-4gb"


def test_rpi5_8gb():
    hw = load("rpi5-8gb")
    assert hw.raspberry_pi.board == "5" and hw.raspberry_pi.soc == "BCM2712"
    assert hw.raspberry_pi.ram_bytes == 8 * GIB
    assert hw.cpu_model == "ARM Cortex-A76"
    assert match_profile(hw).profile_id == "rpi5-8gb"


def test_m1_8gb_estimates_working_set():
    hw = load("m1-8gb")
    a = hw.apple
    assert a.chip == "Apple M1" and hw.cpu_model == "Apple M1"
    assert (a.performance_cores, a.efficiency_cores) == (4, 4)
    assert a.unified_memory_bytes == 8 * GIB
    assert a.metal_working_set_source == "estimate"
    assert a.metal_working_set_bytes == 8 * GIB * 2 // 3
    assert hw.raspberry_pi is None and hw.cgroup is None
    assert match_profile(hw).profile_id == "apple-m1-8gb"


def test_m2_pro_16gb_reads_mlx_working_set():
    hw = load("m2-pro-16gb")
    assert hw.apple.metal_working_set_source == "mlx"
    assert hw.apple.metal_working_set_bytes == 11_453_251_584
    assert (hw.apple.performance_cores, hw.apple.efficiency_cores) == (6, 4)
    m = match_profile(hw)
    assert m.profile_id == "apple-m2-pro-16gb"
    assert any("Apple M2 Pro" in r for r in m.reasons)


def test_m3_max_wired_limit_sysctl():
    hw = load("m3-max-64gb-wired")
    assert hw.apple.metal_working_set_source == "sysctl iogpu.wired_limit_mb"
    assert hw.apple.metal_working_set_bytes == 57344 << 20
    assert match_profile(hw).profile_id == "apple-m3-max-64gb"


def test_container_cgroup_limits():
    hw = load("linux-x86-container")
    assert hw.cgroup.memory_max_bytes == 4 * GIB
    assert hw.cgroup.memory_current_bytes == 512 << 20
    assert hw.cgroup.cpu_max_cores == 2.0
    assert hw.memory_limit_bytes == 4 * GIB
    assert hw.memory_available_bytes == 4 * GIB - (512 << 20)  # cgroup room, not the host's 56 GiB
    assert hw.cpu_model == "AMD Ryzen 7 5800X 8-Core Processor"
    m = match_profile(hw)
    assert m.profile_id == "linux-cpu"
    from nodeagent.profiles import get_profile

    assert get_profile("linux-cpu").threads_for(hw) == 2  # capped by cpu.max


def test_nvidia_gpu_and_unlimited_cgroup():
    hw = load("linux-nvidia")
    assert hw.gpus[0].name == "NVIDIA GeForce RTX 4090"
    assert hw.gpus[0].memory_total_bytes == 25_757_220_864
    assert hw.cgroup is None  # memory.max "max", cpu.max "max"
    assert match_profile(hw).profile_id == "linux-nvidia"


@pytest.mark.parametrize("code,expected", [
    ("c03114", ("4B", "BCM2711", 4 * GIB)), ("d03114", ("4B", "BCM2711", 8 * GIB)),
    ("d04170", ("5", "BCM2712", 8 * GIB)), ("e04171", ("5", "BCM2712", 16 * GIB)),
    ("902120", ("Zero 2 W", "BCM2837", 512 << 20)), ("a02082", ("3B", "BCM2837", 1 * GIB)),
    ("000e", (None, None, None)), ("zz", (None, None, None)),
])
def test_revision_codes(code, expected):
    assert decode_revision(code) == expected


def test_live_probe_runs_here():
    hw = probe(disk_path="/tmp")
    assert hw.os == "linux" and hw.cores_logical >= 1
    assert 0 < hw.ram_available_bytes <= hw.ram_total_bytes
    assert hw.llama_cpp.installed and hw.llama_cpp.mmap
    assert hw.disk_free_bytes and hw.disk_free_bytes > 0


@pytest.mark.parametrize("name, board, ram_gib", [("rpi5-2gb", "5", 2), ("rpi5-4gb", "5", 4), ("rpi4-1gb", "4B", 1),
                                                   ("rpi4-2gb", "4B", 2)])
def test_every_common_pi_size_has_its_own_profile(name, board, ram_gib):
    """The boards people buy (the revision codes of the published table): a profile each, none of them the generic
    linux-cpu one with an SSD's disk and a desktop's memory reserve."""
    hw = load(name)
    assert hw.raspberry_pi.board == board and hw.raspberry_pi.ram_bytes == ram_gib * GIB
    m = match_profile(hw)
    assert m.profile_id == name and m.fell_back is None
    assert any(f"Raspberry Pi {board}" in r for r in m.reasons)


def test_a_board_with_no_profile_says_which_it_fell_back_to_and_why(tmp_path):
    """A Pi 3 B (revision a02082) matches no Pi profile: the generic one, and the match says why, and what the
    generic one assumes; probe and plan show it."""
    import json

    data = json.loads((HARDWARE / "rpi4-1gb.json").read_text())
    files = data["files"]
    files["/proc/cpuinfo"] = files["/proc/cpuinfo"].replace("Revision\t: a03111", "Revision\t: a02082").replace(
        "Raspberry Pi 4 Model B Rev 1.1", "Raspberry Pi 3 Model B Rev 1.2")
    files["/proc/device-tree/model"] = "Raspberry Pi 3 Model B Rev 1.2\x00"
    hw = probe(RecordedSystem(data["facts"], files), disk_path="/models")
    m = match_profile(hw)
    assert m.profile_id == "linux-cpu" and hw.raspberry_pi.board == "3B"
    assert m.fell_back.startswith("this Raspberry Pi 3 Model B Rev 1.2 (0.9 GiB) has no profile of its own")
    assert "planned with linux-cpu, the generic one (a 512 MiB memory reserve" in m.fell_back
    assert "500 MB/s disk" in m.fell_back and "--profile ID" in m.fell_back
    from conftest import cli

    fixture = tmp_path / "pi3.json"
    fixture.write_text(json.dumps(data))
    env = {"NODEAGENT_HARDWARE_FIXTURE": str(fixture), "NODEAGENT_OFFLINE": "1"}
    probed = json.loads(cli(["probe", "--json"], env).stdout)
    assert probed["profile"]["fell_back"] == m.fell_back
    assert "fell back" in cli(["probe"], env).stdout
    plan = json.loads(cli(["plan", "smollm2-135m-instruct", "--json"], env).stdout)
    assert plan["reasons"][0] == f"profile linux-cpu: {m.fell_back}"
    big = load("rpi4-4gb").model_copy(update={"ram_total_bytes": 2 * (8 << 30)})  # a Pi 4 larger than any board
    odd = match_profile(big)
    assert odd.profile_id == "linux-cpu" and "rpi4-4gb: memory" in odd.fell_back and "rpi4-8gb: memory" in \
        odd.fell_back
