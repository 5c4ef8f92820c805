# Sourced by the scripts: check what a source build needs, create the virtual environment and install nodeagent.
# NODEAGENT_VENV picks the environment's folder (default: .venv in the checkout); CMAKE_ARGS, when set, is used as
# given instead of this platform's choice below. NODEAGENT_SETUP_DRY_RUN=1 says what it would install and build
# with, and stops (tests/test_setup.py runs it so on made-up platforms).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NODEAGENT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
OS="$(uname -s)"
ARCH="$(uname -m)"

install_package() {  # install_package DEBIAN-PACKAGE WHY: with apt-get where we can, else say the command and stop
  if [ -n "${NODEAGENT_SETUP_DRY_RUN:-}" ] && [ "$OS" = Linux ]; then
    echo "would install: $1" >&2
    return 0
  fi
  if [ "$OS" = Linux ] && command -v apt-get >/dev/null 2>&1; then
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    if [ -n "$sudo" ] && ! sudo -n true 2>/dev/null; then
      echo "error: $2 is missing: run 'sudo apt-get install -y $1', then run this again" >&2
      exit 1
    fi
    echo "installing $1 ($2 is missing)" >&2
    $sudo apt-get install -y -q "$1" >/dev/null 2>&1 \
      || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q "$1" >/dev/null; } \
      || { echo "error: could not install $1 with apt-get" >&2; exit 1; }
  elif [ "$OS" = Darwin ]; then
    case "$1" in
      build-essential) how="run xcode-select --install (the Command Line Tools)" ;;
      redis-server) how="run brew install redis" ;;
      chromium) how="run brew install --cask chromium, or set NODEAGENT_CHROMIUM to a Chrome or Chromium binary" ;;
      *) how="run brew install $1" ;;
    esac
    echo "error: $2 is missing: $how, then run this again" >&2
    exit 1
  else
    echo "error: $2 is missing: install $1 with your system's package manager" >&2
    exit 1
  fi
}

need() {  # need COMMAND DEBIAN-PACKAGE
  command -v "$1" >/dev/null 2>&1 || install_package "$2" "$1"
}

# -- what a source build of llama-cpp-python needs (PyPI has no wheel for Arm Linux or macOS: pip compiles it)
if [ "$OS" = Darwin ]; then
  xcode-select -p >/dev/null 2>&1 || { echo "error: the Xcode Command Line Tools are missing (the build needs" \
    "their compiler): run xcode-select --install, then run this again" >&2; exit 1; }
  if [ "$(sysctl -n sysctl.proc_translated 2>/dev/null || echo 0)" = 1 ] \
     || [ "$("$PY" -c 'import platform; print(platform.machine())')" = x86_64 -a \
          "$(sysctl -n hw.optional.arm64 2>/dev/null || echo 0)" = 1 ]; then
    echo "error: $PY runs under Rosetta on Apple Silicon: it would build an x86 llama.cpp about 10x slower." \
      "Use an arm64 Python (Homebrew's /opt/homebrew/bin/python3, or arch -arm64 $PY) with PYTHON=..." >&2
    exit 1
  fi
fi
# -- Python 3.10 or later (the package's requires-python): said before anything is built
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1; then
  found="$("$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo "none")"
  echo "error: nodeagent needs Python 3.10 or later; $PY is $found: install a newer one (Debian 12 and Raspberry" \
    "Pi OS Bookworm ship 3.11), or point PYTHON at it (PYTHON=python3.11 $0)" >&2
  exit 1
fi
need cc build-essential
need c++ build-essential
need cmake cmake
if [ "$OS" = Linux ] && ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  install_package python3-venv "Python's venv module"
fi

# -- how to build it here: Metal on Apple Silicon; native on Arm Linux (built on the device it runs on); on x86-64
# a portable AVX2 baseline instead of -march=native: some virtual machines advertise AMX or AVX-512 in
# /proc/cpuinfo without enabling them, and a native build then dies with SIGILL on the first matrix product
if [ -z "${CMAKE_ARGS:-}" ]; then
  case "$OS-$ARCH" in
    Darwin-arm64) export CMAKE_ARGS="-DGGML_METAL=on" ;;
    Linux-aarch64 | Linux-arm64) export CMAKE_ARGS="-DGGML_NATIVE=ON" ;;
    Linux-x86_64) export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" ;;
  esac
fi
if [ -n "${SOURCE_DATE_EPOCH:-}" ]; then  # it silently turns llama.cpp's GGML_NATIVE off
  echo "note: SOURCE_DATE_EPOCH is set; unsetting it for this build (it turns GGML_NATIVE off)" >&2
  unset SOURCE_DATE_EPOCH
fi

if [ -n "${NODEAGENT_SETUP_DRY_RUN:-}" ]; then
  echo "CMAKE_ARGS=${CMAKE_ARGS:-}" >&2
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# llama-cpp-python builds from source the first time; pip's wheel cache (~/.cache/pip) reuses that build after
if ! "$VENV/bin/python" -c "import llama_cpp" >/dev/null 2>&1; then
  echo "llama-cpp-python: unless pip has a build of it cached, it compiles now with CMAKE_ARGS='${CMAKE_ARGS:-}'" \
    "on $(getconf _NPROCESSORS_ONLN 2>/dev/null || echo ?) cores ($OS $ARCH): about 6 minutes on 2 x86-64 cores" \
    "(measured); longer on a Raspberry Pi. pip prints nothing meanwhile." >&2
fi
"$VENV/bin/python" -m pip install -q -e "$ROOT${NODEAGENT_EXTRAS:-}"
