"""The Redis engine's task logs: a stream per task (``log:<id>``, entries ``e`` = the event's JSON), opened with a
TTL by the gateway that waits on the task, appended to by its worker and by the finish script."""

from __future__ import annotations

import json
from typing import Any

from nodeagent.broker.base import CONTRACT
from nodeagent.broker.redis.connection import LOG_MAX_ENTRIES, PREFIX, RedisConnection, _retried
from nodeagent.tasks.events import Queued


class RedisLogs(RedisConnection):
    """The ``TaskLogs`` store on Redis."""

    # -- event logs (a gateway waiting on its tasks) ----------------------------------------------------------
    @_retried
    def open_log(self, task_id: str, ttl_s: float) -> None:
        pipe = self.r.pipeline()
        pipe.xadd(self._log(task_id), {"e": json.dumps({**Queued().to_wire(), "contract": CONTRACT})})
        pipe.expire(self._log(task_id), max(1, int(ttl_s)))
        pipe.execute()

    @_retried
    def publish(self, task_id: str, event: dict[str, Any], keep: int = LOG_MAX_ENTRIES) -> None:
        """(Retried: a progress event's ``seq`` lets its reader drop a second copy.)"""
        self._scripts["append"](keys=[self._log(task_id)], args=[json.dumps({**event, "contract": CONTRACT}), keep])

    @_retried
    def read_logs(self, cursors: dict[str, str], wait_s: float = 0.0) -> list[tuple[str, str, dict[str, Any]]]:
        if not cursors:
            return []
        streams = {self._log(t): c for t, c in cursors.items()}
        got = self.r.xread(streams, count=1000, block=int(wait_s * 1000) if wait_s > 0 else None)
        out = []
        for key, entries in got or []:
            task_id = key.removeprefix(f"{PREFIX}log:")
            out += [(task_id, entry, json.loads(fields["e"])) for entry, fields in entries]
        return out

    @_retried
    def trim_log(self, task_id: str, cursor: str) -> None:
        ms, _, seq = cursor.partition("-")
        self.r.xtrim(self._log(task_id), minid=f"{ms}-{int(seq or 0) + 1}", approximate=False)

    def purge_logs(self, older_than_s: float) -> None:
        """Nothing: a log expires on its own (opened with its TTL)."""
