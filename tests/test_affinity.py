"""Warm affinity (``fleet/affinity.py``): a task goes to the node that holds its prompt's prefix warm, within a bound
on its wait. The prefix key and the decision alone, then two workers on each broker (the fake backend as the model:
the other side of the boundary) serving a stream of four prefixes."""

from __future__ import annotations

import threading
import time

import pytest

from nodeagent.broker.base import NodeRecord
from nodeagent.client import Client
from nodeagent.config import resolve
from nodeagent.fleet.affinity import Peer, WarmKeys, leave_to, peers_of, prefix_key
from nodeagent.fleet.worker import Worker, WorkerConfig
from nodeagent.node import Node
from nodeagent.tasks.contracts import ChatTask, ClassifyTask, EmbedTask, ExtractTask

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def test_a_prefix_key_is_what_a_tasks_prompt_starts_with():
    one = ExtractTask(input="first ticket", schema=SCHEMA, instructions="Fill in the form.")
    two = ExtractTask(input="second ticket", schema=SCHEMA, instructions="Fill in the form.", idempotency_key="k")
    assert prefix_key(one) == prefix_key(two) and len(prefix_key(one)) == 16
    assert prefix_key(one) != prefix_key(one.model_copy(update={"instructions": "Other rules."}))
    assert prefix_key(one) != prefix_key(one, model="smollm2")  # another model reads another prefix
    labels = ClassifyTask(input="x", labels=["spam", "ham"])
    assert prefix_key(labels) == prefix_key(ClassifyTask(input="y", labels=["spam", "ham"]))
    assert prefix_key(labels) != prefix_key(ClassifyTask(input="x", labels=["ham", "spam"]))

    def chat(*messages, **extra):
        return ChatTask(request={"model": "m", "messages": list(messages), **extra})

    system = {"role": "system", "content": "You are terse."}
    assert prefix_key(chat(system, {"role": "user", "content": "a"})) == \
        prefix_key(chat(system, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}))
    assert prefix_key(chat({"role": "user", "content": "a"})) is None  # nothing leads every turn
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert prefix_key(chat({"role": "user", "content": "a"}, tools=tools)) is not None
    assert prefix_key(EmbedTask(input=["a"])) is None


def test_a_task_is_left_to_a_warm_peer_only_within_the_bound():
    peers = [Peer("b", frozenset({"k1"})), Peer("a", frozenset({"k1", "k2"}))]
    assert leave_to("k1", 0.5, [], peers, 2.0) == "a"  # the first by id: every node decides alike
    assert leave_to("k2", 0.5, [], peers, 2.0) == "a"
    assert leave_to("k1", 2.0, [], peers, 2.0) is None  # waited the bound: it runs where it was claimed
    assert leave_to("k1", 0.5, ["k1"], peers, 2.0) is None  # warm here too
    assert leave_to("k3", 0.5, [], peers, 2.0) is None  # warm nowhere
    assert leave_to("k1", 0.5, [], peers, 0.0) is None  # no preference
    assert leave_to(None, 0.5, [], peers, 2.0) is None
    keys = WarmKeys(2)
    for k in ("k1", "k2", "k1", "k3"):
        keys.ran(k)
    assert keys.keys() == ["k3", "k1"] and "k2" not in keys


def test_peers_are_the_other_nodes_serving_now():
    base = {"hostname": "h", "agent_version": "t", "os": "linux", "arch": "x86_64", "backend": "fake",
            "heartbeat_at": 100.0, "heartbeat_s": 1.0}
    records = [NodeRecord(id="me", state="ready", warm=["k"], **base),
               NodeRecord(id="ready", state="ready", warm=["k", 7], **base),
               NodeRecord(id="draining", state="draining", warm=["k"], **base),
               NodeRecord(id="gateway", state="ready", role="gateway", warm=["k"], **base),
               NodeRecord(id="cold", state="ready", **base),
               NodeRecord(id="silent", state="ready", warm=["k"], **{**base, "heartbeat_at": 90.0})]
    assert peers_of(records, "me", now=101.0, lost_after_s=30.0) == [Peer("ready", frozenset({"k"}))]


def record(node_id: str) -> NodeRecord:
    return NodeRecord(id=node_id, hostname="h", agent_version="t", os="linux", arch="x86_64", backend="fake", slots=2)


def two_workers(broker, prefer_warm_s: float) -> list[Worker]:
    out = []
    for node_id in ("a", "b"):
        config = WorkerConfig(node_id=node_id, queues=["classify.v1"], burst=False, slots=2, heartbeat_s=0.2,
                              idle_max_s=0.05, warm_keys=2, prefer_warm_s=prefer_warm_s)
        out.append(Worker(broker, Node("fake:latency_ms=40", config=resolve(env={})), config, record=record(node_id)))
    return out


@pytest.mark.parametrize("prefer_warm_s", [3.0, 0.0])
def test_a_stream_of_four_prefixes_lands_on_the_nodes_that_hold_them_and_waits_no_longer_than_the_bound(
        broker, prefer_warm_s):
    """Node a holds prefixes 1 and 2 warm, node b 3 and 4 (each holds two: its last tasks'). Forty tasks, the four
    in turn: with the preference, each lands on the node that holds its prefix, and none waits past the bound;
    without it (0), the two nodes take them as they come."""
    label_sets = [[f"red{i}", f"green{i}"] for i in range(4)]
    keys = [prefix_key(ClassifyTask(input="x", labels=labels)) for labels in label_sets]
    workers = two_workers(broker, prefer_warm_s)
    for w, held in zip(workers, (keys[:2], keys[2:])):
        for k in held:
            w.warm.ran(k)
    threads = [threading.Thread(target=w.run) for w in workers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while {r.id for r in broker.nodes() if r.warm} != {"a", "b"} and time.monotonic() < deadline:
        time.sleep(0.05)  # each has said what it holds
    client = Client(broker)
    ids = [client.submit(ClassifyTask(input=f"text {i}", labels=label_sets[i % 4])) for i in range(40)]
    results = [client.wait(i, timeout=60) for i in ids]
    for w in workers:
        w.stop()
    for t in threads:
        t.join(20)
    assert all(r.status == "ok" for r in results)
    home = {keys[0]: "a", keys[1]: "a", keys[2]: "b", keys[3]: "b"}
    ran_on = [broker.get(i).node for i in ids]
    warm = sum(ran_on[i] == home[keys[i % 4]] for i in range(40))
    waits = [r.timings.queue_wait_s for r in results]
    if prefer_warm_s:
        assert warm == 40, ran_on
        assert max(waits) < prefer_warm_s + 1.0, waits  # no task waits for its warm node past the bound
        assert sum(w.left_warm for w in workers) > 0  # (some were claimed by the other node, and given back)
        assert set(workers[0].warm.keys()) == set(keys[:2]) and set(workers[1].warm.keys()) == set(keys[2:])
    else:
        assert sum(w.left_warm for w in workers) == 0  # as they come: none given back
