"""The Redis engine's node registry: a hash per node (``node:<id>``: record, started_at and heartbeat_at on the
server's time, kept the retention from its last heartbeat), and the set ``nodes`` that lists their ids."""

from __future__ import annotations

import json
import logging
from typing import Any

from nodeagent.broker.base import NodeRecord
from nodeagent.broker.redis.connection import PREFIX, RedisConnection, _retried

log = logging.getLogger(__name__)


class RedisNodes(RedisConnection):
    """The ``NodeRegistry`` store on Redis."""

    # -- nodes -----------------------------------------------------------------------------------------------
    @_retried
    def register(self, node: NodeRecord) -> float:
        """The node's record; its start and heartbeat stamped on the server's clock (returned)."""
        return float(self._scripts["register"](keys=[f"{PREFIX}node:{node.id}", f"{PREFIX}nodes"],
                                               args=[node.id, node.model_dump_json(), self.retention_s]))

    @_retried
    def heartbeat(self, node_id: str, fields: dict[str, Any]) -> float | None:
        """The record refreshed with ``fields`` and its heartbeat stamped on the server's clock (returned; None
        for a node that is not registered)."""
        key = f"{PREFIX}node:{node_id}"
        text = self.r.hget(key, "record") if self.r.type(key) == "hash" else None
        if text is None:
            return None
        got = self._scripts["heartbeat"](keys=[key, f"{PREFIX}nodes"],
                                         args=[json.dumps({**json.loads(text), **fields}), self.retention_s, node_id])
        return float(got) if got else None

    @_retried
    def nodes(self) -> list[NodeRecord]:
        ids = sorted(self.r.smembers(f"{PREFIX}nodes"))
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hmget(f"{PREFIX}node:{i}", ["record", "started_at", "heartbeat_at"])
        out = []
        gone = []
        for node_id, got in zip(ids, pipe.execute(raise_on_error=False)):
            if isinstance(got, list) and not any(got):
                gone.append(node_id)  # its record expired (a node not heard from for the retention): unlisted
            if isinstance(got, Exception) or not got or got[0] is None:
                continue  # gone (expired), or an older version's record: it registers again when it starts
            try:
                record = NodeRecord.model_validate_json(got[0])
            except ValueError as exc:  # one unreadable record (another version's, hand-edited) hides only itself
                log.warning("a node record could not be read, left out: %s", str(exc).splitlines()[0])
                continue
            out.append(record.model_copy(update={"started_at": float(got[1] or record.started_at),
                                                 "heartbeat_at": float(got[2] or record.heartbeat_at)}))
        if gone:
            self.r.srem(f"{PREFIX}nodes", *gone)
        return out

    def purge_nodes(self, older_than_s: float) -> None:
        """Nothing: a record expires on its own after the retention (written with it), and ``nodes`` unlists it."""
