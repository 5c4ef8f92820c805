"""The SQLite engine's event log: the events table, the newest EVENTS_KEPT kept as it is written."""

from __future__ import annotations

import json
from typing import Any

from nodeagent.broker.base import CONTRACT, EVENTS_KEPT
from nodeagent.broker.sqlite.connection import SqliteConnection

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, event TEXT NOT NULL);
"""


class SqliteEvents(SqliteConnection):
    """The ``Events`` store on SQLite."""

    def record_event(self, event: dict[str, Any]) -> None:
        now = self.now()
        with self._tx() as db:
            cur = db.execute("INSERT INTO events (at, event) VALUES (?, ?)",
                             (now, json.dumps({**event, "at": now, "contract": CONTRACT})))
            db.execute("DELETE FROM events WHERE seq <= ?", (cur.lastrowid - EVENTS_KEPT,))

    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        rows = self._db().execute("SELECT event FROM events ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
        return [json.loads(r["event"]) for r in rows]

    def purge_events(self, older_than_s: float) -> None:
        """Nothing: each write drops what is past the newest EVENTS_KEPT."""
