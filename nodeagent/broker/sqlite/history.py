"""The SQLite engine's history: the history table, a value per (minute, field)."""

from __future__ import annotations

import sqlite3

from nodeagent.broker.sqlite.connection import SqliteConnection

SCHEMA = """
CREATE TABLE IF NOT EXISTS history (minute INTEGER NOT NULL, field TEXT NOT NULL, value REAL NOT NULL,
                                    PRIMARY KEY (minute, field)) WITHOUT ROWID;
"""


class SqliteHistory(SqliteConnection):
    """The ``HistoryStore`` store on SQLite."""

    _purged_minute: int | None = None  # the history's old minutes went at this minute

    def history_add(self, minute: int, counts: dict[str, float], keep_s: float) -> None:
        with self._tx() as db:
            db.executemany("INSERT INTO history VALUES (?, ?, ?) ON CONFLICT (minute, field) DO UPDATE SET "
                           "value = value + excluded.value", [(minute, k, v) for k, v in counts.items()])
            self._history_purge(db, minute, keep_s)

    def history_set(self, minute: int, values: dict[str, float], keep_s: float) -> None:
        with self._tx() as db:
            db.executemany("INSERT OR REPLACE INTO history VALUES (?, ?, ?)",
                           [(minute, k, v) for k, v in values.items()])
            self._history_purge(db, minute, keep_s)

    def _history_purge(self, db: sqlite3.Connection, minute: int, keep_s: float) -> None:
        """The minutes past ``keep_s`` go, once per minute of this process."""
        if self._purged_minute != minute:
            db.execute("DELETE FROM history WHERE minute < ?", (minute - int(keep_s // 60),))
            self._purged_minute = minute

    def history(self, first_minute: int, kinds: tuple[str, ...] | None = None) -> dict[int, dict[str, float]]:
        sql, args = "SELECT minute, field, value FROM history WHERE minute >= ?", [first_minute]
        if kinds:
            sql += f" AND substr(field, 1, 1) IN ({','.join('?' * len(kinds))})"
            args += list(kinds)
        out: dict[int, dict[str, float]] = {}
        for m, field, value in self._db().execute(sql, args):
            out.setdefault(m, {})[field] = value
        return out

    def purge_history(self, older_than_s: float) -> None:
        """Nothing: a minute past ``keep_s`` goes as a later minute is written (``_history_purge``)."""
