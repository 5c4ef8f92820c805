"""What every command shares: the app context (config, probe, profile) and --json."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click

from nodeagent import config as cfg
from nodeagent.hardware import HardwareInfo, probe
from nodeagent.hardware.system import RecordedSystem, SystemSource
from nodeagent.profiles import DeviceProfile, ProfileMatch, get_profile, match_profile

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout instead of a table.")


@dataclass
class App:
    """Resolved lazily: `nodeagent inspect` never probes the machine."""

    flags: dict[str, Any]
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    system: SystemSource | None = None
    _hw: HardwareInfo | None = None
    _match: ProfileMatch | None = None
    _config: cfg.Config | None = None

    def base_config(self) -> cfg.Config:
        """Settings that do not depend on the device profile (no probe needed)."""
        return self.config(with_profile=False)

    def config(self, with_profile: bool = True) -> cfg.Config:
        if with_profile and self._config is not None:
            return self._config
        first = cfg.resolve(self.flags, self.env)
        path = first["config_file"]
        file_values = cfg.load_config_file(path)
        profile_values: dict[str, Any] = {}
        profile_id = None
        if with_profile:
            profile = self.profile()
            profile_values, profile_id = profile.settings(self.hardware()), profile.id
        resolved = cfg.resolve(self.flags, self.env, file_values, profile_values, profile_id, path)
        if with_profile:
            self._config = resolved
        return resolved

    def hardware(self) -> HardwareInfo:
        if self._hw is None:
            system = self.system
            fixture = self.base_config()["hardware_fixture"]
            if system is None and fixture:
                system = RecordedSystem.load(fixture)
            model_dir = self.base_config()["model_dir"]
            self._hw = probe(system, disk_path=str(model_dir))
        return self._hw

    def profile_match(self) -> ProfileMatch:
        if self._match is None:
            forced = self.base_config()["profile"]
            if forced:
                get_profile(forced)
                self._match = ProfileMatch(profile_id=forced, reasons=["chosen with --profile/NODEAGENT_PROFILE"],
                                           score=0)
            else:
                self._match = match_profile(self.hardware())
        return self._match

    def profile(self) -> DeviceProfile:
        return get_profile(self.profile_match().profile_id)


def pass_app(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.pass_obj(fn)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s", force=True)


def path_str(p: Path | str | None) -> str | None:
    return None if p is None else str(p)
