"""The SQLite engine's connection, shared by its stores: one database file in WAL mode, a connection per thread, a
short ``BEGIN IMMEDIATE`` transaction per state change (``_tx``), the schema's versions, the broker's time (the host
clock anchored once per boot), and what the broker says of itself."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

from nodeagent.clock import host_clock, wall_synced
from nodeagent.errors import ConfigError

log = logging.getLogger(__name__)
SCHEMA_VERSION = 2
# schema 1 -> 2: leases and retry delays on the host clock (leased_until in its seconds, due_host, boot), the
# heartbeat's host-clock stamp, and the anchor of the broker's time per boot
MIGRATIONS = {1: ("ALTER TABLE tasks ADD COLUMN due_host REAL", "ALTER TABLE tasks ADD COLUMN boot TEXT",
                  "ALTER TABLE nodes ADD COLUMN heartbeat_host REAL", "ALTER TABLE nodes ADD COLUMN boot TEXT")}
# columns added within a schema version: read by this code, ignored by an older one (added when missing, at open)
ADDED_COLUMNS = (("documents", "expires_at", "REAL"), ("kv", "bytes", "INTEGER"), ("tasks", "kept_from", "REAL"),
                 ("tasks", "forget_at", "REAL"))
STEP_S = 2.0  # this process's wall clock moving this much against the host clock between two readings: a step
ANCHOR_READ_S = 2.0  # how often a process reads the anchor again (another may have moved it)
PURGE_ROWS = 500  # rows a purge's transaction drops at most (it repeats until none is left)
# the connection's own tables (each store's are in its file; the broker runs them all: ``SqliteBroker.schema``)
SCHEMA = """
CREATE TABLE IF NOT EXISTS clock (boot TEXT PRIMARY KEY, anchor REAL NOT NULL, synced INTEGER, set_at REAL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class SqliteConnection:
    """The connection every store of the SQLite engine shares (``SqliteBroker`` composes them over it)."""

    schema: str  # the database's tables: every store's, and the connection's own (``SqliteBroker``)

    def __init__(self, path: Path, busy_timeout_s: float = 30.0, wall: Callable[[], float] = time.time) -> None:
        """``wall``: this process's wall clock (injected by the clock tests), which only anchors the broker's time."""
        self.path = Path(path)
        self.wall = wall
        self.url = f"sqlite://{self.path}"
        self._busy_ms = int(busy_timeout_s * 1000)
        self._local = threading.local()
        self._clock_lock = threading.Lock()
        self._anchor: tuple[float, float] | None = None  # (the anchor, host clock when read)
        self._mine: float | None = None  # this process's wall clock less the host clock, last seen
        try:
            from nodeagent.private import private_file

            # every task's input and result: the owner's only (SQLite gives the -wal and -shm files the database
            # file's mode); a folder made for it is the owner's too (the state directory: ``open_broker``)
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            for suffix in ("", "-wal", "-shm"):
                if suffix == "" or self.path.with_name(self.path.name + suffix).exists():
                    private_file(self.path.with_name(self.path.name + suffix))
            self._db().executescript(self.schema)  # idempotent (IF NOT EXISTS); executescript commits on its own
            for table, column, kind in ADDED_COLUMNS:
                if column not in {r[1] for r in self._db().execute(f"PRAGMA table_info({table})")}:
                    try:
                        self._db().execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                    except sqlite3.OperationalError as exc:  # another process added it first
                        if "duplicate column" not in str(exc):
                            raise
            self._db().execute("CREATE INDEX IF NOT EXISTS tasks_forget ON tasks (forget_at) WHERE forget_at IS NOT "
                               "NULL")
            self._db().execute("CREATE INDEX IF NOT EXISTS documents_expiry ON documents (expires_at) WHERE "
                               "expires_at IS NOT NULL")
            with self._tx() as db:
                row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                if row is None:
                    db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                elif int(row[0]) in MIGRATIONS:
                    for statement in MIGRATIONS[int(row[0])]:
                        db.execute(statement)
                    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
                elif int(row[0]) != SCHEMA_VERSION:
                    raise ConfigError(f"{self.path} holds queue schema {row[0]}, this nodeagent speaks "
                                      f"{SCHEMA_VERSION}", hint="use another NODEAGENT_HOME, or the matching version")
            self.now()  # the first process of this boot to open the queue anchors its time
        except sqlite3.Error as exc:
            raise ConfigError(f"cannot open the queue database {self.path}: {exc}",
                              hint="check NODEAGENT_HOME and its permissions") from None

    # -- connections: one per thread (the worker's lease and heartbeat threads have their own) ---------------
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=self._busy_ms / 1000, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never corrupt
            db.execute(f"PRAGMA busy_timeout={self._busy_ms}")
            db.row_factory = sqlite3.Row
            db.text_factory = _text  # text written by hand that is not UTF-8 must not fail the claim reading it
            self._local.db = db
        return db

    class _Tx:
        def __init__(self, db: sqlite3.Connection) -> None:
            self.db = db

        def __enter__(self) -> sqlite3.Connection:
            self.db.execute("BEGIN IMMEDIATE")
            return self.db

        def __exit__(self, exc_type: Any, *rest: Any) -> None:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")

    def _tx(self) -> "SqliteConnection._Tx":
        return SqliteConnection._Tx(self._db())

    # -- time ----------------------------------------------------------------------------------------------
    def now(self) -> float:
        """The broker's time: the host clock plus this boot's anchor (the same in every process of the host)."""
        return self._times()[0]

    def _times(self) -> tuple[float, str, float]:
        """(the broker's time, this boot, the host clock), read together."""
        boot, host = host_clock()
        mine = self.wall() - host
        anchor = self._anchor
        stepped = self._mine is not None and abs(mine - self._mine) > STEP_S
        if anchor is None or stepped or host - anchor[1] > ANCHOR_READ_S:
            anchor = self._read_anchor(boot, host, mine, stepped)
        self._mine = mine
        return anchor[0] + host, boot, host

    def _read_anchor(self, boot: str, host: float, mine: float, stepped: bool) -> tuple[float, float]:
        """This boot's anchor; set by the first process of the boot, moved by one that saw the wall clock step (or
        whose clock is synchronised where the anchor's was not). A read, unless it must be written."""
        with self._clock_lock:
            row = self._db().execute("SELECT anchor, synced FROM clock WHERE boot=?", (boot,)).fetchone()
            off = row is None or abs(float(row["anchor"]) - mine) > STEP_S
            synced = wall_synced() if off else None
            if row is None or (off and (stepped or (synced and not row["synced"]))):
                with self._tx() as db:
                    if row is not None:
                        log.warning("the wall clock %s by %+.1f s: the queue's time follows it (deadlines are "
                                    "wall-clock instants; leases and retry delays are on the host clock and do not "
                                    "move)", "stepped" if stepped else "is synchronised now, off the queue's",
                                    mine - float(row["anchor"]))
                    db.execute("INSERT OR REPLACE INTO clock VALUES (?,?,?,?)", (boot, mine, int(bool(synced)),
                                                                                 time.time()))
                value = mine
            else:
                value = float(row["anchor"])
            self._anchor = (value, host)
            return self._anchor

    # -- the broker's own settings (the doctor's, and a starting worker's) ------------------------------
    def settings(self) -> dict[str, Any]:
        import shutil

        db = self._db()
        out: dict[str, Any] = {"engine": "sqlite", "url": self.url, "path": str(self.path),
                               "journal_mode": db.execute("PRAGMA journal_mode").fetchone()[0],
                               "synchronous": db.execute("PRAGMA synchronous").fetchone()[0]}
        try:
            usage = shutil.disk_usage(self.path.parent)
            out.update(disk_free_bytes=usage.free, disk_total_bytes=usage.total)
        except OSError:
            pass
        try:
            out["size_bytes"] = sum(p.stat().st_size for p in self.path.parent.glob(self.path.name + "*"))
        except OSError:
            pass
        return out

    def hurry(self) -> None:
        """Nothing to hurry: a local file has no outage to ride out."""

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _chunks(items: list[str], size: int = 500) -> list[list[str]]:
    """At most ``size`` ids a statement (SQLite bounds a statement's parameters)."""
    return [items[i:i + size] for i in range(0, len(items), size)]
