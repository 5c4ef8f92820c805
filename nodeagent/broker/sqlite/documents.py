"""The SQLite engine's documents: the documents table (a row per document: data, version, body, expiry), listed
newest first by its sequence."""

from __future__ import annotations

import json
from typing import Any, BinaryIO

from nodeagent.broker.sqlite.connection import SqliteConnection

SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  kind TEXT NOT NULL,
  id TEXT NOT NULL,
  data TEXT NOT NULL,
  version INTEGER NOT NULL,
  body TEXT,
  UNIQUE (kind, id)
);
"""


class SqliteDocuments(SqliteConnection):
    """The ``Documents`` store on SQLite."""

    # -- documents (the Batch API's files and batches) -----------------------------------------------------
    def doc_put(self, kind: str, doc_id: str, data: dict[str, Any], body: str | bytes | BinaryIO | None = None,
                version: int | None = None) -> bool:
        """(A body given as a file, an upload spooled to disk, is written into the row in pieces: never held
        whole in memory.)"""
        with self._tx() as db:
            if version is None and body is not None and not isinstance(body, (str, bytes)):
                size = body.seek(0, 2)
                body.seek(0)
                cur = db.execute("INSERT OR IGNORE INTO documents (kind, id, data, version, body) VALUES "
                                 "(?,?,?,1,zeroblob(?))", (kind, doc_id, json.dumps(data), size))
                if cur.rowcount == 1 and size:
                    with db.blobopen("documents", "body", cur.lastrowid) as blob:
                        while chunk := body.read(1 << 20):
                            blob.write(chunk)
            elif version is None:
                cur = db.execute("INSERT OR IGNORE INTO documents (kind, id, data, version, body) VALUES (?,?,?,1,?)",
                                 (kind, doc_id, json.dumps(data), body))
            else:
                cur = db.execute("UPDATE documents SET data=?, version=version+1 WHERE kind=? AND id=? AND version=?",
                                 (json.dumps(data), kind, doc_id, version))
        return cur.rowcount == 1

    def doc_get(self, kind: str, doc_id: str) -> tuple[dict[str, Any], int] | None:
        row = self._db().execute(f"SELECT data, version FROM documents WHERE kind=? AND id=? AND {_KEPT}",
                                 (kind, doc_id, self.now())).fetchone()
        return None if row is None else (json.loads(row["data"]), int(row["version"]))

    def doc_body(self, kind: str, doc_id: str) -> str | None:
        row = self._db().execute(f"SELECT body FROM documents WHERE kind=? AND id=? AND {_KEPT}",
                                 (kind, doc_id, self.now())).fetchone()
        body = None if row is None else row["body"]
        return body.decode("utf-8", "replace") if isinstance(body, bytes) else body  # a file's bytes, as text

    def doc_list(self, kind: str, after: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        cursor = "AND seq < (SELECT seq FROM documents WHERE kind=? AND id=?)" if after else ""
        rows = self._db().execute(f"SELECT data FROM documents WHERE kind=? AND {_KEPT} {cursor} ORDER BY seq DESC "
                                  "LIMIT ?", (kind, self.now(), *((kind, after) if after else ()), limit)).fetchall()
        return [json.loads(r["data"]) for r in rows]

    def doc_expire(self, kind: str, doc_id: str, at: float) -> None:
        with self._tx() as db:
            db.execute("UPDATE documents SET expires_at=? WHERE kind=? AND id=?", (at, kind, doc_id))

    def doc_delete(self, kind: str, doc_id: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM documents WHERE kind=? AND id=?", (kind, doc_id)).rowcount == 1

    def purge_documents(self, older_than_s: float) -> None:
        """Drop the documents past the time ``doc_expire`` gave them."""
        now = self.now()
        with self._tx() as db:
            db.execute("DELETE FROM documents WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))


# a document not past its expiry (one parameter: the broker's time)
_KEPT = "(expires_at IS NULL OR expires_at > ?)"
