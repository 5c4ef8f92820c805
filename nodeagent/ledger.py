"""One memory ledger per host: the nodeagent processes of a machine (sharing a state directory) reserve what
each loaded model's plan needs, so a second process plans against what is left rather than the whole machine
(with mmap the first one's weights are not yet resident when the second one plans, so MemAvailable alone
promises the same memory twice).

The ledger is a JSON file (``ledger.json`` in the state directory) changed under an exclusive ``flock``.
Each entry is a process id and a model with its planned host and GPU bytes. Whoever reads it drops the
entries of processes that are gone (``kill(pid, 0)``), so a reservation left by a killed process is
reclaimed at the next look by anyone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

from nodeagent.private import private_dir, private_file, private_text


class Ledger:
    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / "ledger.json"
        self.lock_path = Path(state_dir) / "ledger.lock"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        private_dir(self.path.parent)
        with open(private_file(self.lock_path), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    entries = json.loads(self.path.read_text() or "{}")
                except (FileNotFoundError, json.JSONDecodeError):
                    entries = {}
                live = {k: v for k, v in entries.items() if _alive(int(v.get("pid", 0)))}
                yield live
                tmp = self.path.with_suffix(".tmp")
                private_text(tmp, json.dumps(live, indent=1))
                os.replace(tmp, self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def reserve(self, model: str, host_bytes: int, gpu_bytes: int = 0, pid: int | None = None) -> None:
        pid = os.getpid() if pid is None else pid
        with self._locked() as entries:
            entries[f"{pid}:{model}"] = {"pid": pid, "model": model, "host_bytes": int(host_bytes),
                                         "gpu_bytes": int(gpu_bytes), "at": time.time()}

    def release(self, model: str, pid: int | None = None) -> None:
        pid = os.getpid() if pid is None else pid
        with self._locked() as entries:
            entries.pop(f"{pid}:{model}", None)

    def entries(self) -> list[dict[str, Any]]:
        """The live reservations (the dead ones dropped as they are read)."""
        with self._locked() as entries:
            return sorted(entries.values(), key=lambda e: e["at"])

    def others(self, pid: int | None = None) -> tuple[int, int]:
        """Host and GPU bytes reserved by the other live processes."""
        pid = os.getpid() if pid is None else pid
        theirs = [e for e in self.entries() if e["pid"] != pid]
        return sum(e["host_bytes"] for e in theirs), sum(e["gpu_bytes"] for e in theirs)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process its parent has not reaped yet is a zombie: gone all the same
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
