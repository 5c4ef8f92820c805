"""Files for their owner only: nodeagent's state (the queue with every task's input and result, the node id, the
ledger) is kept in a 0700 folder and the queue's files are 0600, so another local user reads none of it. Where the
folder or a file exists with broader permissions and this user owns it, it is tightened (and said once); one owned
by somebody else is left as it is (`nodeagent doctor` reports it).

A file of the operator's that holds a secret (a token file, a password file, a config file with a token or a broker
password in it) is never changed here: ``exposed_secret`` says whether others may read it, with its fix, the one
test every reader of such a file asks (the warning at start, `service install`'s refusal, the doctor's check)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from pydantic import Field

from nodeagent.values import Frozen

log = logging.getLogger(__name__)
_SAID: set[str] = set()


def private_dir(path: Path) -> Path:
    """``path`` made (0700, with its missing parents) or tightened to 0700."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _tighten(path, 0o700)
    return path


def private_file(path: Path) -> Path:
    """``path`` made empty (0600) when missing, or tightened to 0600."""
    path = Path(path)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600))
    except FileExistsError:
        pass
    _tighten(path, 0o600)
    return path


def private_text(path: Path, text: str) -> Path:
    """``path`` written with ``text``, 0600 whatever the umask."""
    path = Path(path)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    _tighten(path, 0o600)
    return path


def others_may_read(path: Path) -> bool:
    """Whether users other than the owner may read or enter ``path``."""
    return bool(Path(path).stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO))


class ExposedSecret(Frozen):
    """A file that holds a secret and that users other than its owner may read: what says so, and the fix."""

    path: Path
    holds: str = Field(description="What it holds, in words: 'the bearer token (token)', 'a secret "
                                   "(NODEAGENT_TOKEN_FILE)'")
    mode: int
    fix: str

    @property
    def detail(self) -> str:
        return f"{self.path} holds {self.holds} and can be read by other users ({self.mode:03o})"

    def __str__(self) -> str:
        return f"{self.detail}: {self.fix}"


def exposed_secret(path: Path, holds: str, instead: str | None = None) -> ExposedSecret | None:
    """Whether ``path``, a file that holds a secret (``holds``, in words), may be read (or written) by users other than
    its owner: None when it may not, or cannot be looked at; else what says so, with the fix: ``chmod 600``, or
    ``instead`` (where else the secret may be kept) when the file is not the secret's own."""
    try:
        mode = stat.S_IMODE(Path(path).stat().st_mode)
    except OSError:
        return None
    if not mode & (stat.S_IRWXG | stat.S_IRWXO):
        return None
    fix = f"chmod 600 {path}" + (f", or {instead}" if instead else "")
    return ExposedSecret(path=Path(path), holds=holds, mode=mode, fix=fix)


def warn_exposed(exposed: ExposedSecret | None) -> ExposedSecret | None:
    """Log an exposed secret's file as a warning, once per process and file (the settings are read more than once
    at start); the same value back."""
    if exposed is not None and f"exposed {exposed.path}" not in _SAID:
        _SAID.add(f"exposed {exposed.path}")
        log.warning("%s", exposed)
    return exposed


def _tighten(path: Path, mode: int) -> None:
    try:
        st = path.stat()
    except OSError:
        return
    if stat.S_IMODE(st.st_mode) & ~mode and st.st_uid == os.geteuid():
        try:
            os.chmod(path, mode)
        except OSError:
            return
        if str(path) not in _SAID:
            _SAID.add(str(path))
            log.info("%s was readable by other users: now %o (its owner only)", path, mode)
