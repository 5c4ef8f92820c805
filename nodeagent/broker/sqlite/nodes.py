"""The SQLite engine's node registry: the nodes table (a record per node, its heartbeat on the broker's time and on
the host clock with its boot)."""

from __future__ import annotations

import json
import logging
from typing import Any

from nodeagent.broker.base import NodeRecord
from nodeagent.broker.sqlite.connection import SqliteConnection

log = logging.getLogger(__name__)
SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
  id TEXT PRIMARY KEY,
  record TEXT NOT NULL,
  heartbeat_at REAL NOT NULL,
  heartbeat_host REAL,
  boot TEXT
);
"""


class SqliteNodes(SqliteConnection):
    """The ``NodeRegistry`` store on SQLite."""

    # -- nodes ---------------------------------------------------------------------------------------------
    def register(self, node: NodeRecord) -> float:
        now, boot, host = self._times()
        record = node.model_copy(update={"started_at": now, "heartbeat_at": now})
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,?)", (node.id, record.model_dump_json(), now,
                                                                          host, boot))
        return now

    def heartbeat(self, node_id: str, fields: dict[str, Any]) -> float | None:
        now, boot, host = self._times()
        with self._tx() as db:
            row = db.execute("SELECT record FROM nodes WHERE id=?", (node_id,)).fetchone()
            if row is None:
                return None
            record = {**json.loads(row["record"]), **fields, "heartbeat_at": now}
            db.execute("UPDATE nodes SET record=?, heartbeat_at=?, heartbeat_host=?, boot=? WHERE id=?",
                       (json.dumps(record), now, host, boot, node_id))
        return now

    def nodes(self) -> list[NodeRecord]:
        """The node records, each heartbeat's time as the host clock measured it since (a wall-clock step
        between the beat and now does not age it)."""
        now, boot, host = self._times()
        rows = self._db().execute("SELECT record, heartbeat_host, boot FROM nodes ORDER BY id").fetchall()
        out = []
        for r in rows:
            try:
                record = NodeRecord.model_validate_json(r["record"])
            except ValueError as exc:  # one unreadable record (another version's, hand-edited) hides only itself
                log.warning("a node record could not be read, left out: %s", str(exc).splitlines()[0])
                continue
            if r["boot"] == boot and r["heartbeat_host"] is not None:
                record = record.model_copy(update={"heartbeat_at": now - (host - r["heartbeat_host"])})
            out.append(record)
        return out

    def purge_nodes(self, older_than_s: float) -> None:
        """Drop the records of nodes not heard from for the retention."""
        cutoff = self.now() - older_than_s
        with self._tx() as db:
            db.execute("DELETE FROM nodes WHERE heartbeat_at < ?", (cutoff,))
