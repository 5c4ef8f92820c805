"""The set-up scripts' choices per platform (scripts/_venv.sh, which scripts/quickstart and scripts/test source):
the OS packages a source build of llama-cpp-python needs, the Command Line Tools and an arm64 Python on a Mac, and
the CMAKE_ARGS of each platform. Run on made-up platforms: `uname`, `sysctl`, `xcode-select` and the compilers are
small scripts on PATH that answer as that platform does (NODEAGENT_SETUP_DRY_RUN stops before anything is
installed or built)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def platform_bin(tmp_path: Path, system: str, machine: str, have: tuple[str, ...], sysctl: dict[str, str],
                 clt: bool = True) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    def tool(name: str, body: str) -> None:
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)

    tool("uname", f'case "$1" in -s) echo {system} ;; -m) echo {machine} ;; *) echo {system} ;; esac')
    tool("sysctl", "case \"$2\" in " + " ".join(f"{k}) echo {v} ;;" for k, v in sysctl.items()) + " *) exit 1 ;; esac")
    tool("xcode-select", "exit 0" if clt else "exit 2")
    tool("getconf", "echo 4")
    for name in have:
        tool(name, "exit 0")
    for name in ("bash", "sh", "dirname", "id", "cat", "env"):  # what the script itself runs
        real = subprocess.run(["sh", "-c", f"command -v {name}"], capture_output=True, text=True).stdout.strip()
        if real:
            (bin_dir / name).symlink_to(real)
    # the Python says the machine it was built for (Rosetta's x86_64 where the test asks for it)
    python_machine = "x86_64" if sysctl.get("sysctl.proc_translated") == "1" else machine
    tool("python3", f'case "$2" in *platform.machine*) echo {python_machine} ;; *) exec "{sys.executable}" "$@" ;; esac')
    return bin_dir


def setup(bin_dir: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'source "{ROOT}/scripts/_venv.sh"'], capture_output=True, text=True,
                          env={"PATH": str(bin_dir), "HOME": str(bin_dir.parent), "NODEAGENT_SETUP_DRY_RUN": "1",
                               "NODEAGENT_VENV": str(bin_dir.parent / "venv"), **env})


@pytest.mark.parametrize("system,machine,args", [
    ("Linux", "aarch64", "-DGGML_NATIVE=ON"),
    ("Linux", "x86_64", "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON"),
    ("Darwin", "arm64", "-DGGML_METAL=on"),
])
def test_each_platform_builds_its_own_way(tmp_path, system, machine, args):
    bin_dir = platform_bin(tmp_path, system, machine, ("cc", "c++", "cmake"),
                           {"sysctl.proc_translated": "0", "hw.optional.arm64": "1" if machine == "arm64" else "0"})
    proc = setup(bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert f"CMAKE_ARGS={args}" in proc.stderr
    given = setup(bin_dir, CMAKE_ARGS="-DGGML_CPU_KLEIDIAI=ON")  # a user's own choice is used as given
    assert "CMAKE_ARGS=-DGGML_CPU_KLEIDIAI=ON" in given.stderr


def test_a_pi_without_a_compiler_gets_the_packages_a_build_needs(tmp_path):
    bin_dir = platform_bin(tmp_path, "Linux", "aarch64", ("apt-get",), {})
    proc = setup(bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert "would install: build-essential" in proc.stderr and "would install: cmake" in proc.stderr


def test_a_mac_without_the_command_line_tools_is_told_the_command(tmp_path):
    bin_dir = platform_bin(tmp_path, "Darwin", "arm64", ("cc", "c++", "cmake"), {"hw.optional.arm64": "1"},
                           clt=False)
    proc = setup(bin_dir)
    assert proc.returncode == 1 and "xcode-select --install" in proc.stderr


def test_a_rosetta_python_is_refused_with_what_to_use(tmp_path):
    bin_dir = platform_bin(tmp_path, "Darwin", "arm64", ("cc", "c++", "cmake"),
                           {"sysctl.proc_translated": "1", "hw.optional.arm64": "1"})
    proc = setup(bin_dir)
    assert proc.returncode == 1 and "Rosetta" in proc.stderr and "arm64 Python" in proc.stderr


def test_source_date_epoch_is_unset_for_the_build(tmp_path):
    bin_dir = platform_bin(tmp_path, "Linux", "aarch64", ("cc", "c++", "cmake"), {})
    proc = setup(bin_dir, SOURCE_DATE_EPOCH="1700000000")
    assert proc.returncode == 0 and "SOURCE_DATE_EPOCH is set; unsetting it" in proc.stderr


def test_a_python_older_than_3_10_is_refused_with_what_to_do(tmp_path):
    bin_dir = platform_bin(tmp_path, "Linux", "x86_64", ("cc", "c++", "cmake"), {})
    (bin_dir / "python3").write_text("#!/bin/sh\n"
                                     'case "$2" in *version_info*) exit 1 ;; *python_version*) echo 3.8.10 ;; '
                                     f'*) exec "{sys.executable}" "$@" ;; esac\n')
    proc = setup(bin_dir)
    assert proc.returncode == 1 and "needs Python 3.10 or later; python3 is 3.8.10" in proc.stderr
    assert "PYTHON=python3.11" in proc.stderr and "would install" not in proc.stderr
