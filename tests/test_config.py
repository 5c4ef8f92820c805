"""The config resolver: precedence and provenance."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.config import SETTINGS, load_config_file, resolve
from nodeagent.errors import ConfigError


def test_precedence_flag_env_file_profile_default(tmp_path):
    profile = {"threads": 4, "default_ctx_tokens": 8192, "slots": 2}
    c = resolve(flags={"threads": 8}, env={"NODEAGENT_THREADS": "6", "NODEAGENT_CTX": "1024"},
                file_values={"threads": 5, "ctx_tokens": 2048, "slots": 3}, profile_values=profile,
                profile_id="rpi5-8gb", file_path=tmp_path / "c.toml")
    assert (c["threads"], c.source("threads")) == (8, "flag")
    assert (c["ctx_tokens"], c.source("ctx_tokens")) == (1024, "env NODEAGENT_CTX")
    assert (c["slots"], c.source("slots")) == (3, f"config {tmp_path / 'c.toml'}")
    c = resolve(profile_values=profile, profile_id="rpi5-8gb")
    assert (c["slots"], c.source("slots")) == (2, "profile rpi5-8gb")
    assert c.source("log_level") == "default"


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
                                 {"NODEAGENT_DEBUG": "maybe"}])
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
