"""Check 3: the model directory and the state directory exist (or can be made) and are writable; the state
directory is its owner's only (``nodeagent/private.py``); so is every file that holds a secret: the config file when
it holds a token or a broker password, the token file and the broker's password files.

The model directory's free space is compared with one figure, said in the detail: the size of the smallest
catalog model's default file (its first quant, what `nodeagent pull` takes when no plan chooses). Less than
that, and not even the smallest model can be pulled there.
"""

from __future__ import annotations

import os
from pathlib import Path

from nodeagent.config import SETTINGS_BY_NAME
from nodeagent.doctor.edges import Edges
from nodeagent.doctor.types import Check, fail, ok, warn
from nodeagent.units import format_bytes


def smallest_default_file():  # type: ignore[no-untyped-def]
    """The default file of the catalog's generator with the fewest parameters (a CatalogFile), or None: what a node
    must hold at the least to do its work (an embedding model alone, far smaller, extracts nothing)."""
    from nodeagent.store.catalog import load_catalog

    models = [m for m in load_catalog().values() if "extract" in m.roles]
    if not models:
        return None
    return min(models, key=lambda m: m.params).file(None)


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def _nearest(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def dir_check(e: Edges, setting: str, label: str) -> Check:
    """Whether the directory of ``setting`` is (or can be made) a writable directory; its free space."""
    path = Path(getattr(e.config, setting)).expanduser()
    env = SETTINGS_BY_NAME[setting].env
    if path.exists() and not path.is_dir():
        return fail(label, f"{path} is not a directory", f"move {path} away, or set {env} to another directory")
    if path.exists() and not _writable(path):
        return fail(label, f"{path} is not writable by this user", f'sudo chown -R "$(id -un)" {path}')
    nearest = _nearest(path)
    if not path.exists():
        if not nearest.is_dir():
            return fail(label, f"{path} cannot be made: {nearest} is not a directory",
                        f"set {env} to a directory that can be made")
        if not _writable(nearest):
            return fail(label, f"{path} cannot be made: {nearest} is not writable by this user",
                        f'sudo mkdir -p {path} && sudo chown "$(id -un)" {path}')
    free = e.disk_free(path)
    state = "writable" if path.exists() else f"not made yet, can be made under {nearest}"
    detail = f"{path}: {state}, {format_bytes(free) if free is not None else 'unknown space'} free"
    return ok(label, detail, None if path.exists() else f"mkdir -p {path}")


def model_dir_check(e: Edges) -> Check:
    check = dir_check(e, "model_dir", "model directory")
    free = e.disk_free(Path(e.config.model_dir).expanduser())
    smallest = smallest_default_file()
    if check.status != "ok" or free is None or smallest is None or smallest.size_bytes is None:
        return check
    if free < smallest.size_bytes:
        return warn(check.name, f"{check.detail}: less than the smallest catalog generator's default file "
                                f"({smallest.model_id} {smallest.quant}, {format_bytes(smallest.size_bytes)}, "
                                f"{smallest.size_source} size), so no catalog model can be pulled there",
                    f"free space under {e.config.model_dir}, or set "
                    f"{SETTINGS_BY_NAME['model_dir'].env} to a directory on a larger disk")
    return check.model_copy(update={"detail": f"{check.detail} (the smallest catalog generator's default file, "
                                              f"{smallest.model_id} {smallest.quant}, is "
                                              f"{format_bytes(smallest.size_bytes)})"})


def state_dir_check(e: Edges) -> Check:
    """The state directory as any other, and its owner's only: it holds the queue (every task's input and result)."""
    from nodeagent.private import others_may_read

    check = dir_check(e, "state_dir", "state directory")
    path = Path(e.config.state_dir).expanduser()
    if check.status == "ok" and path.is_dir() and others_may_read(path):
        return fail(check.name, f"{path} can be read by other users ({oct(path.stat().st_mode & 0o777)[2:]}), and it "
                                "holds the queue: every task's input and result", f"chmod 700 {path}")
    return check


SECRET_FILES = "secret files"


def secret_files_check(e: Edges) -> Check:
    """Every file a secret is read from, its owner's only (``private.exposed_secret``, the test a starting process
    warns by): the config file when it holds one (``config.config_secrets``), and the files the token and the
    broker's passwords are kept in. Fails the first that others may read, with its fix."""
    from nodeagent.config import config_file_exposed
    from nodeagent.private import exposed_secret

    config_file = Path(e.config.config_file).expanduser()
    found = [config_file_exposed(config_file)]
    checked = [str(config_file)] if config_file.is_file() else []
    for setting, holds in (("token_file", "the bearer token"), ("broker_password_file", "the Redis password"),
                           ("broker_sentinel_password_file", "the Sentinels' password")):
        path = getattr(e.config, setting)
        if path is not None:
            path = Path(path).expanduser()
            found.append(exposed_secret(path, f"{holds} ({SETTINGS_BY_NAME[setting].env})"))
            checked.append(str(path))
    exposed = [x for x in found if x is not None]
    if exposed:
        more = f" ({len(exposed) - 1} more: {', '.join(str(x.path) for x in exposed[1:])})" if len(exposed) > 1 else ""
        return fail(SECRET_FILES, exposed[0].detail + more, exposed[0].fix)
    if not checked:
        return ok(SECRET_FILES, "no config file, token file or password file to check")
    return ok(SECRET_FILES, f"{', '.join(checked)}: none that holds a secret can be read by other users")
