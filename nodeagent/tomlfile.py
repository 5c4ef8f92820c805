"""The one TOML loader: config file, device profiles and the model catalog read through it."""

from __future__ import annotations

import sys
from typing import Any

from nodeagent.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def parse_toml(text: str | bytes, what: str, hint: str | None = None) -> dict[str, Any]:
    """Parse TOML text; ``what`` names it in the one-line error ("config file X", "device profile Y")."""
    try:
        return tomllib.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} is not valid TOML: {exc}", hint=hint) from None
