"""An operator's hand on the fleet, one API for the page and the CLI (as Sidekiq's ``api.rb`` under its web routes,
and rq's ``FailedJobRegistry.requeue``): hold a node (it claims nothing until resumed; what it runs finishes) and
pause a queue (no node claims from it until resumed; producers may still enqueue), kept as documents in the broker
so every node and every page see the same (a worker reads them at each heartbeat); replay dead letters (by code
and queue, page by page) or one task, cancel a task or a batch. Every action is written to the fleet's event log
with who took it."""

from __future__ import annotations

import logging
from typing import Any

from nodeagent.broker.base import Broker
from nodeagent.tasks.contracts import BATCH_SUFFIX
from nodeagent.values import Frozen

log = logging.getLogger(__name__)
CONTROL = "control"  # document kind
QUEUES = "queues"  # the document of paused queues
TRIES = 20


class Controls(Frozen):
    """What the operator asked of one node: queues nobody claims from, and its own hold."""

    paused_queues: frozenset[str] = frozenset()
    hold: str | None = None  # why the node claims nothing, as the operator's page wrote it

    def queues(self, queues: list[str]) -> list[str]:
        """``queues`` less the paused ones (a batch queue pauses with its queue)."""
        return [q for q in queues if q.removesuffix(BATCH_SUFFIX) not in self.paused_queues]


def _node_doc(node_id: str) -> str:
    return f"node:{node_id}"


def read_controls(broker: Broker, node_id: str) -> Controls:
    node = broker.doc_get(CONTROL, _node_doc(node_id))
    hold = node[0] if node and node[0].get("hold") else None
    return Controls(paused_queues=frozenset(paused_queues(broker)),
                    hold=(f"held by the operator ({hold.get('by', '?')})" if hold else None))


def paused_queues(broker: Broker) -> dict[str, dict[str, Any]]:
    got = broker.doc_get(CONTROL, QUEUES)
    return dict((got[0] if got else {}).get("paused", {}))


def _update(broker: Broker, doc_id: str, change: Any) -> None:
    """Write ``change(doc)`` over the version read, again if another writer came between."""
    for _ in range(TRIES):
        got = broker.doc_get(CONTROL, doc_id)
        data, version = got if got else ({}, None)
        new = change(dict(data))
        if broker.doc_put(CONTROL, doc_id, new, version=version):
            return
    raise RuntimeError(f"the control {doc_id} kept changing under this write: try again")


def hold_node(broker: Broker, node_id: str, hold: bool, by: str) -> None:
    now = broker.now()
    _update(broker, _node_doc(node_id), lambda d: {**d, "hold": hold, "by": by, "at": now})
    record_action(broker, "hold node" if hold else "resume node", node_id, by)


def pause_queue(broker: Broker, queue: str, pause: bool, by: str) -> None:
    now = broker.now()

    def change(d: dict[str, Any]) -> dict[str, Any]:
        paused = dict(d.get("paused", {}))
        if pause:
            paused[queue] = {"by": by, "at": now}
        else:
            paused.pop(queue, None)
        return {**d, "paused": paused}

    _update(broker, QUEUES, change)
    record_action(broker, "pause queue" if pause else "resume queue", queue, by)


def replay_task(broker: Broker, task_id: str, by: str) -> bool:
    """A dead letter back to its queue with fresh attempts (its history kept); False if it is not one."""
    ok = broker.replay(task_id)
    if ok:
        record_action(broker, "replay task", task_id, by)
    return ok


def cancel_task(broker: Broker, task_id: str, by: str) -> bool:
    """A task that waits or runs, cancelled; False if it does neither any more."""
    ok = broker.cancel(task_id)
    if ok:
        record_action(broker, "cancel task", task_id, by)
    return ok


def replay_dead(broker: Broker, by: str, code: str | None = None, queue: str | None = None,
                page: int = 500) -> list[str]:
    """Every dead letter (of ``queue``, whose last error has ``code``) back to its queue, page by page; the ids
    replayed. Recorded once, with the count."""
    done: list[str] = []
    while True:
        got = broker.dead(queue, limit=page, code=code)
        if not got:
            break
        replayed = [v.id for v in got if broker.replay(v.id)]
        done += replayed
        if not replayed:  # what is left cannot be replayed (it changed meanwhile): stop
            break
    record_action(broker, "replay dead letters", code or "all codes", by, tasks=len(done),
                  **({"queue": queue} if queue else {}))
    return done


def cancel_batch(broker: Broker, batch_id: str, by: str, batches: Any = None) -> dict[str, Any]:
    """A batch cancelled (its unstarted tasks are not run); its object. An unknown batch raises BatchError.
    ``batches``: the caller's Batches service on ``broker`` (its limits), else a default one."""
    from nodeagent.fleet.batches import Batches

    b = (batches or Batches(broker)).cancel(batch_id)
    record_action(broker, "cancel batch", batch_id, by)
    return b


def record_action(broker: Broker, action: str, target: str, by: str, **facts: Any) -> None:
    """An operator's action (a control, a replay, a cancel), on stderr and in the fleet's event log."""
    log.info("operator: %s %s (by %s)%s", action, target, by,
             "".join(f" {k}={v}" for k, v in facts.items()))
    broker.record_event({"kind": "control", "action": action, "target": target, "by": by, **facts})
