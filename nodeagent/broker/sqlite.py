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

import json
import logging
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable

from nodeagent.broker.base import (
    CONTRACT,
    EVENTS_KEPT,
    Attempt,
    Claim,
    DeadGroup,
    Demand,
    Envelope,
    NodeRecord,
    QueueStats,
    TaskView,
    base_queue,
    error_result,
    frees_key,
    kept_from,
    parse_envelope,
    routes,
)
from nodeagent.clock import host_clock, wall_synced
from nodeagent.errors import ConfigError, ConflictError
from nodeagent.tasks.contracts import ErrorInfo, Result
from nodeagent.tasks.events import Ended, Queued

log = logging.getLogger(__name__)
SCHEMA_VERSION = 2
# schema 1 -> 2: leases and retry delays on the host clock (leased_until in its seconds, due_host, boot), the
# heartbeat's host-clock stamp, and the anchor of the broker's time per boot
MIGRATIONS = {1: ("ALTER TABLE tasks ADD COLUMN due_host REAL", "ALTER TABLE tasks ADD COLUMN boot TEXT",
                  "ALTER TABLE nodes ADD COLUMN heartbeat_host REAL", "ALTER TABLE nodes ADD COLUMN boot TEXT")}
# columns added within a schema version: read by this code, ignored by an older one (added when missing, at open)
ADDED_COLUMNS = (("documents", "expires_at", "REAL"), ("kv", "bytes", "INTEGER"), ("tasks", "kept_from", "REAL"))
STEP_S = 2.0  # this process's wall clock moving this much against the host clock between two readings: a step
ANCHOR_READ_S = 2.0  # how often a process reads the anchor again (another may have moved it)
PURGE_ROWS = 500  # rows a purge's transaction drops at most (it repeats until none is left)
LEASE_EXPIRED = json.dumps({"code": "lease_expired", "retryable": True,
                            "message": "the worker stopped renewing its lease (crashed or lost)"})
SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
  id TEXT PRIMARY KEY,
  queue TEXT NOT NULL,
  model TEXT,
  idempotency_key TEXT UNIQUE,
  envelope TEXT NOT NULL,
  state TEXT NOT NULL,
  attempts INTEGER NOT NULL DEFAULT 0,
  max_attempts INTEGER NOT NULL,
  ready_at REAL NOT NULL,
  lease_token TEXT,
  leased_until REAL,
  due_host REAL,
  boot TEXT,
  node TEXT,
  deadline REAL,
  batch TEXT,
  idx INTEGER,
  created_at REAL NOT NULL,
  updated_at REAL NOT NULL,
  history TEXT NOT NULL DEFAULT '[]',
  last_error TEXT
);
CREATE INDEX IF NOT EXISTS tasks_ready ON tasks (queue, ready_at) WHERE state IN ('ready', 'delayed');
CREATE INDEX IF NOT EXISTS tasks_leased ON tasks (leased_until) WHERE state = 'leased';
CREATE INDEX IF NOT EXISTS tasks_state ON tasks (queue, state);
CREATE TABLE IF NOT EXISTS results (
  task_id TEXT PRIMARY KEY,
  result TEXT NOT NULL,
  created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS nodes (
  id TEXT PRIMARY KEY,
  record TEXT NOT NULL,
  heartbeat_at REAL NOT NULL,
  heartbeat_host REAL,
  boot TEXT
);
CREATE TABLE IF NOT EXISTS clock (boot TEXT PRIMARY KEY, anchor REAL NOT NULL, synced INTEGER, set_at REAL);
CREATE TABLE IF NOT EXISTS log_open (task_id TEXT PRIMARY KEY, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS logs (seq INTEGER PRIMARY KEY AUTOINCREMENT, task_id TEXT NOT NULL, event TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS logs_task ON logs (task_id, seq);
DROP TABLE IF EXISTS depths;
CREATE INDEX IF NOT EXISTS tasks_dead ON tasks (json_extract(last_error, '$.code'), updated_at) WHERE state = 'dead';
CREATE TABLE IF NOT EXISTS history (minute INTEGER NOT NULL, field TEXT NOT NULL, value REAL NOT NULL,
                                    PRIMARY KEY (minute, field)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, event TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL, expires_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS tasks_finished ON tasks (updated_at) WHERE state IN ('done', 'dead', 'cancelled');
CREATE INDEX IF NOT EXISTS log_open_expiry ON log_open (expires_at);
CREATE INDEX IF NOT EXISTS kv_expiry ON kv (expires_at);
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


class SqliteBroker:
    blocks = False  # a claim never waits: idle workers poll (a cheap indexed SELECT)

    def __init__(self, path: Path, busy_timeout_s: float = 30.0, wall: Callable[[], float] = time.time) -> None:
        """``wall``: this process's wall clock (injected by the clock tests), which only anchors the broker's time."""
        self.path = Path(path)
        self.wall = wall
        self.url = f"sqlite://{self.path}"
        self._busy_ms = int(busy_timeout_s * 1000)
        self._local = threading.local()
        self._clock_lock = threading.Lock()
        self._anchor: tuple[float, float] | None = None  # (the anchor, host clock when read)
        self._purged_minute: int | None = None  # the history's old minutes went at this minute
        self._mine: float | None = None  # this process's wall clock less the host clock, last seen
        try:
            from nodeagent.private import private_file

            # every task's input and result: the owner's only (SQLite gives the -wal and -shm files the database
            # file's mode); a folder made for it is the owner's too (the state directory: ``open_broker``)
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            for suffix in ("", "-wal", "-shm"):
                if suffix == "" or self.path.with_name(self.path.name + suffix).exists():
                    private_file(self.path.with_name(self.path.name + suffix))
            self._db().executescript(SCHEMA)  # idempotent (IF NOT EXISTS); executescript commits on its own
            for table, column, kind in ADDED_COLUMNS:
                if column not in {r[1] for r in self._db().execute(f"PRAGMA table_info({table})")}:
                    try:
                        self._db().execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                    except sqlite3.OperationalError as exc:  # another process added it first
                        if "duplicate column" not in str(exc):
                            raise
            self._db().execute("CREATE INDEX IF NOT EXISTS documents_expiry ON documents (expires_at) WHERE "
                               "expires_at IS NOT NULL")
            with self._tx() as db:
                row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                if row is None:
                    db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                elif int(row[0]) in MIGRATIONS:
                    for statement in MIGRATIONS[int(row[0])]:
                        db.execute(statement)
                    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
                elif int(row[0]) != SCHEMA_VERSION:
                    raise ConfigError(f"{self.path} holds queue schema {row[0]}, this nodeagent speaks "
                                      f"{SCHEMA_VERSION}", hint="use another NODEAGENT_HOME, or the matching version")
            self.now()  # the first process of this boot to open the queue anchors its time
        except sqlite3.Error as exc:
            raise ConfigError(f"cannot open the queue database {self.path}: {exc}",
                              hint="check NODEAGENT_HOME and its permissions") from None

    # -- connections: one per thread (the worker's lease and heartbeat threads have their own) ---------------
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=self._busy_ms / 1000, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never corrupt
            db.execute(f"PRAGMA busy_timeout={self._busy_ms}")
            db.row_factory = sqlite3.Row
            db.text_factory = _text  # text written by hand that is not UTF-8 must not fail the claim reading it
            self._local.db = db
        return db

    class _Tx:
        def __init__(self, db: sqlite3.Connection) -> None:
            self.db = db

        def __enter__(self) -> sqlite3.Connection:
            self.db.execute("BEGIN IMMEDIATE")
            return self.db

        def __exit__(self, exc_type: Any, *rest: Any) -> None:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")

    def _tx(self) -> "SqliteBroker._Tx":
        return SqliteBroker._Tx(self._db())

    # -- time ----------------------------------------------------------------------------------------------
    def now(self) -> float:
        """The broker's time: the host clock plus this boot's anchor (the same in every process of the host)."""
        return self._times()[0]

    def _times(self) -> tuple[float, str, float]:
        """(the broker's time, this boot, the host clock), read together."""
        boot, host = host_clock()
        mine = self.wall() - host
        anchor = self._anchor
        stepped = self._mine is not None and abs(mine - self._mine) > STEP_S
        if anchor is None or stepped or host - anchor[1] > ANCHOR_READ_S:
            anchor = self._read_anchor(boot, host, mine, stepped)
        self._mine = mine
        return anchor[0] + host, boot, host

    def _read_anchor(self, boot: str, host: float, mine: float, stepped: bool) -> tuple[float, float]:
        """This boot's anchor; set by the first process of the boot, moved by one that saw the wall clock step (or
        whose clock is synchronised where the anchor's was not). A read, unless it must be written."""
        with self._clock_lock:
            row = self._db().execute("SELECT anchor, synced FROM clock WHERE boot=?", (boot,)).fetchone()
            off = row is None or abs(float(row["anchor"]) - mine) > STEP_S
            synced = wall_synced() if off else None
            if row is None or (off and (stepped or (synced and not row["synced"]))):
                with self._tx() as db:
                    if row is not None:
                        log.warning("the wall clock %s by %+.1f s: the queue's time follows it (deadlines are "
                                    "wall-clock instants; leases and retry delays are on the host clock and do not "
                                    "move)", "stepped" if stepped else "is synchronised now, off the queue's",
                                    mine - float(row["anchor"]))
                    db.execute("INSERT OR REPLACE INTO clock VALUES (?,?,?,?)", (boot, mine, int(bool(synced)),
                                                                                 time.time()))
                value = mine
            else:
                value = float(row["anchor"])
            self._anchor = (value, host)
            return self._anchor

    # -- tasks ---------------------------------------------------------------------------------------------
    def enqueue(self, envelope: Envelope) -> str:
        e = envelope
        now = self.now()
        with self._tx() as db:
            if e.idempotency_key:
                row = db.execute("SELECT id FROM tasks WHERE idempotency_key = ?", (e.idempotency_key,)).fetchone()
                if row:
                    return str(row["id"])
            if db.execute("SELECT 1 FROM tasks WHERE id = ?", (e.id,)).fetchone():
                raise ConflictError(f"task {e.id} is already in the queue",
                                    hint="give the task a new id, or an idempotency key to return the first")
            # the queue column is the task's route: a node reads the routes its contract knows (``routes``)
            db.execute("INSERT INTO tasks (id, queue, model, idempotency_key, envelope, state, max_attempts, ready_at,"
                       " deadline, batch, idx, created_at, updated_at) VALUES (?,?,?,?,?,'ready',?,?,?,?,?,?,?)",
                       (e.id, e.route, e.model, e.idempotency_key, e.model_dump_json(), e.max_attempts,
                        now, e.deadline, e.batch, e.index, e.created_at, now))
        return e.id

    def claim(self, queues: list[str], node: str, lease_s: float, models: list[str] | None = None,
              wait_s: float = 0.0) -> Claim | None:
        now, boot, host = self._times()
        queues = routes(queues)
        marks = ",".join("?" * len(queues))
        model_clause = _model_clause(models)
        token = uuid.uuid4().hex
        attempt = json.dumps({"node": node, "started_at": now})
        # one statement: take the oldest claimable task, count the attempt, open it in the history (closing the
        # previous one as lease_expired when its holder died mid-task)
        with self._tx() as db:
            row = db.execute(
                "UPDATE tasks SET state='leased', attempts=attempts+1, lease_token=?, leased_until=?, boot=?, "
                "due_host=NULL, node=?, updated_at=?, history=json_insert(CASE WHEN state='leased' AND "
                "json_array_length(history) > 0 THEN json_set(history, '$[#-1].ended_at', ?, '$[#-1].error', json(?)) "
                "ELSE history END, '$[#]', json_set(json(?), '$.attempt', attempts+1)) "
                # expired leases first (their tasks are the oldest), then the oldest ready task; each lookup
                # walks a partial index of claimable rows only, however many finished tasks the table holds. A
                # lease or a delay stamped in another boot has run out.
                f"WHERE id = COALESCE((SELECT id FROM tasks WHERE state = 'leased' AND (boot IS NOT ? OR "
                f"leased_until <= ?) AND queue IN ({marks}) AND ({model_clause}) ORDER BY leased_until LIMIT 1), "
                f"(SELECT id FROM tasks WHERE state IN ('ready', 'delayed') AND queue IN ({marks}) AND "
                f"({model_clause}) AND {_DUE} ORDER BY ready_at LIMIT 1)) "
                "RETURNING id, queue, attempts, envelope",
                (token, host + lease_s, boot, node, now, now, LEASE_EXPIRED, attempt, boot, host, *queues,
                 *(models or []), *queues, *(models or []), boot, host)).fetchone()
        if row is None:
            return None
        envelope = parse_envelope(row["envelope"], row["id"], row["queue"])
        return Claim(envelope=envelope, token=token, attempt=int(row["attempts"]), leased_until=now + lease_s,
                     node=node)

    def renew(self, claim: Claim, lease_s: float) -> bool:
        now, boot, host = self._times()
        with self._tx() as db:
            cur = db.execute("UPDATE tasks SET leased_until=?, boot=?, updated_at=? WHERE id=? AND lease_token=? AND "
                             "state='leased'", (host + lease_s, boot, now, claim.envelope.id, claim.token))
        return cur.rowcount == 1

    def complete(self, claim: Claim, result: Result) -> bool:
        """Whether this call wrote the result (only the claim holding the task finishes it)."""
        now = self.now()
        with self._tx() as db:
            return self._end(db, claim, "done", None, now) and db.execute(
                "INSERT OR IGNORE INTO results VALUES (?,?,?)",
                (claim.envelope.id, result.model_dump_json(), now)).rowcount == 1

    def retry(self, claim: Claim, error: ErrorInfo, delay_s: float) -> None:
        now, boot, host = self._times()
        with self._tx() as db:
            self._end(db, claim, "delayed", error, now, ready_at=now + delay_s, due=(boot, host + delay_s))

    def bury(self, claim: Claim, error: ErrorInfo) -> None:
        now = self.now()
        with self._tx() as db:
            if self._end(db, claim, "dead", error, now):
                db.execute("INSERT OR IGNORE INTO results VALUES (?,?,?)", (
                    claim.envelope.id, error_result(claim.envelope, error, claim.attempt).model_dump_json(), now))

    def release(self, claim: Claim, delay_s: float = 0.0) -> None:
        """Give a task back unrun, and the attempt does not count: ready now (a draining worker's), or after
        ``delay_s`` (a task given back for a newer node)."""
        now, boot, host = self._times()
        with self._tx() as db:
            row = db.execute("SELECT history FROM tasks WHERE id=? AND lease_token=?",
                             (claim.envelope.id, claim.token)).fetchone()
            if row is None:
                return
            history = json.loads(row["history"])[:-1]
            state, due = ("delayed", host + delay_s) if delay_s > 0 else ("ready", None)
            db.execute("UPDATE tasks SET state=?, attempts=attempts-1, lease_token=NULL, leased_until=NULL, "
                       "node=NULL, ready_at=?, due_host=?, boot=?, history=?, updated_at=? WHERE id=?",
                       (state, now + delay_s, due, boot if due is not None else None, json.dumps(history), now,
                        claim.envelope.id))

    def _end(self, db: sqlite3.Connection, claim: Claim, state: str, error: ErrorInfo | None, now: float,
             ready_at: float | None = None, due: tuple[str, float] | None = None) -> bool:
        """Move the task on, if ``claim`` still holds it (its token: an attempt cut off past its lease, or whose task
        was cancelled or given back, writes nothing). Its attempt is the last in the history. ``due``: (boot, host
        clock) when a delayed task may run again. Whether it moved."""
        err = error.model_dump_json() if error else None
        boot, due_host = due if due is not None else (None, None)
        if not db.execute("UPDATE tasks SET state=?, lease_token=NULL, leased_until=NULL, ready_at=COALESCE(?, "
                          "ready_at), due_host=?, boot=?, history=json_set(history, '$[#-1].ended_at', ?, "
                          "'$[#-1].error', json(?)), last_error=COALESCE(?, last_error), updated_at=?, kept_from=?, "
                          "idempotency_key=CASE WHEN ? THEN NULL ELSE idempotency_key END "
                          "WHERE id=? AND lease_token=? AND state='leased'",
                          (state, ready_at, due_host, boot, now, err, err, now, kept_from(claim.envelope),
                           int(frees_key(state, error)), claim.envelope.id, claim.token)).rowcount:
            return False
        self._finished(db, claim, state)
        return True

    def _finished(self, db: sqlite3.Connection, claim: Claim, state: str) -> None:
        """How the task ended, to its log (or the log it tells: a gateway's), in the step that ends it."""
        e = claim.envelope
        self._append(db, e.notify or e.id, Ended(state, e.id, claim.attempt, claim.node).to_wire())

    def get(self, task_id: str) -> TaskView | None:
        row = self._db().execute("SELECT * FROM tasks WHERE id=?", (task_id,)).fetchone()
        return None if row is None else self._view(row)

    def result(self, task_id: str) -> Result | None:
        row = self._db().execute("SELECT result FROM results WHERE task_id=?", (task_id,)).fetchone()
        return None if row is None else Result.model_validate_json(row["result"])

    def cancel(self, task_id: str, free_key: bool = False) -> bool:
        """``free_key``: the task's idempotency key names no task from now on (a gateway's own verdict: a retry with
        the key runs the work again)."""
        now = self.now()
        with self._tx() as db:
            cur = db.execute("UPDATE tasks SET state='cancelled', lease_token=NULL, updated_at=?, idempotency_key="
                             "CASE WHEN ? THEN NULL ELSE idempotency_key END WHERE id=? AND "
                             "state IN ('ready', 'delayed', 'leased')", (now, int(free_key), task_id))
            if cur.rowcount:
                row = db.execute("SELECT json_extract(envelope, '$.notify') FROM tasks WHERE id=?",
                                 (task_id,)).fetchone()
                log_id = row[0] if row and row[0] else task_id
                self._append(db, log_id, Ended("cancelled", task_id).to_wire())
        return cur.rowcount == 1

    def forget(self, task_id: str) -> bool:
        with self._tx() as db:
            gone = db.execute("DELETE FROM tasks WHERE id=? AND state IN ('done', 'dead', 'cancelled') AND "
                              "idempotency_key IS NULL", (task_id,)).rowcount
            if gone:
                db.execute("DELETE FROM results WHERE task_id=?", (task_id,))
                db.execute("DELETE FROM logs WHERE task_id=?", (task_id,))
                db.execute("DELETE FROM log_open WHERE task_id=?", (task_id,))
        return bool(gone)

    def keep(self, task_ids: list[str], since: float) -> None:
        with self._tx() as db:
            db.executemany("UPDATE tasks SET kept_from = MAX(COALESCE(kept_from, 0), ?) WHERE id = ?",
                           [(since, i) for i in task_ids])

    # -- event logs (a gateway waiting on its tasks) ------------------------------------------------------
    def open_log(self, task_id: str, ttl_s: float) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO log_open VALUES (?, ?)", (task_id, self.now() + ttl_s))
            db.execute("INSERT INTO logs (task_id, event) VALUES (?, ?)",
                       (task_id, json.dumps({**Queued().to_wire(), "contract": CONTRACT})))

    def publish(self, task_id: str, event: dict[str, Any], keep: int = 0) -> None:
        with self._tx() as db:
            self._append(db, task_id, event)

    @staticmethod
    def _append(db: sqlite3.Connection, task_id: str, event: dict[str, Any]) -> None:
        db.execute("INSERT INTO logs (task_id, event) SELECT ?, ? WHERE EXISTS (SELECT 1 FROM log_open WHERE "
                   "task_id = ?)", (task_id, json.dumps({**event, "contract": CONTRACT}), task_id))

    def read_logs(self, cursors: dict[str, str], wait_s: float = 0.0) -> list[tuple[str, str, dict[str, Any]]]:
        out = []
        for chunk in _chunks(list(cursors)):
            since = min(int(cursors[t]) for t in chunk)
            rows = self._db().execute(f"SELECT seq, task_id, event FROM logs WHERE seq > ? AND task_id IN "
                                      f"({','.join('?' * len(chunk))}) ORDER BY seq", (since, *chunk)).fetchall()
            out += [(r["task_id"], str(r["seq"]), json.loads(r["event"])) for r in rows
                    if r["seq"] > int(cursors[r["task_id"]])]
        return out

    def trim_log(self, task_id: str, cursor: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM logs WHERE task_id=? AND seq <= ?", (task_id, int(cursor)))

    def dead(self, queue: str | None = None, limit: int = 100, offset: int = 0, code: str | None = None
             ) -> list[TaskView]:
        sql, args = "SELECT * FROM tasks WHERE state='dead'", []
        if queue:
            queues = routes([queue])
            sql, args = sql + f" AND queue IN ({','.join('?' * len(queues))})", queues
        if code:
            sql, args = sql + f" AND {_CODE}=?", [*args, code]
        rows = self._db().execute(sql + " ORDER BY updated_at LIMIT ? OFFSET ?", (*args, limit, offset)).fetchall()
        return [self._view(r) for r in rows]

    def dead_codes(self) -> list[DeadGroup]:
        db = self._db()
        groups = db.execute(f"SELECT {_CODE} AS code, COUNT(*) AS n FROM tasks WHERE state='dead' GROUP BY code "
                            "ORDER BY n DESC, code").fetchall()
        out = []
        for g in groups:
            row = db.execute(f"SELECT id, queue, last_error FROM tasks WHERE state='dead' AND {_CODE} IS ? "
                             "ORDER BY updated_at DESC LIMIT 1", (g["code"],)).fetchone()
            message = json.loads(row["last_error"]).get("message", "") if row and row["last_error"] else ""
            out.append(DeadGroup(code=g["code"] or "unknown", count=g["n"],
                                 sample={"id": row["id"], "queue": base_queue(row["queue"]), "message": message[:300]}
                                 if row else {}))
        return out

    def replay(self, task_id: str) -> bool:
        """A dead task goes back to its queue with fresh attempts; its history is kept."""
        now = self.now()
        with self._tx() as db:
            cur = db.execute("UPDATE tasks SET state='ready', attempts=0, ready_at=?, updated_at=? WHERE id=? AND "
                             "state='dead'", (now, now, task_id))
            if cur.rowcount:
                db.execute("DELETE FROM results WHERE task_id=?", (task_id,))
        return cur.rowcount == 1

    def stats(self) -> list[QueueStats]:
        """Counts by state from the (queue, state) index; the delayed tasks that are due, and the oldest ready
        one, from the ready index (a queue of 100,000 finished tasks costs a count, not a scan of them)."""
        boot, host = host_clock()
        db = self._db()
        counts: dict[str, dict[str, int]] = {}  # a queue's routes (extract.v1~1.2) count as the queue
        for r in db.execute("SELECT queue, state, COUNT(*) AS n FROM tasks GROUP BY queue, state"):
            c = counts.setdefault(base_queue(r["queue"]), {})
            c[r["state"]] = c.get(r["state"], 0) + r["n"]
        due: dict[str, tuple[int, float | None]] = {}
        for r in db.execute(f"SELECT queue, COUNT(*) AS n, MIN(ready_at) AS oldest FROM tasks WHERE state='delayed' "
                            f"AND {_DUE} GROUP BY queue", (boot, host)):
            n, at = due.get(base_queue(r["queue"]), (0, None))
            due[base_queue(r["queue"])] = (n + r["n"], min(t for t in (at, r["oldest"]) if t is not None))
        oldest: dict[str, float] = {}
        for r in db.execute("SELECT queue, MIN(ready_at) AS oldest FROM tasks WHERE state='ready' GROUP BY queue"):
            q = base_queue(r["queue"])
            oldest[q] = min(oldest.get(q, r["oldest"]), r["oldest"])
        out = []
        for queue, c in sorted(counts.items()):
            n_due, due_at = due.get(queue, (0, None))
            firsts = [t for t in (oldest.get(queue), due_at) if t is not None]
            out.append(QueueStats(queue=queue, ready=c.get("ready", 0) + n_due, leased=c.get("leased", 0),
                                  delayed=c.get("delayed", 0) - n_due, dead=c.get("dead", 0), done=c.get("done", 0),
                                  oldest_ready_at=min(firsts) if firsts else None))
        return out

    def demand(self) -> list[Demand]:
        boot, host = host_clock()
        rows = self._db().execute(
            f"SELECT queue, model, SUM(state='ready' OR (state='delayed' AND {_DUE})) AS ready,"
            f" SUM(state='leased') AS leased, SUM(state='delayed' AND NOT {_DUE}) AS delayed, COUNT(*) AS n"
            " FROM tasks GROUP BY queue, model ORDER BY queue, model", (boot, host, boot, host)).fetchall()
        merged: dict[tuple[str, str | None], dict[str, int]] = {}  # a queue's routes count as the queue
        for r in rows:
            m = merged.setdefault((base_queue(r["queue"]), r["model"]),
                                  {"ready": 0, "leased": 0, "delayed": 0, "enqueued": 0})
            for k, v in (("ready", r["ready"]), ("leased", r["leased"]), ("delayed", r["delayed"]),
                         ("enqueued", r["n"])):
                m[k] += v or 0
        return [Demand(queue=q, model=m, **v) for (q, m), v in sorted(merged.items(), key=lambda kv: (kv[0][0],
                                                                                                     kv[0][1] or ""))]

    def outstanding(self, queues: list[str], models: list[str] | None = None) -> int:
        queues = routes(queues)
        marks = ",".join("?" * len(queues))
        model_clause = _model_clause(models)
        row = self._db().execute(f"SELECT COUNT(*) FROM tasks WHERE queue IN ({marks}) AND ({model_clause}) AND "
                                 "state IN ('ready', 'leased', 'delayed')", (*queues, *(models or []))).fetchone()
        return int(row[0])

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

    def purge(self, older_than_s: float) -> int:
        """Drop finished tasks and their results past the retention, event logs past their time, and the records of
        nodes not heard from for the retention: each found through an index by time, a few hundred rows a
        transaction (the write lock is held briefly), never by reading every row. Returns the tasks dropped."""
        now = self.now()
        cutoff = now - older_than_s
        n = 0
        while True:
            with self._tx() as db:
                ids = [r[0] for r in db.execute(
                    "SELECT id FROM tasks WHERE state IN ('done', 'dead', 'cancelled') AND updated_at < ? "
                    "AND COALESCE(kept_from, 0) < ? ORDER BY updated_at LIMIT ?", (cutoff, cutoff, PURGE_ROWS))]
                db.executemany("DELETE FROM results WHERE task_id=?", [(i,) for i in ids])
                db.executemany("DELETE FROM tasks WHERE id=?", [(i,) for i in ids])
                gone = [r[0] for r in db.execute("SELECT task_id FROM log_open WHERE expires_at < ? LIMIT ?",
                                                 (now, PURGE_ROWS))]
                db.executemany("DELETE FROM logs WHERE task_id=?", [(i,) for i in gone])
                db.executemany("DELETE FROM log_open WHERE task_id=?", [(i,) for i in gone])
                db.execute("DELETE FROM kv WHERE expires_at <= ?", (now,))
                db.execute("DELETE FROM nodes WHERE heartbeat_at < ?", (cutoff,))
                db.execute("DELETE FROM documents WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))
            n += len(ids)
            if len(ids) < PURGE_ROWS and len(gone) < PURGE_ROWS:
                return n

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

    def record_event(self, event: dict[str, Any]) -> None:
        now = self.now()
        with self._tx() as db:
            cur = db.execute("INSERT INTO events (at, event) VALUES (?, ?)",
                             (now, json.dumps({**event, "at": now, "contract": CONTRACT})))
            db.execute("DELETE FROM events WHERE seq <= ?", (cur.lastrowid - EVENTS_KEPT,))

    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        rows = self._db().execute("SELECT event FROM events ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
        return [json.loads(r["event"]) for r in rows]

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

    def settings(self) -> dict[str, Any]:
        import shutil

        db = self._db()
        out: dict[str, Any] = {"engine": "sqlite", "url": self.url, "path": str(self.path),
                               "journal_mode": db.execute("PRAGMA journal_mode").fetchone()[0],
                               "synchronous": db.execute("PRAGMA synchronous").fetchone()[0]}
        try:
            usage = shutil.disk_usage(self.path.parent)
            out.update(disk_free_bytes=usage.free, disk_total_bytes=usage.total)
        except OSError:
            pass
        try:
            out["size_bytes"] = sum(p.stat().st_size for p in self.path.parent.glob(self.path.name + "*"))
        except OSError:
            pass
        return out

    def hurry(self) -> None:
        """Nothing to hurry: a local file has no outage to ride out."""

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    # -- bulk reads (a batch's progress and its output) ---------------------------------------------------
    def states(self, task_ids: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for chunk in _chunks(task_ids):
            rows = self._db().execute(f"SELECT id, state FROM tasks WHERE id IN ({','.join('?' * len(chunk))})",
                                      chunk).fetchall()
            out.update({r["id"]: r["state"] for r in rows})
        return out

    def results(self, task_ids: list[str]) -> dict[str, Result]:
        out: dict[str, Result] = {}
        for chunk in _chunks(task_ids):
            rows = self._db().execute(f"SELECT task_id, result FROM results WHERE task_id IN "
                                      f"({','.join('?' * len(chunk))})", chunk).fetchall()
            out.update({r["task_id"]: Result.model_validate_json(r["result"]) for r in rows})
        return out

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

    # -- helpers --------------------------------------------------------------------------------------------
    def _view(self, row: sqlite3.Row) -> TaskView:
        leased_until = None
        if row["state"] == "leased" and row["leased_until"] is not None:  # on the broker's time, for people
            now, boot, host = self._times()
            leased_until = now + (row["leased_until"] - host) if row["boot"] == boot else now
        return TaskView(id=row["id"], queue=base_queue(row["queue"]), state=row["state"], attempts=row["attempts"],
                        max_attempts=row["max_attempts"], model=row["model"], batch=row["batch"], index=row["idx"],
                        ready_at=row["ready_at"], leased_until=leased_until, node=row["node"],
                        history=[Attempt.model_validate(h) for h in json.loads(row["history"])],
                        last_error=ErrorInfo.model_validate_json(row["last_error"]) if row["last_error"] else None,
                        result=self.result(row["id"]), created_at=row["created_at"], input=_task_of(row["envelope"]))


# a delayed task may run again: its delay, on the host clock, has passed, or was stamped in another boot (two
# parameters: this boot, the host clock)
_DUE = "(state = 'ready' OR boot IS NOT ? OR due_host IS NULL OR due_host <= ?)"


# a document not past its expiry (one parameter: the broker's time)
_KEPT = "(expires_at IS NULL OR expires_at > ?)"


# a dead letter's error code (the expression the dead-letter index is built on)
_CODE = "json_extract(last_error, '$.code')"


def _task_of(envelope: str | None) -> dict[str, Any] | None:
    """The task an envelope carries, for people (None when it is not readable JSON, or nested past what Python's
    parser takes: a poison payload is shown as unreadable, never raised)."""
    try:
        task = json.loads(envelope or "").get("task")
    except (ValueError, AttributeError, RecursionError):
        return None
    return task if isinstance(task, dict) else None


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _model_clause(models: list[str] | None) -> str:
    """Tasks bound to no model, or to one of ``models`` (one ``?`` each)."""
    return "model IS NULL" + (f" OR model IN ({','.join('?' * len(models))})" if models else "")


def _chunks(items: list[str], size: int = 500) -> list[list[str]]:
    """At most ``size`` ids a statement (SQLite bounds a statement's parameters)."""
    return [items[i:i + size] for i in range(0, len(items), size)]
