"""`nodeagent doctor`: each check on recorded machines, the CLI as a user types it, and the hub's messages when
there is no network.

A recorded machine (tests/fixtures/doctor/*.json) is a hardware fixture (the format ``RecordedSystem`` reads:
/proc/cpuinfo, sysctl values, and what llama.cpp reports, with the ``llama_print_system_info()`` text its
``cpu_features`` come from) plus a ``doctor`` section: the environment, the executables on PATH, the service
manager's answer, and the status each check must give there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

import pytest
from conftest import FIXTURES, HARDWARE

from nodeagent.broker.open import open_broker
from nodeagent.config import resolve
from nodeagent.doctor import CHECKS, Check, Edges, live_edges, run_checks
from nodeagent.doctor.build import PORTABLE_X86, cmake_args, cpu_flags, llama_build_check
from nodeagent.doctor.dirs import model_dir_check, secret_files_check, state_dir_check
from nodeagent.doctor.edges import InstalledService, http_head
from nodeagent.doctor.network import broker_check, clock_check, hub_check
from nodeagent.doctor.service import service_check
from nodeagent.errors import ConfigError, HubError, ProbeError
from nodeagent.hardware.system import RecordedSystem, build_features
from nodeagent.store.hub import OFFLINE_WORKS

DOCTOR = FIXTURES / "doctor"
MACHINES = sorted(p.stem for p in DOCTOR.glob("*.json"))
ROOT = Path(__file__).resolve().parent.parent
NAMES = ["llama.cpp build", "python", "build tools", "SOURCE_DATE_EPOCH", "model directory", "state directory",
         "secret files", "broker", "broker journal", "broker disk", "clock", "model hub",
         "service"]  # the SQLite broker's findings
# variables of the caller's shell that would change what a child process checks
SHELL_SETTINGS = ("NODEAGENT_BROKER", "NODEAGENT_HARDWARE_FIXTURE", "NODEAGENT_OFFLINE", "HF_HUB_OFFLINE",
                  "NODEAGENT_PROFILE", "SOURCE_DATE_EPOCH")


def config_in(tmp_path: Path, **env: str):  # type: ignore[no-untyped-def]
    return resolve(env={"NODEAGENT_HOME": str(tmp_path / "state"), "NODEAGENT_MODEL_DIR": str(tmp_path / "models"),
                        "NODEAGENT_CONFIG": str(tmp_path / "none.toml"), **env})


def recorded(name: str, tmp_path: Path, system: RecordedSystem | None = None, **changes) -> Edges:  # type: ignore[no-untyped-def]
    """The edges of a recorded machine: its hardware, environment, PATH and service; a real SQLite broker in
    tmp_path; a hub that answers."""
    path = DOCTOR / f"{name}.json" if (DOCTOR / f"{name}.json").exists() else HARDWARE / f"{name}.json"
    data = json.loads(path.read_text())
    doctor = data.get("doctor", {"env": {}, "path": [], "service": None})
    system = system or RecordedSystem.load(path)
    service = doctor["service"]
    config = config_in(tmp_path)

    def services(manager: str) -> list[InstalledService]:
        if service and service["manager"] == manager:
            name = "nodeagent-node.service" if manager == "systemd" else "io.nodeagent.node.plist"
            return [InstalledService(file=name, user=service["user"], status=service["status"],
                                     text=service.get("text", ""))]
        return []

    edges = Edges(system=system, config=config, llama=system.llama_cpp, env=doctor["env"],
                  which=lambda n: f"/usr/bin/{n}" if n in doctor["path"] else None,
                  disk_free=lambda p: data["facts"]["disk_free_bytes"],
                  open_broker=lambda: open_broker(None, config.state_dir), head=lambda url, timeout_s: 200,
                  services=services)
    return dataclasses.replace(edges, **changes)


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


# -- every recorded machine --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MACHINES)
def test_each_recorded_machine_gets_the_statuses_it_records(name, tmp_path):
    expect = json.loads((DOCTOR / f"{name}.json").read_text())["doctor"]["expect"]
    checks = run_checks(recorded(name, tmp_path))
    assert [c.name for c in checks] == NAMES
    got = by_name(checks)
    assert {n: got[n].status for n in expect} == expect
    # what is not recorded is this test's: a writable tmp_path, a SQLite broker, a hub that answers
    assert all(got[n].status == "ok" for n in ("model directory", "state directory", "broker", "clock", "model hub"))
    for c in checks:
        assert c.detail and "\n" not in c.detail
        assert c.status == "ok" or c.fix or c.name == "clock", c


@pytest.mark.parametrize("name", MACHINES)
def test_recorded_build_features_are_what_the_system_info_says(name):
    """The fixtures' cpu_features are llama_print_system_info()'s text as the probe parses it."""
    llama = json.loads((DOCTOR / f"{name}.json").read_text())["facts"]["llama_cpp"]
    assert llama["cpu_features"] == build_features(llama["system_info"])
    assert llama["system_info"].startswith(("CPU : ", "Metal : "))


def test_this_machines_llama_cpp_prints_the_format_the_fixtures_record():
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    text = info.decode() if isinstance(info, bytes) else str(info)
    assert " = 1 |" in text and ("CPU : " in text)
    assert set(build_features(text)) <= {"avx2", "avx512", "amx", "neon", "dotprod", "i8mm", "sve"}


# -- check 1: the build against the CPU ---------------------------------------------------------------------------
def test_pi4_with_a_dotprod_build_fails_with_the_native_rebuild(tmp_path):
    check = llama_build_check(recorded("rpi4-dotprod-build", tmp_path))
    assert check.status == "fail"
    assert "dotprod" in check.detail and "SIGILL" in check.detail and "Cortex-A72" in check.detail
    assert check.fix == ('CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --force-reinstall --no-cache-dir '
                         '--no-binary llama-cpp-python llama-cpp-python==0.3.36')
    assert "KLEIDIAI" not in check.detail  # a Pi 4 has neither dotprod nor i8mm


def test_pi5_with_a_generic_build_warns_and_mentions_kleidiai(tmp_path):
    check = llama_build_check(recorded("rpi5-generic-build", tmp_path))
    assert check.status == "warn"
    assert "has dotprod, which the build does not use" in check.detail and "i8mm" not in check.detail
    assert "-DGGML_CPU_KLEIDIAI=ON" in check.detail
    assert check.fix.startswith('CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --force-reinstall')


def test_m2_with_metal_is_ok_and_without_metal_warns(tmp_path):
    good = llama_build_check(recorded("m2-pro-metal", tmp_path))
    assert good.status == "ok" and "Metal" in good.detail and good.fix is None
    assert "dotprod" in good.detail and "i8mm" in good.detail
    bad = llama_build_check(recorded("m2-pro-no-metal", tmp_path))
    assert bad.status == "warn" and "no Metal" in bad.detail
    assert bad.fix.startswith('CMAKE_ARGS="-DGGML_METAL=on" pip install --force-reinstall --no-cache-dir '
                              "--no-binary llama-cpp-python llama-cpp-python==0.3.36")


def _x86(cpu_flags_line: str, system_info: str) -> RecordedSystem:
    base = RecordedSystem.load(HARDWARE / "linux-x86-container.json")
    llama = {**base.facts["llama_cpp"], "cpu_features": build_features(system_info)}
    cpuinfo = f"processor\t: 0\nmodel name\t: x86 test CPU\nflags\t\t: {cpu_flags_line}\n"
    files = {**base.files, "/proc/cpuinfo": cpuinfo}
    return RecordedSystem(facts={**base.facts, "llama_cpp": llama}, files=files, sysctls=base.sysctls)


def test_x86_rebuild_is_the_projects_portable_baseline_with_avx2(tmp_path):
    assert f'CMAKE_ARGS="{PORTABLE_X86}"' in (ROOT / "scripts" / "_venv.sh").read_text()
    system = _x86("fpu sse4_2 avx avx2 fma f16c bmi2", "CPU : SSE3 = 1 | AVX = 1 | F16C = 1 | FMA = 1 | ")
    check = llama_build_check(recorded("linux-x86-container", tmp_path, system=system))
    assert check.status == "warn" and "has avx2, which the build does not use" in check.detail
    assert check.fix.startswith(f'CMAKE_ARGS="{PORTABLE_X86}" pip install')
    assert "KLEIDIAI" not in check.detail


def test_x86_build_using_avx512_on_an_avx2_cpu_fails(tmp_path):
    system = _x86("fpu sse4_2 avx avx2 fma f16c bmi2", "CPU : AVX = 1 | AVX2 = 1 | AVX512 = 1 | FMA = 1 | ")
    check = llama_build_check(recorded("linux-x86-container", tmp_path, system=system))
    assert check.status == "fail" and "uses avx512, which this CPU (x86 test CPU) lacks" in check.detail


def test_x86_without_avx2_spells_each_default_option_off():
    """With GGML_NATIVE=OFF alone, llama.cpp's CMake turns AVX2, FMA, F16C and BMI2 on: a CPU without them
    gets each spelled OFF."""
    from nodeagent.hardware import probe

    system = _x86("fpu sse4_2 avx", "CPU : SSE3 = 1 | AVX = 1 | ")
    hw = probe(system)
    assert cmake_args(hw, cpu_flags(Edges(system=system, config=resolve(env={}), llama=system.llama_cpp))) == (
        "-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF "
        "-DGGML_BMI2=OFF")


def test_avx512_the_portable_build_leaves_out_is_said_not_warned(tmp_path):
    system = _x86("fpu sse4_2 avx avx2 fma f16c bmi2 avx512f", "CPU : AVX = 1 | AVX2 = 1 | FMA = 1 | ")
    check = llama_build_check(recorded("linux-x86-container", tmp_path, system=system))
    assert check.status == "ok" and "avx512 left unused on purpose" in check.detail


def test_no_llama_cpp_or_a_library_that_fails_to_load_fails(tmp_path):
    edges = recorded("rpi5-generic-build", tmp_path)
    system = edges.system
    missing = RecordedSystem(facts={**system.facts, "llama_cpp": {"installed": False}}, files=system.files)
    check = llama_build_check(recorded("rpi5-generic-build", tmp_path, system=missing))
    assert check.status == "fail" and check.detail == "llama-cpp-python is not installed"
    assert check.fix.endswith("llama-cpp-python==0.3.36")  # the version nodeagent pins

    def broken():
        raise ProbeError("loading llama-cpp-python killed the process with SIGILL (an illegal instruction)")

    check = llama_build_check(recorded("rpi5-generic-build", tmp_path, llama=broken))
    assert check.status == "fail" and "SIGILL" in check.detail and 'CMAKE_ARGS="-DGGML_NATIVE=ON"' in check.fix


def test_a_build_whose_features_were_not_recorded_warns(tmp_path):
    check = llama_build_check(recorded("rpi4-4gb", tmp_path))  # an older hardware fixture: no cpu_features
    assert check.status == "warn" and "could not be read" in check.detail


# -- check 2: what a rebuild needs ---------------------------------------------------------------------------------
def test_rebuild_environment_on_each_machine(tmp_path):
    pi5 = by_name(run_checks(recorded("rpi5-generic-build", tmp_path)))
    assert pi5["build tools"].status == "warn" and "no cmake" in pi5["build tools"].detail
    assert pi5["build tools"].fix == "sudo apt-get install -y build-essential cmake"
    mac = by_name(run_checks(recorded("m2-pro-no-metal", tmp_path)))
    assert mac["build tools"].fix == "xcode-select --install && pip install cmake"
    assert mac["SOURCE_DATE_EPOCH"].status == "warn" and "GGML_NATIVE" in mac["SOURCE_DATE_EPOCH"].detail
    assert mac["SOURCE_DATE_EPOCH"].fix == "unset SOURCE_DATE_EPOCH"


def test_rosetta_python_fails_by_either_sign(tmp_path):
    checks = by_name(run_checks(recorded("m2-rosetta", tmp_path)))
    assert checks["python"].status == "fail" and "Rosetta" in checks["python"].detail
    assert "arch -arm64" in checks["python"].fix and "/opt/homebrew" in checks["python"].fix
    assert checks["llama.cpp build"].status == "warn" and "Rosetta" in checks["llama.cpp build"].detail
    system = RecordedSystem.load(DOCTOR / "m2-rosetta.json")
    untranslated = {k: v for k, v in system.sysctls.items() if k != "sysctl.proc_translated"}
    by_machine = RecordedSystem(facts=system.facts, files=system.files, sysctls=untranslated)
    assert by_name(run_checks(recorded("m2-rosetta", tmp_path, system=by_machine)))["python"].status == "fail"
    intel = {k: v for k, v in untranslated.items() if k != "hw.optional.arm64"}
    intel_mac = RecordedSystem(facts=system.facts, files=system.files, sysctls=intel)
    assert by_name(run_checks(recorded("m2-rosetta", tmp_path, system=intel_mac)))["python"].status == "ok"


# -- check 3: directories --------------------------------------------------------------------------------------------
def test_directories_made_writable_or_not(tmp_path):
    edges = recorded("rpi5-generic-build", tmp_path)
    check = model_dir_check(edges)
    assert check.status == "ok" and "can be made" in check.detail and check.fix == f"mkdir -p {tmp_path / 'models'}"
    assert "smollm2-135m-instruct Q8_0" in check.detail  # what the free space was compared with
    (tmp_path / "state").mkdir(mode=0o755)
    os.chmod(tmp_path / "state", 0o755)  # the queue's folder, readable by other users: a fail, and the fix
    check = state_dir_check(edges)
    assert check.status == "fail" and "other users" in check.detail and check.fix == f"chmod 700 {tmp_path / 'state'}"
    os.chmod(tmp_path / "state", 0o700)
    assert state_dir_check(edges).status == "ok" and "writable" in state_dir_check(edges).detail
    (tmp_path / "file").write_text("x")
    under = config_in(tmp_path, NODEAGENT_MODEL_DIR=str(tmp_path / "file" / "m"))
    under_file = dataclasses.replace(edges, config=under)
    check = model_dir_check(under_file)
    assert check.status == "fail" and "is not a directory" in check.detail and "NODEAGENT_MODEL_DIR" in check.fix
    a_file = dataclasses.replace(edges, config=config_in(tmp_path, NODEAGENT_HOME=str(tmp_path / "file")))
    assert state_dir_check(a_file).status == "fail"


def test_a_file_that_holds_a_secret_others_may_read_fails_with_its_fix(tmp_path):
    """The config file when it holds a token or a broker URL's password, and the token and password files: each its
    owner's only, or a fail naming what it holds (never the secret) with chmod 600, or a file of its own."""
    config, token, password = tmp_path / "c.toml", tmp_path / "token", tmp_path / "redis.password"
    settings = {"NODEAGENT_CONFIG": str(config), "NODEAGENT_TOKEN_FILE": str(token),
                "NODEAGENT_BROKER_PASSWORD_FILE": str(password)}

    def check(**env: str) -> Check:
        return secret_files_check(recorded("rpi5-generic-build", tmp_path, config=config_in(tmp_path, **env)))

    assert check().status == "ok" and check().detail == "no config file, token file or password file to check"
    config.write_text('model_dir = "/srv/models"\n')  # no secret in it: readable by anyone, and fine
    config.chmod(0o644)
    assert check(NODEAGENT_CONFIG=str(config)).status == "ok"
    config.write_text('broker = "redis://:Zq7x/Q9-secret@q:6379/0?sentinel_password=SENT-5"\n')  # raw '/' and all
    token.write_text("a-token-long-enough-for-a-lan-0123\n")
    password.write_text("Zq7x-Q9-secret\n")
    for path in (token, password):
        path.chmod(0o640)
    loose = check(**settings)
    assert loose.status == "fail" and loose.detail == (
        f"{config} holds the Redis password (broker) and the Sentinels' password (broker) and can be read by other "
        f"users (644) (2 more: {token}, {password})")
    assert loose.fix == (f"chmod 600 {config}, or move them to files of their own (broker_password_file, "
                         "broker_sentinel_password_file: each a PATH, 0600)")
    assert not any(s in loose.detail + loose.fix for s in ("Q9-secret", "SENT-5", "Zq7x", "a-token"))
    config.chmod(0o600)
    token_only = check(**settings)
    assert token_only.detail == f"{token} holds the bearer token (NODEAGENT_TOKEN_FILE) and can be read by other " \
                                f"users (640) (1 more: {password})" and token_only.fix == f"chmod 600 {token}"
    for path in (token, password):
        path.chmod(0o600)
    fine = check(**settings)
    assert fine.status == "ok" and fine.detail.startswith(f"{config}, {token}, {password}: none")


def test_model_directory_smaller_than_the_smallest_model_warns(tmp_path):
    from nodeagent.doctor.dirs import smallest_default_file

    smallest = smallest_default_file()
    edges = recorded("rpi5-generic-build", tmp_path, disk_free=lambda p: smallest.size_bytes - 1)
    check = model_dir_check(edges)
    assert check.status == "warn" and f"{smallest.model_id} {smallest.quant}" in check.detail
    assert "no catalog model can be pulled" in check.detail and check.fix


# -- check 4: the broker and the clock ----------------------------------------------------------------------------
def test_broker_unreachable_fails_and_hides_its_password(tmp_path):
    reachable = broker_check(recorded("rpi5-generic-build", tmp_path))  # a real SQLite queue in tmp_path
    assert reachable.status == "ok" and reachable.detail == f"sqlite://{tmp_path / 'state' / 'queue.db'} answers"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = config_in(tmp_path, NODEAGENT_BROKER=f"redis://:hunter2@127.0.0.1:{port}/0")
    edges = recorded("rpi5-generic-build", tmp_path, config=config,
                     open_broker=lambda: open_broker(config.broker, config.state_dir))
    checks = by_name(run_checks(edges))
    assert checks["broker"].status == "fail" and "hunter2" not in checks["broker"].detail
    assert "redis://:***@127.0.0.1" in checks["broker"].detail and "redis-server" in checks["broker"].fix
    assert checks["clock"].status == "warn" and "not measured" in checks["clock"].detail


class SkewedBroker:
    url = "sqlite:///skewed/queue.db"

    def __init__(self, behind_s: float) -> None:
        self.behind_s = behind_s

    def now(self) -> float:
        return time.time() - self.behind_s

    def close(self) -> None:
        pass


class RedisLike:
    """A broker with a BrokerClock: its offset comes from sample(), never from now()."""

    url = "redis://queue-host:6379/0"

    class Clock:
        offset_s = 0.0

        def sample(self) -> float:
            self.offset_s = -7.5
            return time.time() + 7.5

    def __init__(self) -> None:
        self.clock = RedisLike.Clock()

    def now(self) -> float:
        raise AssertionError("the offset is read from clock.sample()")

    def close(self) -> None:
        pass


def test_clock_offset_against_each_kind_of_broker(tmp_path):
    assert clock_check(recorded("rpi4-dotprod-build", tmp_path)).status == "ok"  # a real SQLite broker
    pi = clock_check(recorded("rpi4-dotprod-build", tmp_path, open_broker=lambda: SkewedBroker(12.0)))
    assert pi.status == "warn" and "+12." in pi.detail and pi.fix == "enable NTP: sudo timedatectl set-ntp true"
    mac = clock_check(recorded("m2-pro-metal", tmp_path, open_broker=RedisLike))
    assert mac.status == "warn" and "-7.500 s" in mac.detail and "Date & Time" in mac.fix
    assert clock_check(recorded("m2-pro-metal", tmp_path, open_broker=lambda: SkewedBroker(1.0))).status == "ok"


# -- check 5: the hub --------------------------------------------------------------------------------------------------
def test_hub_reachable_unreachable_offline_and_never_hanging(tmp_path):
    asked: list[str] = []

    def answers(url: str, timeout_s: float) -> int:
        asked.append(url)
        return 200

    check = hub_check(recorded("m2-pro-metal", tmp_path, head=answers, env={"HF_ENDPOINT": "https://mirror.test"}))
    assert check.status == "ok" and asked == ["https://mirror.test"]

    def refused(url: str, timeout_s: float) -> int:
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    check = hub_check(recorded("m2-pro-metal", tmp_path, head=refused))
    assert check.status == "warn" and check.detail.startswith("the hub cannot be reached (")
    assert "Connection refused" in check.detail and OFFLINE_WORKS in check.detail

    for env, switch in (({"NODEAGENT_OFFLINE": "1"}, "NODEAGENT_OFFLINE"), ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE")):
        asked.clear()
        check = hub_check(recorded("m2-pro-metal", tmp_path, head=answers, env=env))
        assert check.status == "warn" and check.detail.startswith(f"offline mode: {OFFLINE_WORKS}")
        assert check.fix == f"unset {switch}" and asked == []

    release = threading.Event()
    started = time.monotonic()
    check = hub_check(recorded("m2-pro-metal", tmp_path, head=lambda url, t: release.wait(30), hub_timeout_s=0.2))
    release.set()
    assert time.monotonic() - started < 5 and check.status == "warn" and "no answer within 0.2 s" in check.detail


def test_the_live_head_reports_a_closed_port_as_an_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        http_head(f"http://127.0.0.1:{port}/", 3.0)


# -- check 6: the service ----------------------------------------------------------------------------------------------
def test_service_installed_running_failed_or_missing(tmp_path):
    failed = service_check(recorded("rpi4-dotprod-build", tmp_path))
    assert failed.status == "fail" and "Active: failed (Result: core-dump)" in failed.detail
    assert failed.fix == "systemctl --user status nodeagent-node; journalctl --user -u nodeagent-node -n 50"
    running = service_check(recorded("rpi5-generic-build", tmp_path))
    assert running.status == "ok" and "system systemd service" in running.detail
    assert "Active: active (running)" in running.detail
    mac = service_check(recorded("m2-pro-metal", tmp_path))
    assert mac.status == "ok" and "launchd" in mac.detail and "state = running" in mac.detail
    missing = service_check(recorded("m2-pro-no-metal", tmp_path))
    assert missing.status == "warn" and missing.detail.startswith("not installed")
    assert missing.fix == "nodeagent service install --model MODEL"
    no_systemctl = lambda manager: [InstalledService(file="nodeagent-node.service", user=True,  # noqa: E731
                                                     status="systemctl is not on this machine")]
    unknown = service_check(recorded("rpi5-generic-build", tmp_path, services=no_systemctl))
    assert unknown.status == "fail" and "systemctl is not on this machine" in unknown.detail


def test_a_service_file_that_holds_a_secret_in_clear_fails(tmp_path):
    """A unit of nodeagent 0.1 carried NODEAGENT_TOKEN in an Environment= line, which every local user may read."""
    def with_text(text: str):  # noqa: ANN202
        return lambda manager: [InstalledService(file="nodeagent.service", user=False,
                                                 status="Active: active (running)", text=text)]

    leaked = service_check(recorded("rpi5-generic-build", tmp_path, services=with_text(
        "[Service]\nEnvironment=NODEAGENT_TOKEN=s3cret\n")))
    assert leaked.status == "fail" and "holds a secret in clear (NODEAGENT_TOKEN" in leaked.detail
    assert "s3cret" not in leaked.detail and "nodeagent service install" in leaked.fix
    url = service_check(recorded("rpi5-generic-build", tmp_path, services=with_text(
        "ExecStart=/usr/bin/python3 -m nodeagent serve --broker redis://:hunter22@q:6379/0\n")))
    assert url.status == "fail" and "hunter22" not in url.detail
    for cut in ("--broker redis://:Zq7x/Q9-secret@q:6379/0",  # a raw '/' in the password, as an earlier version
                '--broker "redis://:Zq7x?Q9-secret%%40q:6379/0="'):  # wrote it: and a raw '?', the rest an option
        leaked = service_check(recorded("rpi5-generic-build", tmp_path, services=with_text(
            f"ExecStart=/usr/bin/python3 -m nodeagent worker {cut}\n")))
        assert leaked.status == "fail" and "a broker URL with its password" in leaked.detail, cut
        assert "Q9-secret" not in leaked.detail and "Zq7x" not in leaked.detail
    clean = service_check(recorded("rpi5-generic-build", tmp_path, services=with_text(
        "LoadCredential=token:/etc/nodeagent/secrets/nodeagent-node.token\n"
        "Environment=NODEAGENT_TOKEN_FILE=%d/token\nExecStart=python -m nodeagent serve --broker redis://q:6379/0\n")))
    assert clean.status == "ok"


# -- the list of checks ------------------------------------------------------------------------------------------------
def test_one_more_check_is_one_more_entry_and_a_raising_check_fails_alone(tmp_path):
    def health_check(edges: Edges) -> Check:
        raise ConfigError("the health reading failed", hint="look at it")

    checks = run_checks(recorded("m2-pro-metal", tmp_path), (*CHECKS, health_check))
    assert len(checks) == len(run_checks(recorded("m2-pro-metal", tmp_path))) + 1
    assert checks[-1] == Check(name="health", status="fail", detail="the health reading failed", fix="look at it")


def test_this_machine_runs_every_check(tmp_path):
    edges = live_edges(config_in(tmp_path, NODEAGENT_OFFLINE="1"), env={"NODEAGENT_OFFLINE": "1"})
    checks = by_name(run_checks(edges))
    assert list(checks) == NAMES
    assert all(isinstance(c, Check) and c.status in ("ok", "warn", "fail") and c.detail for c in checks.values())
    assert checks["llama.cpp build"].detail.startswith("llama-cpp-python 0.3.36")  # read in a child process
    for name in ("model directory", "state directory", "broker", "clock"):
        assert checks[name].status == "ok", checks[name]
    assert checks["model hub"].status == "warn" and "NODEAGENT_OFFLINE is set" in checks["model hub"].detail


# -- the command, as a user types it ----------------------------------------------------------------------------------
def nodeagent(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in SHELL_SETTINGS}
    return subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True, text=True,
                          env={**clean, **env}, timeout=120)


def test_cli_doctor_json_on_this_machine(isolated_env, tmp_path):
    started = time.monotonic()
    proc = nodeagent(["doctor", "--json"], {**isolated_env, "NODEAGENT_OFFLINE": "1"})
    assert time.monotonic() - started < 60
    report = json.loads(proc.stdout)
    assert set(report) == {"checks", "ok"} and [c["name"] for c in report["checks"]] == NAMES
    assert report["ok"] == all(c["status"] != "fail" for c in report["checks"])
    assert proc.returncode == (0 if report["ok"] else 1) and "Traceback" not in proc.stderr
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["broker"]["status"] == "ok" and str(tmp_path / "state" / "queue.db") in checks["broker"]["detail"]
    assert checks["model hub"]["status"] == "warn" and checks["model hub"]["fix"] == "unset NODEAGENT_OFFLINE"
    table = nodeagent(["doctor"], {**isolated_env, "NODEAGENT_OFFLINE": "1"})
    assert table.returncode == proc.returncode and "llama.cpp build" in table.stdout and "warned" in table.stderr


def test_cli_doctor_exits_1_on_a_failing_recorded_machine(isolated_env):
    fixture = str(DOCTOR / "rpi4-dotprod-build.json")
    proc = nodeagent(["doctor", "--json"], {**isolated_env, "NODEAGENT_OFFLINE": "1",
                                            "NODEAGENT_HARDWARE_FIXTURE": fixture})
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    build = report["checks"][0]
    assert report["ok"] is False and build["status"] == "fail" and "dotprod" in build["detail"]
    assert build["fix"].startswith('CMAKE_ARGS="-DGGML_NATIVE=ON" pip install')
    probed = json.loads(nodeagent(["probe", "--json"], {**isolated_env, "NODEAGENT_HARDWARE_FIXTURE": fixture}).stdout)
    assert probed["hardware"]["raspberry_pi"]["board"] == "4B" and probed["hardware"]["cpu_features"] == ["neon"]


# -- the broker's own settings ---------------------------------------------------------------------------------------
def broker_checks(env: dict[str, str]) -> dict[str, dict]:
    proc = nodeagent(["doctor", "--json"], {**env, "NODEAGENT_OFFLINE": "1"})
    assert "Traceback" not in proc.stderr, proc.stderr
    return {c["name"]: c for c in json.loads(proc.stdout)["checks"] if c["name"].startswith("broker")}


def test_doctor_fails_a_redis_that_evicts_or_does_not_persist_and_passes_the_documented_one(isolated_env, tmp_path):
    """A Redis started the way a cache is (allkeys-lru, appendonly no): both fail, each with its fix. One started
    with docs/operations.md's settings: clean."""
    from redisha import DataNode

    cache = DataNode(tmp_path / "cache", extra=("--maxmemory-policy", "allkeys-lru", "--appendonly", "no",
                                                "--save", "3600 1")).start()
    queue = DataNode(tmp_path / "queue").start()  # appendonly yes, appendfsync everysec, noeviction
    try:
        bad = broker_checks({**isolated_env, "NODEAGENT_BROKER": f"redis://127.0.0.1:{cache.port}/0"})
        assert bad["broker eviction"]["status"] == "fail" and "allkeys-lru" in bad["broker eviction"]["detail"]
        assert "maxmemory-policy noeviction" in bad["broker eviction"]["fix"]
        persistence = bad["broker persistence"]
        assert persistence["status"] == "fail" and "appendonly no: only RDB snapshots (3600 1)" in persistence["detail"]
        assert "the last save was" in persistence["detail"] and "appendonly yes" in persistence["fix"]
        good = broker_checks({**isolated_env, "NODEAGENT_BROKER": f"redis://127.0.0.1:{queue.port}/0"})
        assert {n: c["status"] for n, c in good.items()} == {
            "broker": "ok", "broker server": "ok", "broker eviction": "ok", "broker memory": "ok",
            "broker persistence": "ok", "broker replicas": "ok"}, good
        assert "appendfsync everysec" in good["broker persistence"]["detail"]
        needs = broker_checks({**isolated_env, "NODEAGENT_BROKER": f"redis://127.0.0.1:{queue.port}/0",
                               "NODEAGENT_REDIS_MIN_REPLICAS": "1"})["broker replicas"]
        assert needs["status"] == "fail" and "has 0 replicas connected" in needs["detail"]
    finally:
        cache.stop()
        queue.stop()


def test_doctor_sizes_redis_memory_for_what_the_fleet_keeps(isolated_env, tmp_path):
    """What the fleet keeps grows with its rate and the retention, and nothing else grows: the doctor measures a
    finished task's keys on the server, takes the last hour's rate from the fleet's history, and says where memory
    levels off against maxmemory (a small one fails, with the size to set)."""
    from redisha import DataNode
    from test_worker import worker

    from nodeagent.client import Client
    from nodeagent.tasks.contracts import ClassifyTask

    small = DataNode(tmp_path / "small", extra=("--maxmemory", "3mb")).start()
    try:
        url = f"redis://127.0.0.1:{small.port}/0"
        broker = open_broker(url, tmp_path)
        client = Client(broker)
        for i in range(40):
            client.submit(ClassifyTask(input=f"ticket {i}", labels=["bug", "question"]), idempotency_key=f"t-{i}")
        worker(broker).run()
        broker.close()
        env = {**isolated_env, "NODEAGENT_BROKER": url, "NODEAGENT_RESPONSES_MAX_BYTES": "100000"}
        memory = broker_checks(env)["broker memory"]
        assert memory["status"] == "fail" and "bytes each (measured)" in memory["detail"], memory
        assert "over maxmemory 3 MiB" in memory["detail"] and "raise maxmemory to at least" in memory["fix"]
        short = broker_checks({**env, "NODEAGENT_RESULT_RETENTION_S": "60"})
        assert short["broker memory"]["status"] == "ok", short["broker memory"]
    finally:
        small.stop()


def test_doctor_reads_the_sentinels_and_the_replicas_of_a_sentinel_url(isolated_env, tmp_path):
    from redisha import SentinelFleet

    fleet = SentinelFleet(tmp_path / "ha").start()
    try:
        env = {**isolated_env, "NODEAGENT_BROKER": fleet.url, "NODEAGENT_REDIS_MIN_REPLICAS": "1"}
        checks = broker_checks(env)
        assert {n: c["status"] for n, c in checks.items()} == {
            "broker": "ok", "broker server": "ok", "broker eviction": "ok", "broker memory": "ok",
            "broker persistence": "ok", "broker replicas": "ok", "broker sentinels": "ok"}, checks
        assert "3 of 3 Sentinels answer (quorum 2); 1 replica(s) up" in checks["broker sentinels"]["detail"]
        assert "found through the Sentinels" in checks["broker server"]["detail"]
        fleet.replicas[0].kill()
        fleet.wait_until(lambda: broker_checks(env)["broker sentinels"]["status"] == "fail", 30,
                         "the Sentinels see the replica down")
        checks = broker_checks(env)
        assert "no replica that is up: a failover has nothing to promote" in checks["broker sentinels"]["detail"]
        assert checks["broker replicas"]["status"] == "fail"
    finally:
        fleet.stop()


def test_doctor_reads_the_sqlite_queues_journal_and_its_disk(tmp_path):
    checks = by_name(run_checks(recorded("m2-pro-metal", tmp_path)))
    assert checks["broker journal"].status == "ok" and "WAL, synchronous NORMAL" in checks["broker journal"].detail
    assert checks["broker disk"].status in ("ok", "warn") and "free beside" in checks["broker disk"].detail
    from nodeagent.broker.advice import advise

    full = {n.name: n for n in advise({"engine": "sqlite", "path": "/q/queue.db", "journal_mode": "delete",
                                       "disk_free_bytes": 100 << 20, "size_bytes": 5 << 20})}
    assert full["broker journal"].status == "fail" and "not WAL" in full["broker journal"].detail
    assert full["broker disk"].status == "fail" and "100 MiB free beside /q/queue.db; the queue takes 5 MiB" in \
        full["broker disk"].detail


def test_a_worker_logs_the_brokers_problems_once_at_start(redis_server, isolated_env, tmp_path):
    from conftest import spawn

    w = spawn(["worker", "--model", "fake", "--broker", redis_server.url, "--burst"],
              {**isolated_env, "NODEAGENT_HOME": str(tmp_path / "w")})
    _, err = w.communicate(timeout=60)
    assert w.returncode == 0, err
    assert err.count("broker persistence (fail): appendonly no and no RDB snapshots") == 1
    assert "fix: set appendonly yes" in err


# -- the hub's messages without a network ---------------------------------------------------------------------------
@pytest.fixture
def no_hub(isolated_env, tmp_path) -> dict[str, str]:
    """An environment whose hub is a closed local port, with empty caches."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {**isolated_env, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf"),
            "NODEAGENT_CACHE_DIR": str(tmp_path / "cache")}


def test_plan_and_pull_without_a_hub_say_so_and_not_offline(no_hub):
    for args in (["plan", "qwen2.5-7b-instruct"], ["pull", "qwen2.5-7b-instruct"]):
        proc = nodeagent(args, no_hub)
        assert proc.returncode == 10, proc.stderr
        assert "the hub could not be reached" in proc.stderr and OFFLINE_WORKS in proc.stderr
        assert "OFFLINE" not in proc.stderr and "Traceback" not in proc.stderr


def test_offline_messages_name_the_variable_that_is_set(no_hub):
    for switch, other in (("NODEAGENT_OFFLINE", "HF_HUB_OFFLINE"), ("HF_HUB_OFFLINE", "NODEAGENT_OFFLINE")):
        proc = nodeagent(["plan", "qwen2.5-7b-instruct"], {**no_hub, switch: "1"})
        assert proc.returncode == 10 and f"hint: unset {switch}," in proc.stderr and other not in proc.stderr


def test_a_download_the_hub_never_answered_is_not_a_missing_file(monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    from nodeagent.store.hub import _translate

    exc = LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub and we cannot "
                                  "find the requested files in the local cache.")
    online = _translate(exc, "owner/repo/model.gguf", False)
    assert isinstance(online, HubError) and "could not be reached" in str(online) and "OFFLINE" not in online.hint
    monkeypatch.delenv("NODEAGENT_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = _translate(exc, "owner/repo/model.gguf", True)
    assert "offline mode is on" in str(offline) and offline.hint.startswith("unset HF_HUB_OFFLINE,")
