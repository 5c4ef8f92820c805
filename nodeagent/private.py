"""Files for their owner only: nodeagent's state (the queue with every task's input and result, the node id, the
ledger) is kept in a 0700 folder and the queue's files are 0600, so another local user reads none of it. Where the
folder or a file exists with broader permissions and this user owns it, it is tightened (and said once); one owned
by somebody else is left as it is (`nodeagent doctor` reports it)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

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
