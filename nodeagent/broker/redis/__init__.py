"""The fleet broker: Redis Streams with consumer groups, and a thin layer of keys and Lua on top.

Key layout (contract version 1; ``schemas/redis-contract.md`` and ``schemas/envelope.schema.json``):

- ``nodeagent:v1:q:<queue>``           a stream per task type (``classify.v1``), consumer group ``workers``;
  ``nodeagent:v1:q:<queue>@<model>``   one per model a task is bound to. Each entry: ``envelope`` = the JSON.
- ``nodeagent:v1:task:<id>``           hash: envelope, queue, stream, entry, state, attempts, token, node,
                                       history (JSON), last_error (JSON), ready_at, updated_at.
- ``nodeagent:v1:delayed:<queue>``     sorted set of task ids by the time their retry is due.
- ``nodeagent:v1:dead:<queue>``        sorted set of dead-lettered task ids by the time they died;
  ``nodeagent:v1:deadby:<code>``       the same, by the error code they died with (the failures page's groups).
- ``nodeagent:v1:result:<id>``         the Result JSON, written once (SET NX), kept for the retention period.
- ``nodeagent:v1:idem:<key>``          the task id an idempotency key was first used for.
- ``nodeagent:v1:done:<queue>``        a counter of completed tasks.
- ``nodeagent:v1:log:<id>``             stream: a task's event log, for a gateway waiting on it (opened with a TTL;
                                       entries ``e`` = the event's JSON).
- ``nodeagent:v1:hist:<minute>``       hash: the fleet's history of that minute (``fleet/history.py``), numbers by
                                       field, kept NODEAGENT_HISTORY_DAYS (a TTL).
- ``nodeagent:v1:events``              stream: the fleet's event log (placements, evictions, operators' actions),
                                       capped at about EVENTS_KEPT entries; ``e`` = the event's JSON.
- ``nodeagent:v1:node:<id>``            hash: record (the NodeRecord's JSON), started_at and heartbeat_at (the
                                       server's time); the set ``nodeagent:v1:nodes`` lists the ids.

Time: every script takes "now" from the server (``TIME``): leases, claims, renewals, retries and their promotion,
completions, heartbeats. Python code reads the server's time through ``BrokerClock`` (``now()``), for what it
compares (due retries in the stats, the documents' leases, deadlines). No client's clock is ever compared.

Claiming is ``XAUTOCLAIM`` with min-idle = the lease (entries whose worker stopped renewing, first; the lease
is a fleet-wide setting, and an entry whose holder's own lease still runs is handed back to it untouched),
then ``XREADGROUP`` (new entries). The Lua scripts are the files of ``broker/lua/``. A renewal is ``XCLAIM ...
JUSTID``, which resets the entry's idle time, done in Lua only while the hash still names this lease's token.
Completion writes the result (SET NX), then XACK and XDEL and marks the hash, in one Lua script; so do retries
(into the delayed set) and dead letters.

Failover (``broker/redis_link.py``): the connection is to a standalone server or to the primary the Sentinels name,
and each operation is retried through a blip or a failover only where a second try cannot do harm:

- reads, renewals, heartbeats, registrations, event-log reads and purges repeat harmlessly: retried as they are;
- a finish (complete, retry, dead letter) writes the result once (SET NX) and moves only a task still in hand: a
  second try after a first that landed only acknowledges; a release checks its lease token;
- an enqueue whose first try may have landed finds the task there with its own envelope, and returns its id (an
  idempotency key returns the first id anyway); a cancel, a replay and a document's write or removal that find
  their own change done say so;
- a claim is retried with the same lease token: the claim scripts first look for a claim that token made (a
  marker kept for one lease), so a retry gets the task its first try claimed instead of a second;
- a progress event is retried: its ``seq`` lets a reader drop the copy;
- not retried: the blocking read that waits for a new task (an entry it delivered but whose reply was lost is
  claimed by any node once it has been idle a lease, with no attempt counted), the fleet's history counters
  (``HINCRBYFLOAT``: a second try would count twice; a lost minute's count is the cost) and the fleet's event log
  (an ``XADD``).

With NODEAGENT_REDIS_MIN_REPLICAS at 1 or more, every write the fleet reports as done (an enqueue, a finish, a
dead letter, a cancel, a replay, a batch's documents) is followed by ``WAIT`` on its connection, and fewer
replicas than asked is an error, never a silent success.
"""

from __future__ import annotations

from nodeagent.broker.base import purge_stores
from nodeagent.broker.redis.connection import (
    DEADSETS,
    GROUP,
    LOG_MAX_ENTRIES,
    PREFIX,
    SCRIPTS,
    STREAMS,
    TOLD_MAX_ENTRIES,
    RedisConnection,
)
from nodeagent.broker.redis.documents import RedisDocuments
from nodeagent.broker.redis.events import RedisEvents
from nodeagent.broker.redis.history import RedisHistory
from nodeagent.broker.redis.kv import RedisKeyValues
from nodeagent.broker.redis.logs import RedisLogs
from nodeagent.broker.redis.nodes import RedisNodes
from nodeagent.broker.redis.tasks import RedisTasks

__all__ = ["DEADSETS", "GROUP", "LOG_MAX_ENTRIES", "PREFIX", "SCRIPTS", "STREAMS", "TOLD_MAX_ENTRIES", "RedisBroker",
           "RedisConnection"]


class RedisBroker(RedisTasks, RedisLogs, RedisNodes, RedisHistory, RedisEvents, RedisDocuments, RedisKeyValues):
    """The Redis broker: each store (``broker/base.py``'s protocols) a file of this package, over one connection
    (``connection.py``: the link, the scripts, the server's time)."""

    blocks = True  # an idle claim waits on XREADGROUP BLOCK: a new task wakes a worker at once

    def purge(self, older_than_s: float) -> int:
        """Every store's retention in turn (``purge_stores``): on Redis only the dead-letter sets are trimmed
        (``purge_tasks``); everything else expires as it is written."""
        return purge_stores(self, older_than_s)
