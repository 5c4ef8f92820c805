"""The SQLite engine's task queue: the tasks table (a row per task: its envelope, state, lease, attempts, history)
and the results table (a result per task, written once); claims, finishes, cancels and replays, each one
transaction; and its retention, the finished tasks and their results past it."""

from __future__ import annotations

import json
import sqlite3
import uuid
from typing import Any

from nodeagent.broker.base import (
    Attempt,
    Claim,
    DeadGroup,
    Demand,
    Envelope,
    QueueStats,
    TaskView,
    base_queue,
    error_result,
    frees_key,
    kept_from,
    parse_envelope,
    routes,
)
from nodeagent.broker.sqlite.connection import PURGE_ROWS, SqliteConnection, _chunks
from nodeagent.broker.sqlite.logs import append_event
from nodeagent.clock import host_clock
from nodeagent.errors import ConflictError
from nodeagent.tasks.contracts import ErrorInfo, Result
from nodeagent.tasks.events import Ended

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
DROP TABLE IF EXISTS depths;
CREATE INDEX IF NOT EXISTS tasks_dead ON tasks (json_extract(last_error, '$.code'), updated_at) WHERE state = 'dead';
CREATE INDEX IF NOT EXISTS tasks_finished ON tasks (updated_at) WHERE state IN ('done', 'dead', 'cancelled');
"""


class SqliteTasks(SqliteConnection):
    """The ``TaskQueue`` store on SQLite."""

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
        append_event(db, e.notify or e.id, Ended(state, e.id, claim.attempt, claim.node).to_wire())

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
                append_event(db, log_id, Ended("cancelled", task_id).to_wire())
        return cur.rowcount == 1

    def forget(self, task_id: str, after_s: float = 0.0) -> bool:
        """(Dropped now at 0; else marked, and the purge drops it once ``forget_at`` has passed.)"""
        with self._tx() as db:
            if after_s > 0:
                return bool(db.execute("UPDATE tasks SET forget_at=? WHERE id=? AND state IN ('done', 'dead', "
                                       "'cancelled') AND idempotency_key IS NULL",
                                       (self.now() + after_s, task_id)).rowcount)
            gone = db.execute("DELETE FROM tasks WHERE id=? AND state IN ('done', 'dead', 'cancelled') AND "
                              "idempotency_key IS NULL", (task_id,)).rowcount
            if gone:
                _drop_rows(db, [task_id])
        return bool(gone)

    def keep(self, task_ids: list[str], since: float) -> None:
        with self._tx() as db:
            db.executemany("UPDATE tasks SET kept_from = MAX(COALESCE(kept_from, 0), ?) WHERE id = ?",
                           [(since, i) for i in task_ids])

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

    def purge_tasks(self, older_than_s: float) -> int:
        """Drop finished tasks and their results past the retention: found through an index by time, a few hundred
        rows a transaction (the write lock is held briefly), never by reading every row. Returns the tasks
        dropped."""
        now = self.now()
        cutoff = now - older_than_s
        n = 0
        while True:
            with self._tx() as db:
                ids = [r[0] for r in db.execute(
                    "SELECT id FROM tasks WHERE state IN ('done', 'dead', 'cancelled') AND updated_at < ? "
                    "AND COALESCE(kept_from, 0) < ? ORDER BY updated_at LIMIT ?", (cutoff, cutoff, PURGE_ROWS))]
                # and those let go once their answer was delivered (``forget``), through their own index
                ids += [r[0] for r in db.execute("SELECT id FROM tasks WHERE forget_at IS NOT NULL AND forget_at < ? "
                                                 "LIMIT ?", (now, PURGE_ROWS))]
                db.executemany("DELETE FROM tasks WHERE id=?", [(i,) for i in ids])
                _drop_rows(db, ids)
            n += len(ids)
            if len(ids) < PURGE_ROWS:
                return n

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


def _model_clause(models: list[str] | None) -> str:
    """Tasks bound to no model, or to one of ``models`` (one ``?`` each)."""
    return "model IS NULL" + (f" OR model IN ({','.join('?' * len(models))})" if models else "")


def _drop_rows(db: Any, ids: list[str]) -> None:
    """The rows that go with dropped tasks: their results, and their event logs."""
    db.executemany("DELETE FROM results WHERE task_id=?", [(i,) for i in ids])
    db.executemany("DELETE FROM logs WHERE task_id=?", [(i,) for i in ids])
    db.executemany("DELETE FROM log_open WHERE task_id=?", [(i,) for i in ids])
