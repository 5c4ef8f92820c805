"""The SQLite engine's task logs: the log_open table (a task's log, open until its time) and the logs table (its
events, in order), appended to in the step that ends a task."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from nodeagent.broker.base import CONTRACT
from nodeagent.broker.sqlite.connection import PURGE_ROWS, SqliteConnection, _chunks
from nodeagent.tasks.events import Queued

SCHEMA = """
CREATE TABLE IF NOT EXISTS log_open (task_id TEXT PRIMARY KEY, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS logs (seq INTEGER PRIMARY KEY AUTOINCREMENT, task_id TEXT NOT NULL, event TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS logs_task ON logs (task_id, seq);
CREATE INDEX IF NOT EXISTS log_open_expiry ON log_open (expires_at);
"""


def append_event(db: sqlite3.Connection, task_id: str, event: dict[str, Any]) -> None:
    db.execute("INSERT INTO logs (task_id, event) SELECT ?, ? WHERE EXISTS (SELECT 1 FROM log_open WHERE "
               "task_id = ?)", (task_id, json.dumps({**event, "contract": CONTRACT}), task_id))


class SqliteLogs(SqliteConnection):
    """The ``TaskLogs`` store on SQLite."""

    # -- event logs (a gateway waiting on its tasks) ------------------------------------------------------
    def open_log(self, task_id: str, ttl_s: float) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO log_open VALUES (?, ?)", (task_id, self.now() + ttl_s))
            db.execute("INSERT INTO logs (task_id, event) VALUES (?, ?)",
                       (task_id, json.dumps({**Queued().to_wire(), "contract": CONTRACT})))

    def publish(self, task_id: str, event: dict[str, Any], keep: int = 0) -> None:
        with self._tx() as db:
            append_event(db, task_id, event)

    def read_logs(self, cursors: dict[str, str], wait_s: float = 0.0) -> list[tuple[str, str, dict[str, Any]]]:
        out = []
        for chunk in _chunks(list(cursors)):
            since = min(int(cursors[t]) for t in chunk)
            rows = self._db().execute(f"SELECT seq, task_id, event FROM logs WHERE seq > ? AND task_id IN "
                                      f"({','.join('?' * len(chunk))}) ORDER BY seq", (since, *chunk)).fetchall()
            out += [(r["task_id"], str(r["seq"]), json.loads(r["event"])) for r in rows
                    if r["seq"] > int(cursors[r["task_id"]])]
        return out

    def trim_log(self, task_id: str, cursor: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM logs WHERE task_id=? AND seq <= ?", (task_id, int(cursor)))

    def purge_logs(self, older_than_s: float) -> None:
        """Drop the event logs past their time, through an index by time, a few hundred a transaction."""
        now = self.now()
        while True:
            with self._tx() as db:
                gone = [r[0] for r in db.execute("SELECT task_id FROM log_open WHERE expires_at < ? LIMIT ?",
                                                 (now, PURGE_ROWS))]
                db.executemany("DELETE FROM logs WHERE task_id=?", [(i,) for i in gone])
                db.executemany("DELETE FROM log_open WHERE task_id=?", [(i,) for i in gone])
            if len(gone) < PURGE_ROWS:
                return
