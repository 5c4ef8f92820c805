"""A generated fleet in a SQLite queue, for the operator's page at scale: N node records (through the broker, as
nodes register), M tasks in every state with attempt histories and dead letters under several codes (written in
bulk into the queue's tables, as the broker would have left them), and an hour of history. Used by
tests/test_ui.py and benchmarks/ui_render.py."""

from __future__ import annotations

import json
import random
import sqlite3
import time
from pathlib import Path

from nodeagent.broker.base import NodeRecord
from nodeagent.broker.sqlite import SqliteBroker
from nodeagent.fleet.history import bucket_of, minute_of

QUEUES = ("classify.v1", "extract.v1")
CODES = ("invalid_output", "timeout", "backend_error", "deadline_exceeded", "invalid_task")
STATES = (("done", 0.6), ("ready", 0.15), ("leased", 0.05), ("delayed", 0.05), ("dead", 0.15))


def generate(path: Path, nodes: int, tasks: int, seed: int = 7) -> SqliteBroker:
    rng = random.Random(seed)
    broker = SqliteBroker(path)
    now = broker.now()
    for i in range(nodes):
        broker.register(NodeRecord(
            id=f"node-{i:04d}", hostname=f"host-{i:04d}", agent_version="0.1", os="linux", arch="aarch64",
            chip="Raspberry Pi 5 Model B", ram_total_bytes=8 << 30, ram_available_bytes=(3 + i % 4) << 30,
            backend="llamacpp", model="smollm2", models=["smollm2"], planned_bytes=(1 + i % 3) << 30, slots=2,
            task_types=list(QUEUES), state="ready", heartbeat_s=3600.0,  # none turns lost while measured
            guard_status={"state": "ok", "reason": "", "temperature_c": 50.0 + i % 30},
            model_set=[{"model": "smollm2", "loaded": True, "pinned": True, "in_use": i % 2, "slots": 2,
                        "planned_bytes": (1 + i % 3) << 30}]))
    db = sqlite3.connect(path)
    rows = []
    for i in range(tasks):
        queue = QUEUES[i % len(QUEUES)]
        state = rng.choices([s for s, _ in STATES], [w for _, w in STATES])[0]
        task_id = f"t{i:07d}"
        created = now - rng.uniform(0, 3600)
        attempts = 0 if state == "ready" else rng.randint(1, 3)
        history = [{"attempt": a + 1, "node": f"node-{rng.randrange(nodes):04d}", "started_at": created + a,
                    "ended_at": created + a + 0.5,
                    "error": {"code": rng.choice(CODES), "message": "generated", "retryable": True}
                    if (state == "dead" or a + 1 < attempts) else None} for a in range(attempts)]
        error = history[-1]["error"] if state == "dead" and history else None
        envelope = {"id": task_id, "queue": queue, "task": {"type": queue, "id": task_id,
                                                            "input": f"text {i}", "labels": ["a", "b"]},
                    "max_attempts": 3, "created_at": created}
        rows.append((task_id, queue, None, None, json.dumps(envelope), state, attempts, 3, created,
                     None, now + 60 if state == "leased" else None, None, None,
                     history[-1]["node"] if history else None, None, None, None, created, created + 1,
                     json.dumps(history), json.dumps(error) if error else None))
    db.executemany("INSERT INTO tasks (id, queue, model, idempotency_key, envelope, state, attempts, max_attempts, "
                   "ready_at, lease_token, leased_until, due_host, boot, node, deadline, batch, idx, created_at, "
                   "updated_at, history, last_error) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    db.commit()
    db.close()
    last = minute_of(now)
    for m in range(last - 59, last + 1):  # an hour of history, as the workers' heartbeats leave it
        counts = {}
        for q in QUEUES:
            counts[f"t|{q}|ok"] = rng.randint(50, 80)
            counts[f"t|{q}|retry"] = rng.randint(0, 5)
            counts[f"w|{q}|{bucket_of(rng.uniform(0.1, 5))}"] = 20
            counts[f"r|{q}|{bucket_of(rng.uniform(0.2, 2))}"] = 20
        for n in range(nodes):
            counts[f"n|node-{n:04d}|ok"] = rng.randint(0, 2)
        broker.history_add(m, counts, keep_s=7 * 86400)
        broker.history_set(m, {f"d|{q}|ready": rng.randint(100, 200) for q in QUEUES}, keep_s=7 * 86400)
    return broker


if __name__ == "__main__":
    import sys

    started = time.perf_counter()
    generate(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    print(f"generated in {time.perf_counter() - started:.1f} s")
