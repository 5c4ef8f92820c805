"""The embedded broker: one SQLite database in WAL mode, shared by every worker process on the host.

Every state change is one short ``BEGIN IMMEDIATE`` transaction, so concurrent workers serialise on the
write lock and never claim the same task. A claim takes a ready task, a delayed task whose delay has passed,
or a leased task whose lease has expired (its worker died), and stamps a fresh lease token; renewals and
acknowledgements must present that token, so a worker that lost its lease cannot touch the task. The result
and the acknowledgement are written in one transaction.

Time (``nodeagent/clock.py``): leases, retry delays and heartbeat ages are measured on the host clock
(``CLOCK_BOOTTIME``, which no wall-clock step moves) with the boot they belong to: a lease of another boot has
expired, a delay of another boot has passed. The broker's time (``now``: deadlines, what is shown) is that clock
anchored to the wall clock once per boot, in the database, so every process of the host reads the same time
whatever its own wall clock says; a process that sees the wall clock step (NTP correcting a Pi at boot) moves the
anchor, and deadlines follow the corrected clock while leases do not move.
"""

from __future__ import annotations

from nodeagent.broker.base import purge_stores
from nodeagent.broker.sqlite import connection, documents, events, history, kv, logs, nodes, tasks
from nodeagent.broker.sqlite.connection import (
    ADDED_COLUMNS,
    ANCHOR_READ_S,
    MIGRATIONS,
    PURGE_ROWS,
    SCHEMA_VERSION,
    STEP_S,
    SqliteConnection,
)
from nodeagent.broker.sqlite.documents import SqliteDocuments
from nodeagent.broker.sqlite.events import SqliteEvents
from nodeagent.broker.sqlite.history import SqliteHistory
from nodeagent.broker.sqlite.kv import SqliteKeyValues
from nodeagent.broker.sqlite.logs import SqliteLogs
from nodeagent.broker.sqlite.nodes import SqliteNodes
from nodeagent.broker.sqlite.tasks import LEASE_EXPIRED, SqliteTasks

__all__ = ["ADDED_COLUMNS", "ANCHOR_READ_S", "LEASE_EXPIRED", "MIGRATIONS", "PURGE_ROWS", "SCHEMA", "SCHEMA_VERSION",
           "STEP_S", "SqliteBroker", "SqliteConnection"]

# the database's tables: each store's (in its file) and the connection's own
SCHEMA = "".join(m.SCHEMA for m in (tasks, nodes, connection, logs, history, events, kv, documents))


class SqliteBroker(SqliteTasks, SqliteLogs, SqliteNodes, SqliteHistory, SqliteEvents, SqliteDocuments,
                   SqliteKeyValues):
    """The SQLite broker: each store (``broker/base.py``'s protocols) a file of this package, over one connection
    (``connection.py``: the database, its transactions, the broker's time)."""

    blocks = False  # a claim never waits: idle workers poll (a cheap indexed SELECT)
    schema = SCHEMA

    def purge(self, older_than_s: float) -> int:
        """Every store's retention in turn (``purge_stores``): finished tasks and their results past the retention,
        event logs past their time, the records of nodes not heard from for the retention, expired values and
        documents, each found through an index by time, never by reading every row. Returns the tasks dropped."""
        return purge_stores(self, older_than_s)
