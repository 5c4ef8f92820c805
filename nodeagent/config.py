"""One configuration resolver with provenance.

Precedence: command-line flag > environment variable > config file > device
profile > built-in default. Every ``NODEAGENT_*`` variable is declared once in
``SETTINGS``; ``nodeagent --help`` and ``nodeagent config show`` list them.

``resolve()`` is pure: the caller passes the flags, the environment, the parsed
config file and the profile's values, so tests need no monkeypatching.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from nodeagent.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _parse_positive_int(text: str) -> int:
    value = int(str(text).strip())
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def _path(text: str) -> Path:
    return Path(os.path.expanduser(text))


def _home() -> Path:
    return Path(os.path.expanduser("~"))


@dataclass(frozen=True)
class Setting:
    name: str
    env: str
    description: str
    parse: Callable[[str], Any]
    default: Callable[[Mapping[str, Any]], Any]
    profile_key: str | None = None  # the device profile field that supplies it


def _xdg(env_name: str, fallback: str) -> Callable[[Mapping[str, Any]], Path]:
    def default(env: Mapping[str, Any]) -> Path:
        base = env.get(env_name)
        return Path(base) if base else _home() / fallback

    return default


SETTINGS: tuple[Setting, ...] = (
    Setting("config_file", "NODEAGENT_CONFIG", "Path of the TOML config file.",
            _path, lambda env: _xdg("XDG_CONFIG_HOME", ".config")(env) / "nodeagent" / "config.toml"),
    Setting("state_dir", "NODEAGENT_HOME", "Directory for nodeagent's state (queue, logs).",
            _path, lambda env: _xdg("XDG_DATA_HOME", ".local/share")(env) / "nodeagent"),
    Setting("model_dir", "NODEAGENT_MODEL_DIR", "Directory where pulled models are stored.",
            _path, lambda env: _xdg("XDG_DATA_HOME", ".local/share")(env) / "nodeagent" / "models"),
    Setting("test_models_dir", "NODEAGENT_TEST_MODELS_DIR",
            "Cache of the test models fetched from the package index.",
            _path, lambda env: _xdg("XDG_CACHE_HOME", ".cache")(env) / "nodeagent" / "test-models"),
    Setting("profile", "NODEAGENT_PROFILE", "Device profile id to use instead of the matched one.",
            str, lambda env: None),
    Setting("threads", "NODEAGENT_THREADS", "CPU threads for inference.",
            _parse_positive_int, lambda env: os.cpu_count() or 1, profile_key="threads"),
    Setting("ctx_tokens", "NODEAGENT_CTX", "Default context length in tokens.",
            _parse_positive_int, lambda env: 4096, profile_key="default_ctx_tokens"),
    Setting("slots", "NODEAGENT_SLOTS", "Parallel sequences (slots) served at once.",
            _parse_positive_int, lambda env: 1, profile_key="slots"),
    Setting("offline", "NODEAGENT_OFFLINE", "Never contact a model hub (HF_HUB_OFFLINE is honoured too).",
            parse_bool, lambda env: parse_bool(str(env.get("HF_HUB_OFFLINE", "0")))),
    Setting("hardware_fixture", "NODEAGENT_HARDWARE_FIXTURE",
            "Probe a recorded machine (a JSON fixture) instead of this one: for tests and support.",
            _path, lambda env: None),
    Setting("log_level", "NODEAGENT_LOG_LEVEL", "Log level on stderr (debug, info, warning, error).",
            lambda s: str(s).lower(), lambda env: "warning"),
    Setting("debug", "NODEAGENT_DEBUG", "Show tracebacks for errors.",
            parse_bool, lambda env: False),
)

SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}


@dataclass(frozen=True)
class Resolved:
    value: Any
    source: str  # "flag", "env NODEAGENT_X", "config <path>", "profile <id>", "default"


@dataclass(frozen=True)
class Config:
    values: Mapping[str, Resolved]

    def __getitem__(self, name: str) -> Any:
        return self.values[name].value

    def source(self, name: str) -> str:
        return self.values[name].source

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {
            name: {"value": str(r.value) if isinstance(r.value, Path) else r.value,
                   "source": r.source, "env": SETTINGS_BY_NAME[name].env}
            for name, r in self.values.items()
        }


def _convert(setting: Setting, raw: Any, where: str) -> Any:
    if raw is None:
        return None
    try:
        return setting.parse(raw if isinstance(raw, str) else str(raw))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: bad value for {setting.name}: {exc}",
                          hint=f"fix {setting.env} or '{setting.name}' in the config file") from None


def load_config_file(path: Path) -> dict[str, Any]:
    """Read the TOML config file; a missing file is an empty config."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        parsed = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}",
                          hint="fix the file or point NODEAGENT_CONFIG elsewhere") from None
    unknown = sorted(set(parsed) - set(SETTINGS_BY_NAME))
    if unknown:
        raise ConfigError(f"config file {path} has unknown keys: {', '.join(unknown)}",
                          hint=f"known keys: {', '.join(SETTINGS_BY_NAME)}")
    return parsed


def resolve(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
    profile_values: Mapping[str, Any] | None = None,
    profile_id: str | None = None,
    file_path: Path | None = None,
) -> Config:
    """Resolve every setting, remembering where each value came from."""
    flags = flags or {}
    env = env if env is not None else {}
    file_values = file_values or {}
    profile_values = profile_values or {}
    out: dict[str, Resolved] = {}
    for s in SETTINGS:
        if flags.get(s.name) is not None:
            out[s.name] = Resolved(_convert(s, flags[s.name], "flag"), "flag")
        elif env.get(s.env) not in (None, ""):
            out[s.name] = Resolved(_convert(s, env[s.env], s.env), f"env {s.env}")
        elif s.name in file_values:
            out[s.name] = Resolved(_convert(s, file_values[s.name], f"config {file_path}"), f"config {file_path}")
        elif s.profile_key and profile_values.get(s.profile_key) is not None:
            out[s.name] = Resolved(profile_values[s.profile_key], f"profile {profile_id}")
        else:
            out[s.name] = Resolved(s.default(env), "default")
    return Config(out)


def env_rows() -> list[tuple[str, str]]:
    """(variable, description) for every setting, for --help."""
    return [(s.env, s.description) for s in SETTINGS]
