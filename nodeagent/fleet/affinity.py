"""Warm affinity: a task goes to the node that holds its prompt's prefix warm, unless that makes it wait too long.

The prompt of a stream of tasks starts the same way (an extraction's instructions and schema, a classification's
labels and examples, an agent's system prompt and tools), and a node that read it keeps its state in a slot or on
its disk (``backends/prefix_store.py``): there the next such task skips that prefill, which on a Pi is most of a
task's time. So a task has a **prefix key**, the same on every node and every version that knows it: a hash of
what its prompt starts with (``prefix_key``). Each node keeps the keys of the tasks it ran last (``WarmKeys``) and
says them at each heartbeat (``NodeRecord.warm``).

A node that claims a task whose key it does not hold, while another node serving now holds it, gives the task back
(``leave_to``), at once and uncounted, for that node to take: but only while the task is younger than the bound
(NODEAGENT_PREFER_WARM_S; 0: no preference). Past it, whoever claims it runs it (and then holds its key too). So no
task waits for a warm node longer than the bound: a warm node that is busy holds work back from the others for that
long at most, and a stream whose key only one node holds spreads to the others after one bound. Pure: the worker
(``fleet/worker.py``) and the simulation in ``benchmarks/warm_affinity.py`` decide with these same functions.
"""

from __future__ import annotations

import collections
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable

from nodeagent.tasks.contracts import ChatTask, ClassifyTask, ExtractTask

KEY_CHARS = 16  # of the sha256's hex: the keys of a stream of tasks, never a secret
WARM_KEYS = 32  # the keys a node holds warm: what its slots and its prefix store keep of its last tasks
# the parts of a typed task that change from one task of a stream to the next: the rest is what its prompt starts
# with (the task type's instructions, schema or labels, examples and options)
PER_TASK = frozenset({"id", "input", "deadline", "idempotency_key", "created_at"})
LEADING_ROLES = ("system", "developer")  # a chat's messages that lead every turn: with its tools, its prefix


def prefix_key(task: Any, model: str | None = None) -> str | None:
    """The key of what ``task``'s prompt starts with on ``model`` (the envelope's, or None), or None for a task
    whose prompt has no part that recurs (an embedding, a reranking, a text completion, a chat without a system
    prompt or tools)."""
    kind = getattr(task, "type", None)
    if isinstance(task, (ExtractTask, ClassifyTask)):
        shared = task.model_dump(mode="json", by_alias=True, exclude=set(PER_TASK))
    elif isinstance(task, ChatTask):
        request = task.request if isinstance(task.request, dict) else {}
        messages = request.get("messages") if isinstance(request.get("messages"), list) else []
        leading = []
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in LEADING_ROLES:
                break
            leading.append(m)
        shared = {"messages": leading, "tools": request.get("tools"), "response_format": request.get("response_format")}
        if not leading and not shared["tools"]:
            return None
    else:
        return None
    text = json.dumps({"type": kind, "model": model, "shared": shared}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:KEY_CHARS]


class WarmKeys:
    """The keys of the tasks a node ran last, the latest last; at most ``size``."""

    def __init__(self, size: int = WARM_KEYS) -> None:
        self.size = size
        self._keys: collections.OrderedDict[str, None] = collections.OrderedDict()

    def ran(self, key: str | None) -> None:
        if key is None:
            return
        self._keys.pop(key, None)
        self._keys[key] = None
        while len(self._keys) > self.size:
            self._keys.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def keys(self) -> list[str]:
        """The latest first (what a heartbeat says)."""
        return list(reversed(self._keys))


@dataclass(frozen=True)
class Peer:
    """Another node serving now, and the keys its last heartbeat said it holds warm."""

    id: str
    warm: frozenset[str]


def leave_to(key: str | None, age_s: float, here: WarmKeys | Iterable[str], peers: Iterable[Peer],
             bound_s: float) -> str | None:
    """The peer to leave a claimed task to, or None to run it here: a peer serving now that holds its key warm,
    while this node does not hold it and the task has waited less than ``bound_s``."""
    if key is None or bound_s <= 0 or age_s >= bound_s or key in here:
        return None
    return next((p.id for p in sorted(peers, key=lambda p: p.id) if key in p.warm), None)


def peers_of(records: Iterable[Any], me: str, now: float, lost_after_s: float) -> list[Peer]:
    """The peers a node may leave a task to: the other nodes serving now (``NodeRecord.liveness``), each with the
    keys its record says it holds warm."""
    out = []
    for r in records:
        if r.id == me or r.role != "node" or r.liveness(now, lost_after_s) != "serving":
            continue
        warm = frozenset(k for k in (r.warm or []) if isinstance(k, str))
        if warm:
            out.append(Peer(r.id, warm))
    return out
