"""Checks 1-2: the installed llama.cpp build against this CPU and OS, and what a rebuild of it needs.

Both sides come from the probe: ``HardwareInfo.cpu_features`` is what the CPU has (/proc/cpuinfo, or sysctl on
a Mac), ``llama_cpp.cpu_features`` what the build was compiled to use (``llama_print_system_info()``). A build
that uses a feature the CPU lacks dies with SIGILL (llama-cpp-python issues #5 and #839: a wheel built with
-march=native on another machine); a CPU feature the build leaves unused makes it slower.
"""

from __future__ import annotations

import importlib.metadata

from nodeagent.doctor.edges import Edges
from nodeagent.doctor.types import Check, fail, ok, warn
from nodeagent.hardware.linux import cpuinfo_fields
from nodeagent.hardware.types import HardwareInfo

# scripts/_venv.sh's portable x86-64 baseline: AVX2 without -march=native, which on virtual machines that
# advertise AVX-512 or AMX without enabling them builds code that dies with SIGILL
PORTABLE_X86 = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
# with GGML_NATIVE=OFF, llama.cpp's CMake (ggml/CMakeLists.txt, INS_ENB) turns these on by default: on a CPU
# without AVX2 each is spelled ON or OFF from the /proc/cpuinfo flag it needs
X86_OPTIONS = (("GGML_SSE42", "sse4_2"), ("GGML_AVX", "avx"), ("GGML_AVX2", "avx2"), ("GGML_FMA", "fma"),
               ("GGML_F16C", "f16c"), ("GGML_BMI2", "bmi2"))
# the features the rebuild below uses where the CPU has them: the build lacking one of these is a warning.
# (x86-64: the portable baseline stops at AVX2, so unused AVX-512 or AMX is said, not warned about)
REBUILD_USES = {"x86_64": {"avx2"}, "aarch64": {"neon", "dotprod", "i8mm", "sve"},
                "arm64": {"neon", "dotprod", "i8mm", "sve"}}
ARM64_PYTHON = ("arch -arm64 /usr/bin/python3 -m venv VENV (or Homebrew's /opt/homebrew/bin/python3 -m venv "
                "VENV), then install nodeagent into VENV")
BUILD, TOOLS, EPOCH, PYTHON = "llama.cpp build", "build tools", "SOURCE_DATE_EPOCH", "python"


def pinned_version() -> str | None:
    """The llama-cpp-python version nodeagent pins (pyproject.toml, as installed)."""
    try:
        requires = importlib.metadata.requires("nodeagent") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requires:
        name, _, version = req.partition("==")
        if name.strip().lower() == "llama-cpp-python" and version:
            return version.split(";")[0].strip()
    return None


def cpu_flags(e: Edges) -> set[str]:
    """The x86 ``flags`` (or Arm ``Features``) of /proc/cpuinfo."""
    fields = cpuinfo_fields(e.system.read_text("/proc/cpuinfo") or "")
    return set((fields.get("flags") or fields.get("Features") or "").split())


def cmake_args(hw: HardwareInfo, flags: set[str]) -> str:
    """CMAKE_ARGS for a rebuild on this platform."""
    if hw.os == "darwin" and hw.arch == "arm64":
        return "-DGGML_METAL=on"
    if hw.os == "linux" and hw.arch in ("aarch64", "arm64"):
        return "-DGGML_NATIVE=ON"
    if hw.os == "linux" and hw.arch in ("x86_64", "amd64"):
        if "avx2" in hw.cpu_features:
            return PORTABLE_X86
        return " ".join(["-DGGML_NATIVE=OFF", *(f"-D{opt}={'ON' if flag in flags else 'OFF'}"
                                                for opt, flag in X86_OPTIONS)])
    return "-DGGML_NATIVE=ON"  # built here, for here


def rebuild_command(hw: HardwareInfo, flags: set[str]) -> str:
    version = hw.llama_cpp.version or pinned_version()
    pin = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    return (f'CMAKE_ARGS="{cmake_args(hw, flags)}" pip install --force-reinstall --no-cache-dir '
            f"--no-binary llama-cpp-python {pin}")


def translated(e: Edges) -> bool:
    """A Python running under Rosetta 2 on Apple Silicon."""
    s = e.system
    if s.system() != "darwin":
        return False
    return s.sysctl("sysctl.proc_translated") == "1" or (
        s.machine() == "x86_64" and s.sysctl("hw.optional.arm64") == "1")


def _cpu_known(e: Edges, hw: HardwareInfo) -> bool:
    if hw.os == "darwin":
        return hw.arch == "arm64"
    return hw.os == "linux" and bool(e.system.read_text("/proc/cpuinfo"))


def _cpu_name(hw: HardwareInfo) -> str:
    parts = [p for p in (hw.cpu_model, hw.raspberry_pi.model if hw.raspberry_pi else None) if p]
    return f"this CPU ({', '.join(parts)})" if parts else "this CPU"


def llama_build_check(e: Edges) -> Check:
    """The build's CPU features against the CPU's, and Metal on Apple Silicon."""
    hw = e.hardware
    lc = hw.llama_cpp
    flags = cpu_flags(e)
    fix = rebuild_command(hw, flags)
    if e.llama_error:
        return fail(BUILD, e.llama_error, fix)
    if not lc.installed:
        return fail(BUILD, "llama-cpp-python is not installed", fix)
    if translated(e):
        return warn(BUILD, f"llama-cpp-python {lc.version} is an x86_64 build running translated under Rosetta 2; "
                           "rebuild it under an arm64 Python (see the python check)", ARM64_PYTHON)
    if lc.cpu_features is None:
        return warn(BUILD, f"llama-cpp-python {lc.version}: which CPU features the build uses could not be read",
                    fix)
    build, cpu = set(lc.cpu_features), set(hw.cpu_features)
    uses = f"llama-cpp-python {lc.version} uses {', '.join(sorted(build)) or 'no SIMD feature nodeagent tracks'}"
    if not _cpu_known(e, hw):
        return warn(BUILD, f"{uses}; the features of this CPU ({hw.os} {hw.arch}) could not be read to compare")
    lacking = sorted(build - cpu)
    if lacking:
        return fail(BUILD, f"the build uses {', '.join(lacking)}, which {_cpu_name(hw)} lacks: llama.cpp will die "
                           "with SIGILL (illegal instruction), as a wheel built with -march=native on another "
                           "machine does", fix)
    unused = sorted((cpu & REBUILD_USES.get(hw.arch, set())) - build)
    problems = []
    if unused:
        problems.append(f"{_cpu_name(hw)} has {', '.join(unused)}, which the build does not use: a slower build")
    if hw.os == "darwin" and hw.arch == "arm64" and not lc.gpu_offload:
        problems.append("the build has no Metal (no GPU offload): every layer runs on the CPU")
    if problems:
        kleidi = hw.os == "linux" and {"dotprod", "i8mm"} & cpu
        note = "; adding -DGGML_CPU_KLEIDIAI=ON to CMAKE_ARGS also builds Arm's KleidiAI kernels for this CPU" \
            if kleidi else ""
        return warn(BUILD, f"{uses}; " + "; ".join(problems) + note, fix)
    spare = sorted(cpu - build) if hw.arch in ("x86_64", "amd64") else []
    extra = f"; {', '.join(spare)} left unused on purpose (the portable AVX2 baseline)" if spare else ""
    has = f", all of which {_cpu_name(hw)} has" if build else ""
    metal = "; Metal (GPU offload) is built in" if lc.gpu_offload and hw.os == "darwin" else ""
    return ok(BUILD, f"{uses}{has}{metal}{extra}")


def toolchain_check(e: Edges) -> Check:
    """A C and C++ compiler and cmake: what `pip install --no-binary llama-cpp-python` builds with."""
    cc = next((p for n in ("cc", "gcc", "clang") if (p := e.which(n))), None)
    cxx = next((p for n in ("c++", "g++", "clang++") if (p := e.which(n))), None)
    cmake = e.which("cmake")
    missing = [what for what, path in (("a C compiler (cc, gcc, clang)", cc),
                                       ("a C++ compiler (c++, g++, clang++)", cxx), ("cmake", cmake)) if not path]
    if not missing:
        return ok(TOOLS, f"C compiler {cc}, C++ compiler {cxx}, cmake {cmake}")
    detail = f"no {', no '.join(missing)} on PATH: a rebuild of llama-cpp-python needs them"
    if missing == ["cmake"]:
        detail += " (pip's build backend can fetch cmake from the package index itself)"
    if e.system.system() == "darwin":
        tools = [] if cc and cxx else ["xcode-select --install"]
        return warn(TOOLS, detail, " && ".join(tools + ([] if cmake else ["pip install cmake"])))
    release = (e.system.read_text("/etc/os-release") or "").lower()
    apt = "sudo apt-get install -y build-essential cmake"
    if any(name in release for name in ("debian", "ubuntu", "raspbian")):
        return warn(TOOLS, detail, apt)
    return warn(TOOLS, detail, f"{apt} (Debian, Ubuntu, Pi OS), or your system's compiler and cmake packages")


def source_date_epoch_check(e: Edges) -> Check:
    """SOURCE_DATE_EPOCH turns llama.cpp's GGML_NATIVE default off (ggml/CMakeLists.txt): a rebuild without
    explicit options would then be generic, silently."""
    value = e.env.get("SOURCE_DATE_EPOCH")
    if value is None:
        return ok(EPOCH, "not set")
    return warn(EPOCH, f"SOURCE_DATE_EPOCH={value} is set: llama.cpp's CMake then turns GGML_NATIVE (and on x86 "
                       "its AVX/AVX2/FMA/F16C/BMI2 defaults) off, so a rebuild is silently generic",
                "unset SOURCE_DATE_EPOCH")


def python_check(e: Edges) -> Check:
    """On Apple Silicon, a Python under Rosetta 2 gets an x86_64 llama.cpp: no Metal, translated code."""
    machine = e.system.machine()
    if translated(e):
        return fail(PYTHON, f"this Python is {machine}, translated by Rosetta 2 on Apple Silicon: llama-cpp-python "
                            "builds and runs as translated x86_64 code, not the native arm64 build with NEON and "
                            "Metal", ARM64_PYTHON)
    return ok(PYTHON, f"native {machine} Python")

