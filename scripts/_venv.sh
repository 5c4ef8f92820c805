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
"$VENV/bin/python" -m pip install -q -e "$ROOT${NODEAGENT_EXTRAS:-}"
