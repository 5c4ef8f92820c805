"""The Redis engine's event log: one stream (``events``), capped at about EVENTS_KEPT entries as it is written."""

from __future__ import annotations

import json
from typing import Any

from nodeagent.broker.base import CONTRACT, EVENTS_KEPT
from nodeagent.broker.redis.connection import PREFIX, RedisConnection, _retried


class RedisEvents(RedisConnection):
    """The ``Events`` store on Redis."""

    def record_event(self, event: dict[str, Any]) -> None:
        self.r.xadd(f"{PREFIX}events", {"e": json.dumps({**event, "at": self.now(), "contract": CONTRACT})},
                    maxlen=EVENTS_KEPT, approximate=True)

    @_retried
    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        return [json.loads(f["e"]) for _, f in self.r.xrevrange(f"{PREFIX}events", count=limit)]

    def purge_events(self, older_than_s: float) -> None:
        """Nothing: the stream is capped as it is written (``MAXLEN``)."""
