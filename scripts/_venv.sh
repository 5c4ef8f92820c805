# Sourced by the scripts: create the virtual environment and install nodeagent into it.
# NODEAGENT_VENV picks the environment's folder (default: .venv in the checkout).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NODEAGENT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# llama-cpp-python builds from source (about 6 minutes on 2 cores) the first time;
# pip's wheel cache (~/.cache/pip) reuses that build afterwards.
# On x86-64, build for a portable AVX2 baseline instead of -march=native: some
# virtual machines advertise AMX or AVX-512 in /proc/cpuinfo without enabling
# them, and a native build then dies with SIGILL on the first matrix product.
if [ "$(uname -m)" = "x86_64" ] && [ -z "${CMAKE_ARGS:-}" ]; then
  export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
fi
"$VENV/bin/python" -m pip install -q -e "$ROOT${NODEAGENT_EXTRAS:-}"
