"""Where the data folders of the project (``profiles/``, ``models/``) are read from.

In a wheel they are installed inside the package as ``nodeagent._profiles`` and
``nodeagent._models`` (pyproject.toml maps the top-level folders there); in a
source checkout, which is what an editable install runs from, they are the
top-level folders themselves.
"""

from __future__ import annotations

from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def data_dir(name: str) -> Traversable:
    """The folder ``profiles`` or ``models``."""
    try:
        return resources.files(f"nodeagent._{name}")
    except ModuleNotFoundError:
        return _CHECKOUT / name


def toml_entries(name: str) -> list[Traversable]:
    """The *.toml files of that folder, sorted by name."""
    return sorted((e for e in data_dir(name).iterdir() if e.name.endswith(".toml")), key=lambda e: e.name)
