"""The SQLite engine's key-values: the kv table (a value, its expiry and its size per key)."""

from __future__ import annotations

from nodeagent.broker.sqlite.connection import SqliteConnection

SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL, expires_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS kv_expiry ON kv (expires_at);
"""


class SqliteKeyValues(SqliteConnection):
    """The ``KeyValues`` store on SQLite."""

    def kv_put(self, key: str, value: str, ttl_s: float, bound: tuple[int, int] | None = None) -> None:
        now = self.now()
        with self._tx() as db:
            db.execute("DELETE FROM kv WHERE expires_at <= ?", (now,))
            db.execute("INSERT OR REPLACE INTO kv (key, value, expires_at, bytes) VALUES (?, ?, ?, ?)",
                       (key, value, now + ttl_s, len(value.encode("utf-8", "surrogatepass"))))
            if bound is not None:  # the collection's oldest go first while it holds more than it may
                first = key.split(":", 1)[0] + ":"
                last = first[:-1] + ";"  # every key of the collection sorts between the two
                count, size = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM kv WHERE key >= ? AND "
                                         "key < ?", (first, last)).fetchone()
                while count > bound[0] or size > bound[1]:
                    oldest = db.execute("SELECT key, bytes FROM kv WHERE key >= ? AND key < ? ORDER BY expires_at "
                                        "LIMIT 64", (first, last)).fetchall()
                    for row in oldest:
                        if count <= bound[0] and size <= bound[1]:
                            break
                        db.execute("DELETE FROM kv WHERE key = ?", (row["key"],))
                        count, size = count - 1, size - (row["bytes"] or 0)
                    if not oldest:
                        break

    def kv_get(self, key: str) -> str | None:
        row = self._db().execute("SELECT value FROM kv WHERE key = ? AND expires_at > ?", (key, self.now())).fetchone()
        return None if row is None else str(row["value"])

    def kv_delete(self, key: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM kv WHERE key = ?", (key,))

    def purge_kv(self, older_than_s: float) -> None:
        """Drop the values past their expiry (a write drops them too)."""
        now = self.now()
        with self._tx() as db:
            db.execute("DELETE FROM kv WHERE expires_at <= ?", (now,))
