"""A request's events (``tasks/events.py``): one type in process and on the queue. What a task's log carries is
what contract 1.1 wrote (the same kinds and fields, schemas/redis-contract.md), every event reads back as itself,
and the gateway's follower relays one attempt, drops a retried write's copy and ends on a gap after a piece."""

from __future__ import annotations

from nodeagent.tasks.events import Ended, Failed, Follower, Piece, Prepared, Received, Started, from_wire


def test_each_event_on_the_wire_is_what_the_contract_says_and_reads_back_as_itself():
    cases = [
        (Started("pi-1"), {"kind": "started", "node": "pi-1"}),
        (Prepared(("a note",), 2, 4, None), {"kind": "prepared", "notes": ["a note"], "n": 2, "choices": 4,
                                             "echo": None}),
        (Prepared((), 1, 1, ("echoed",)), {"kind": "prepared", "notes": [], "n": 1, "choices": 1,
                                           "echo": ["echoed"]}),
        (Piece(1, "tool_calls", [{"id": "c1"}]), {"kind": "piece", "index": 1, "what": "tool_calls",
                                                  "value": [{"id": "c1"}]}),
        (Ended("done", "t1", 2, "pi-1"), {"kind": "finished", "state": "done", "attempt": 2, "node": "pi-1",
                                          "task": "t1"}),
        (Ended("cancelled", "t1"), {"kind": "cancelled", "task": "t1"}),
    ]
    for event, wire in cases:
        assert event.to_wire() == wire
        assert from_wire({**wire, "attempt": wire.get("attempt", 3), "seq": 5}).event == event
    unknown = from_wire({"kind": "a_kind_of_1_9", "attempt": 1, "seq": 2})
    assert unknown == Received(None, 1, 2)


class _Engine:
    notes, n, prompts, prompt_texts, echo = ["n"], 2, [[1], [2]], ["x", "y"], True


def test_prepared_is_counted_once_from_the_engine():
    assert Prepared.of(_Engine()) == Prepared(("n",), 2, 4, ("x", "y"))


def test_the_follower_relays_one_attempt_and_ends_on_what_it_cannot_relay():
    f = Follower()
    assert f.take(Received(Started("a"), 1, 1)) is None and f.begun and f.node == "a"
    assert f.take(Received(Prepared((), 1, 1), 1, 2)) == Prepared((), 1, 1)
    assert f.take(Received(Piece(0, "content", "He"), 1, 3)) == Piece(0, "content", "He")
    assert f.take(Received(Piece(0, "content", "He"), 1, 3)) is None  # a retried write's copy
    assert f.take(Received(None, 1, 4)) is None  # a newer kind: skipped, still counted
    assert f.take(Received(Piece(0, "content", "llo"), 1, 5)) == Piece(0, "content", "llo")
    gap = f.take(Received(Piece(0, "content", "!"), 1, 7))
    assert isinstance(gap, Failed) and gap.error.code == "node_lost"
    quiet = Follower()  # a second attempt before any piece went out is followed instead
    quiet.take(Received(Prepared((), 1, 1), 1, 1))
    assert quiet.take(Received(Prepared((), 1, 1), 2, 1)) is None and quiet.relayed == 2
    assert quiet.take(Received(Piece(0, "content", "x"), 1, 2)) is None  # the first attempt's: not relayed
    assert quiet.take(Received(Ended("delayed", "t", 2), 2)) is None  # a retry before any piece: waited for
    end = quiet.take(Received(Ended("done", "t", 3, "b"), 3))
    assert end == Ended("done", "t", 3, "b") and quiet.node == "b"
