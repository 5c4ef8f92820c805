"""An operator's hand on the fleet: hold a node (it claims nothing until resumed; what it runs finishes) and pause
a queue (no node claims from it until resumed; producers may still enqueue). Kept as documents in the broker, so
every node and every page see the same; a worker reads them at each heartbeat. Every change is written to the
fleet's event log with who made it."""

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


def record_action(broker: Broker, action: str, target: str, by: str, **facts: Any) -> None:
    """An operator's action (a control, a replay, a cancel), on stderr and in the fleet's event log."""
    log.info("operator: %s %s (by %s)%s", action, target, by,
             "".join(f" {k}={v}" for k, v in facts.items()))
    broker.record_event({"kind": "control", "action": action, "target": target, "by": by, **facts})
