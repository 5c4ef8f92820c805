"""Slots: several tasks decoded together as parallel sequences of one llama.cpp context (real SmolLM2), the
planner charging for them and giving them up before the context, and the worker holding several tasks."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_planner import plan_for, write_header_only

from nodeagent.bench.workload import ROUTES, TICKET_SCHEMA, tickets
from nodeagent.config import resolve
from nodeagent.fleet.worker import Worker, WorkerConfig
from nodeagent.modelfile import inspect_file
from nodeagent.node import Node
from nodeagent.tasks.contracts import ClassifyTask
from nodeagent.tasks.schema import validate_output


def test_four_slots_decode_in_shared_steps_and_every_output_is_valid(smollm2_path):
    texts = tickets(8)
    with Node(str(smollm2_path), config=resolve(env={}), slots=4, ctx_tokens=1024, task="extract") as node:
        assert node.slots_total == 4 and node.plan.settings.n_ctx == 4 * 1024 and node.plan.settings.n_seq_max == 4
        # one task first, alone, on the first slot: the other slots start empty, with its prompt's prefix in
        # another slot's cells (four tasks started at the same instant would find none there yet)
        first = node.extract(texts[-1], TICKET_SCHEMA)
        engine = node.load()._engine
        steps, stepped = engine.steps, engine.stepped_tokens
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda t: node.extract(t, TICKET_SCHEMA), texts[:-1]))
        assert all(r.status == "ok" and validate_output(TICKET_SCHEMA, r.output) is None for r in [first, *results])
        generated = sum(r.tokens.generated for r in results)
        # a step per generated token and prompt chunk if the tasks ran one after another; batched, far fewer
        assert engine.steps - steps < 0.6 * generated, (engine.steps - steps, generated)
        assert engine.stepped_tokens - stepped >= generated
        # the slots that started empty took the system prompt and schema from the first slot's cells
        assert engine.borrowed_tokens > 0


def test_label_branches_in_slots_score_as_one_slot_does(smollm2_path):
    texts = tickets(4, seed=5)
    cfg = resolve(env={})
    with Node(str(smollm2_path), config=cfg, slots=1, ctx_tokens=512, task="classify") as one:
        alone = [one.classify(t, ROUTES) for t in texts]
    with Node(str(smollm2_path), config=cfg, slots=2, ctx_tokens=512, task="classify") as two:
        assert two.plan.settings.n_seq_max == 2 * 8  # each slot: its sequence and 7 label branches
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda t: two.classify(t, ROUTES), texts))
    # the same decisions; the probabilities differ only by the float rounding of other batch shapes (which
    # tasks share a step depends on timing, and Q4_1 products over several rows take another kernel): measured
    # up to 0.023 here and 0.057 once in a fresh clone. A branch reading another slot's cells is expected to move them
    # far more (and the labels)
    for a, b in zip(alone, together):
        assert a.output.label == b.output.label
        for name in ROUTES:
            assert abs(a.output.probabilities[name] - b.output.probabilities[name]) < 0.1


def test_slots_are_given_up_before_the_context(tmp_path):
    # a 13B-like shape: two slots of 24k tokens do not fit a 16 GB Pi 5 even with a q4_0 KV cache; one does
    write_header_only(tmp_path / "m.gguf", "llama", 40, 5120, 40, 40, 13824, 32000, ctx=32768)
    info = inspect_file(tmp_path / "m.gguf")
    roomy = plan_for("rpi5-16gb", info, ctx_tokens=16384)
    assert roomy.settings.slots == 2 and roomy.settings.n_ctx == 2 * 16384
    tight = plan_for("rpi5-16gb", info, ctx_tokens=24576)
    assert tight.fits and tight.settings.slots == 1 and tight.settings.n_ctx == 24576
    assert any("slots lowered from 2 to 1" in r for r in tight.reasons)
    fixed = plan_for("rpi5-16gb", info, ctx_tokens=24576, slots=2)  # asked for: kept, and it does not fit
    assert not fixed.fits and fixed.settings.slots == 2


def test_the_planner_charges_every_slot(smollm2_path):
    info = inspect_file(smollm2_path)
    one, four = (plan_for("linux-cpu", info, ctx_tokens=2048, slots=n) for n in (1, 4))
    assert four.memory.kv_bytes == 4 * one.memory.kv_bytes
    assert four.memory.output_bytes == 4 * one.memory.output_bytes
    assert four.memory.task_runtime_bytes > one.memory.task_runtime_bytes


class Counting:
    """The node for the worker: a fake model's runs, counting how many are inside at once."""

    def __init__(self, node: Node) -> None:
        self.node, self.inside, self.most = node, 0, 0
        self.lock = threading.Lock()

    def run(self, task, **kw):
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            return self.node.run(task, **kw)
        finally:
            with self.lock:
                self.inside -= 1


@pytest.mark.parametrize("slots", [1, 3])
def test_a_worker_holds_up_to_its_slots(broker, slots):
    from nodeagent.client import Client

    node = Node("fake:latency_ms=150", config=resolve(env={}), slots=slots)
    assert node.slots_total == slots
    counting = Counting(node)
    client = Client(broker)
    ids = [client.submit(ClassifyTask(input=f"text {i}", labels=["a", "b"])) for i in range(9)]
    w = Worker(broker, counting, WorkerConfig(node_id="s", queues=["classify.v1"], burst=True, slots=slots,
                                              idle_max_s=0.05))
    summary = w.run()
    assert summary == {"completed": 9, "failed": 0}
    assert counting.most == slots  # as many runs inside the node at once as it has slots, never more
    assert all(client.wait(i, timeout=5).status == "ok" for i in ids)
