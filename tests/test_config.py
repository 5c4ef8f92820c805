"""The config resolver: precedence and provenance."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.config import PLAN_SETTINGS, SETTINGS, load_config_file, resolve
from nodeagent.errors import ConfigError


def test_precedence_flag_env_file_default(tmp_path):
    c = resolve(flags={"threads": 8}, env={"NODEAGENT_THREADS": "6", "NODEAGENT_CTX": "1024"},
                file_values={"threads": 5, "ctx_tokens": 2048, "slots": 3}, file_path=tmp_path / "c.toml")
    assert (c.threads, c.source("threads")) == (8, "flag")
    assert (c.ctx_tokens, c.source("ctx_tokens")) == (1024, "env NODEAGENT_CTX")
    assert (c.slots, c.source("slots")) == (3, f"config {tmp_path / 'c.toml'}")
    assert c.source("log_level") == "default"


def test_profile_defaults_take_one_road_the_planner():
    """Unset planner settings stay None here: the planner applies the profile, nothing applies it twice."""
    c = resolve(env={})
    assert all(c[name] is None for name in PLAN_SETTINGS) and c.plan_settings() == {}
    c = resolve(env={"NODEAGENT_CTX": "2048", "NODEAGENT_THREADS": "3", "NODEAGENT_TYPE_K": "q8_0"})
    assert c.plan_settings() == {"ctx_tokens": 2048, "n_threads": 3, "type_k": "q8_0"}


def test_flag_variable_and_file_key_mean_the_same(tmp_path):
    """--ctx, NODEAGENT_CTX and ctx_tokens in the config file all fix the context exactly."""
    by_flag = resolve(flags={"ctx_tokens": 3000}, env={})
    by_env = resolve(env={"NODEAGENT_CTX": "3000"})
    by_file = resolve(env={}, file_values={"ctx_tokens": 3000}, file_path=tmp_path / "c.toml")
    assert by_flag.plan_settings() == by_env.plan_settings() == by_file.plan_settings() == {"ctx_tokens": 3000}


def test_node_config_is_frozen_and_typed():
    c = resolve(env={"NODEAGENT_DEBUG": "1", "NODEAGENT_MMAP": "off"})
    assert c.debug is True and c.mmap is False and c.source("debug") == "env NODEAGENT_DEBUG"
    with pytest.raises(Exception):
        c.debug = False  # type: ignore[misc]
    assert c.with_flags({"threads": 2}).threads == 2 and c.threads is None


def test_every_variable_declared_once():
    envs = [s.env for s in SETTINGS]
    assert len(envs) == len(set(envs)) and all(e.startswith("NODEAGENT_") for e in envs)


def test_xdg_defaults():
    c = resolve(env={"XDG_CACHE_HOME": "/x/cache", "XDG_DATA_HOME": "/x/data"})
    assert c["test_models_dir"] == Path("/x/cache/nodeagent/test-models")
    assert c["model_dir"] == Path("/x/data/nodeagent/models")


def test_hf_offline_is_honoured():
    assert resolve(env={"HF_HUB_OFFLINE": "1"})["offline"] is True


@pytest.mark.parametrize("env", [{"NODEAGENT_THREADS": "zero"}, {"NODEAGENT_THREADS": "-1"},
                                 {"NODEAGENT_DEBUG": "maybe"}, {"NODEAGENT_TYPE_K": "q3"},
                                 {"NODEAGENT_GPU_LAYERS": "-2"}])
def test_bad_values(env):
    with pytest.raises(ConfigError, match="bad value"):
        resolve(env=env)


def test_config_file_errors(tmp_path):
    p = tmp_path / "c.toml"
    assert load_config_file(p) == {}
    p.write_text("threads = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config_file(p)
    p.write_text("thread = 3\n")
    with pytest.raises(ConfigError, match="unknown keys: thread"):
        load_config_file(p)
    p.write_text("threads = 3\nlog_level = 'info'\n")
    assert resolve(file_values=load_config_file(p), file_path=p)["threads"] == 3


def test_downloaded_weights_never_land_in_the_checkout():
    """Pulled models, the test models and cached headers default to the user's data and cache folders."""
    checkout = Path(__file__).resolve().parent.parent
    c = resolve(env={"HOME": "/home/someone"})
    for name in ("model_dir", "test_models_dir", "cache_dir", "state_dir"):
        assert checkout not in c[name].resolve().parents, name
    ignored = (checkout / ".gitignore").read_text()
    assert "*.gguf" in ignored and "*.safetensors" in ignored
