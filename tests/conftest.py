from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from nodeagent.config import resolve  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
HARDWARE = FIXTURES / "hardware"


def _models_dir() -> Path:
    return resolve(env=dict(os.environ))["test_models_dir"]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return test_model_path("smollm2-135m-instruct", _models_dir())


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return test_model_path("gemma-3-270m-it", _models_dir())


@pytest.fixture(scope="session")
def header_7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fixtures") / "deepseek-r1-distill-qwen-7b-q4_k_m.header.gguf"
    with gzip.open(FIXTURES / "deepseek-r1-distill-qwen-7b-q4_k_m.header.gguf.gz") as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


@pytest.fixture
def isolated_env(tmp_path: Path) -> dict[str, str]:
    """An environment with no user config and state in tmp_path."""
    return {
        "NODEAGENT_CONFIG": str(tmp_path / "config.toml"),
        "NODEAGENT_HOME": str(tmp_path / "state"),
        "NODEAGENT_MODEL_DIR": str(tmp_path / "models"),
        "NODEAGENT_TEST_MODELS_DIR": str(_models_dir()),
    }


def cli(args, env, check=True):
    """`nodeagent ARGS` as a user types it, in a child process with ``env`` over this environment."""
    proc = subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True, text=True,
                          env={**os.environ, **env})
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc
