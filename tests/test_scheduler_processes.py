"""The scheduler and following workers as real processes, as a user starts them.

On Redis: three workers on the fake backend, each a different recorded device (a Pi 5 8 GB, an M2 Pro 16 GB, a
Pi 4 4 GB), and two schedulers (a leader and a standby). Tasks for a model no node holds are placed where it
fits, loaded and served; kill -9 the node holding it and it is placed elsewhere within one lease; kill -9 the
leading scheduler and the standby takes over and places the next model; every task ends with one result.

On SQLite, with the two real test models: two following workers on one host and no scheduler process (a
following worker runs the rounds itself), each model placed and served, and again after kill -9 of a worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import stop_all
from test_fleet_processes import QUIET_GUARD

from nodeagent.broker.base import Envelope
from nodeagent.fleet.scheduler import LEADER, LEASE, read_assignment
from nodeagent.tasks.contracts import ClassifyTask

FIXTURES = Path(__file__).parent / "fixtures" / "hardware"
Q = "classify.v1"
FAST = {"NODEAGENT_LOG_LEVEL": "info", "NODEAGENT_LOG_FORMAT": "text", "NODEAGENT_SCHEDULE_S": "0.3", "NODEAGENT_SCHEDULER_LEASE_S": "2", "NODEAGENT_MIN_RESIDENCY_S": "0",
        **QUIET_GUARD}
LEASE_S = 4.0


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    out = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "nodeagent", *args], env={**os.environ, **FAST, **env},
                            stdout=out, stderr=subprocess.STDOUT, text=True)


def follower(url: str, tmp: Path, name: str, fixture: str | None, env: dict[str, str] | None = None,
             home: Path | None = None) -> subprocess.Popen:
    e = {"NODEAGENT_HOME": str(home or tmp / name), "NODEAGENT_CONFIG": str(tmp / "none.toml"), **(env or {})}
    if fixture:
        e["NODEAGENT_HARDWARE_FIXTURE"] = str(FIXTURES / fixture)
    return spawn(["worker", "--follow", "--broker", url, "--types", "classify", "--lease", str(LEASE_S),
                  "--heartbeat", "0.5"], e, tmp / f"{name}.log")


def enqueue(broker, model: str, n: int) -> list[str]:
    ids = []
    for i in range(n):
        t = ClassifyTask(input=f"{model} item {i}", labels=["yes", "no"])
        ids.append(broker.enqueue(Envelope(id=t.id, queue=Q, task=t.model_dump(mode="json"), model=model)))
    return ids


def wait_for(what, timeout_s: float, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every_s)
    return None


def holders(broker, model: str) -> list[str]:
    return [n.id for n in broker.nodes() if model in (n.following or {}).get("held", [])]


def test_redis_fleet_places_moves_and_survives_a_scheduler_kill(redis_server, tmp_path):
    import redis

    from nodeagent.broker.open import open_broker

    redis.Redis.from_url(redis_server.url).flushall()
    url = redis_server.url
    broker = open_broker(url, tmp_path, True)
    workers = {name: follower(url, tmp_path, name, fixture) for name, fixture in
               (("pi5", "rpi5-8gb.json"), ("m2pro", "m2-pro-16gb.json"), ("pi4", "rpi4-4gb.json"))}
    env = {"NODEAGENT_HOME": str(tmp_path / "sched"), "NODEAGENT_CONFIG": str(tmp_path / "none.toml")}
    schedulers = [spawn(["scheduler", "--broker", url], env, tmp_path / f"scheduler{i}.log") for i in (1, 2)]
    procs = [*workers.values(), *schedulers]
    try:
        assert wait_for(lambda: len([n for n in broker.nodes() if n.follow]) == 3, 60), "workers did not register"
        ids = []
        big = "fake:mem_mb=3600,latency_ms=20"  # over the Pi 4's 3.4 GB budget: the Pi 5 or the M2 Pro
        ids += enqueue(broker, big, 30)
        first = wait_for(lambda: holders(broker, big), 30)
        assert first, "the model was never loaded anywhere"
        by_id = {n.id: n for n in broker.nodes()}
        assert all(by_id[h].labels["host"].endswith(("rpi5-8gb", "m2-pro-16gb")) for h in first)
        assert wait_for(lambda: sum(broker.result(i) is not None for i in ids) >= 5, 30)
        # kill -9 the node holding it: its model is placed elsewhere within one lease
        victim = first[0]
        victim_proc = next(p for name, p in workers.items() if by_id[victim].labels["host"].endswith(
            {"pi5": "rpi5-8gb", "m2pro": "m2-pro-16gb", "pi4": "rpi4-4gb"}[name]))
        victim_proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        moved = wait_for(lambda: [h for h in holders(broker, big) if h != victim
                                  and broker.nodes() and read_assignment(broker, h)
                                  and big in read_assignment(broker, h).names], 30)
        assert moved, "the model was not placed elsewhere"
        assert time.monotonic() - killed_at <= LEASE_S + 2.0  # placed and loaded within one lease (and a round)
        assert big not in read_assignment(broker, victim).names
        # kill -9 the leading scheduler: the standby takes over and places a new model
        leader = broker.doc_get(LEASE, LEADER)[0]["owner"]
        lead_proc = next(p for p in schedulers if leader.endswith(f":{p.pid}"))
        lead_proc.send_signal(signal.SIGKILL)
        small = "fake:mem_mb=500,latency_ms=20"
        ids += enqueue(broker, small, 20)
        assert wait_for(lambda: broker.doc_get(LEASE, LEADER)[0]["owner"] != leader, 20), "no standby took over"
        assert wait_for(lambda: holders(broker, small), 30), "the new leader placed nothing"
        assert wait_for(lambda: all(broker.result(i) is not None for i in ids), 60), "tasks left unfinished"
        results = [broker.result(i) for i in ids]
        assert all(r.status == "ok" for r in results)
        assert all(broker.get(i).state == "done" for i in ids)
    finally:
        stop_all(procs, wait_s=20)
        for log in sorted(tmp_path.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-3000:]}")


def test_sqlite_two_real_models_placed_by_a_following_worker_itself(tmp_path, smollm2_path, gemma3_path):
    from nodeagent.broker.open import open_broker

    url = f"sqlite://{tmp_path / 'queue.db'}"
    home = tmp_path / "home"  # one host: one state directory, one ledger, one queue
    env = {"NODEAGENT_TEST_MODELS_DIR": str(smollm2_path.parent), "NODEAGENT_CTX": "1024", "NODEAGENT_OFFLINE": "1"}
    a = follower(url, tmp_path, "a", None, env, home=home)
    b = follower(url, tmp_path, "b", None, env, home=home)
    procs = [a, b]
    broker = open_broker(url, home, True)
    try:
        assert wait_for(lambda: len(broker.nodes()) == 2, 60)
        models = ["smollm2-135m-instruct", "gemma-3-270m-it"]
        ids = {m: enqueue(broker, m, 6) for m in models}
        assert wait_for(lambda: all(broker.result(i) is not None for m in models for i in ids[m]), 240), \
            "not every task was served"
        for m in models:
            assert all(broker.result(i).status == "ok" for i in ids[m])
            assert holders(broker, m)
        lease = broker.doc_get(LEASE, LEADER)[0]
        assert lease["owner"] in {n.id for n in broker.nodes()}  # a worker led: no scheduler process ran
        # kill -9 the worker holding SmolLM2: the other one takes it over (one host, room for both)
        victim = holders(broker, models[0])[0]
        ids_of = {node_id_of(tmp_path / f"{name}.log"): p for name, p in (("a", a), ("b", b))}
        ids_of[victim].send_signal(signal.SIGKILL)
        survivor = next(i for i in ids_of if i != victim)
        more = enqueue(broker, models[0], 4)
        assert wait_for(lambda: all(broker.result(i) is not None for i in more), 240)
        assert all(broker.result(i).status == "ok" for i in more)
        assert survivor in holders(broker, models[0])
    finally:
        stop_all(procs, wait_s=20)
        for log in sorted(tmp_path.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-3000:]}")


def test_an_embedding_model_is_placed_by_its_demand_beside_a_generator(tmp_path, smollm2_path, minilm_path):
    """embed.v1 tasks for the embedding model and classify.v1 tasks for SmolLM2, on a following worker that holds
    neither: the scheduler (the worker leading) places both by their demand, and each kind's tasks are answered by
    its own model."""
    from nodeagent.broker.open import open_broker
    from nodeagent.tasks.contracts import EmbedTask

    url = f"sqlite://{tmp_path / 'queue.db'}"
    home = tmp_path / "home"
    env = {"NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(tmp_path / "none.toml"),
           "NODEAGENT_TEST_MODELS_DIR": str(smollm2_path.parent), "NODEAGENT_CTX": "1024", "NODEAGENT_OFFLINE": "1"}
    w = spawn(["worker", "--follow", "--broker", url, "--types", "classify,embed", "--lease", str(LEASE_S),
               "--heartbeat", "0.5"], env, tmp_path / "w.log")
    broker = open_broker(url, home, True)
    try:
        assert wait_for(lambda: len(broker.nodes()) == 1, 60)
        vectors = []
        for i in range(4):
            t = EmbedTask(input=[f"text {i}", "another"])
            vectors.append(broker.enqueue(Envelope(id=t.id, queue="embed.v1", task=t.model_dump(mode="json"),
                                                   model="all-minilm-l6-v2")))
        labels = enqueue(broker, "smollm2-135m-instruct", 3)
        assert wait_for(lambda: all(broker.result(i) is not None for i in vectors + labels), 240), \
            "not every task was served"
        for i in vectors:
            r = broker.result(i)
            assert r.status == "ok" and r.output.dimensions == 384 and r.model.startswith("all-MiniLM-L6-v2"), r
        for i in labels:
            r = broker.result(i)
            assert r.status == "ok" and r.model.startswith("SmolLM2"), r
        assert holders(broker, "all-minilm-l6-v2") and holders(broker, "smollm2-135m-instruct")
    finally:
        stop_all([w], wait_s=20)
        print((tmp_path / "w.log").read_text()[-3000:])


def node_id_of(log: Path) -> str:
    """The node id a worker names in its first line (``worker <id>: following ...``)."""
    import re

    found = wait_for(lambda: re.search(r"worker (\S+): following", log.read_text()), 30)
    assert found, f"{log.name} never said which node it is"
    return found.group(1)


def test_serve_follow_answers_for_a_model_the_scheduler_placed(tmp_path):
    """`serve --follow` on SQLite: tasks for a second model make the (embedded) scheduler place it on the server's
    node; /v1/models then lists it and the official openai client gets an answer from it by name."""
    import openai
    from test_server import Served

    from nodeagent.broker.open import open_broker

    url = f"sqlite://{tmp_path / 'queue.db'}"
    env = {"NODEAGENT_HOME": str(tmp_path), "NODEAGENT_CONFIG": str(tmp_path / "none.toml"),
           "NODEAGENT_HARDWARE_FIXTURE": str(FIXTURES / "m2-pro-16gb.json"), "NODEAGENT_HEARTBEAT_S": "0.5", **FAST}
    server = Served("fake:mem_mb=100", env, "--follow", "--broker", url)
    try:
        broker = open_broker(url, tmp_path, True)
        second = "fake:mem_mb=200"
        ids = enqueue(broker, second, 3)
        assert wait_for(lambda: all(broker.result(i) is not None for i in ids), 60), "the queued tasks were not served"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        listed = {m.id for m in client.models.list()}
        assert any("mem_mb=200" in m for m in listed), listed
        assert any("mem_mb=100" in m for m in listed), listed  # what it held at start stays: it has room for both
        reply = client.chat.completions.create(model=second, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
        assert reply.choices[0].message.content is not None
    finally:
        server.stop()
