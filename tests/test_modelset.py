"""A node's model set on the fake backend with made-up plan sizes (fake:mem_mb=N) and an injected clock: least
recently used first, pinned models never unloaded, a model in use never unloaded, a task that cannot fit waits
and then fails retryably, keep-alive; and a real worker process holding two models under a budget for one."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import Clock, cli
from test_fleet_processes import QUIET_GUARD

from nodeagent.broker.open import open_broker
from nodeagent.client import Client
from nodeagent.config import resolve
from nodeagent.errors import TaskFailed
from nodeagent.modelset import Member, ModelSet
from nodeagent.node import Node
from nodeagent.tasks.contracts import ClassifyTask

MIB = 1 << 20


def member(name: str, mb: int, pinned: bool = False, latency_ms: int = 0) -> Member:
    spec = f"fake:mem_mb={mb},latency_ms={latency_ms},ctx=512" + f",fail=[{name}]"  # a spec of its own each
    return Member(name=name, node=Node(spec, config=resolve(env={})), pinned=pinned, names={spec})


def task(text: str = "hello") -> ClassifyTask:
    return ClassifyTask(input=text, labels=["a", "b"])


def test_least_recently_used_is_unloaded_first_and_keep_alive_reaps():
    clock = Clock()
    a, b, c = member("a", 100), member("b", 100), member("c", 100)
    s = ModelSet([a, b, c], budget_bytes=250 * MIB, keep_alive_s=60, wait_s=0, clock=clock)
    assert s.run(task(), model="a").status == "ok"
    clock.now += 1
    assert s.run(task(), model="b").status == "ok"
    clock.now += 1
    assert s.run(task(), model="a").status == "ok"  # a is now the more recent
    clock.now += 1
    assert s.run(task(), model="c").status == "ok"  # room for c: b goes, the least recently used
    assert (a.loaded, b.loaded, c.loaded) == (True, False, True)
    assert s.loaded_bytes() <= 250 * MIB
    clock.now += 59
    assert s.reap() == ["a"]  # idle 61 s: past its keep-alive; c (used 59 s ago) stays
    assert (a.loaded, c.loaded) == (False, True) and (a.loads, a.unloads) == (1, 1)


def test_pinned_models_are_never_unloaded_and_what_cannot_fit_fails_at_once():
    clock = Clock()
    p, x = member("p", 150, pinned=True), member("x", 150)
    s = ModelSet([p, x], budget_bytes=250 * MIB, keep_alive_s=1, wait_s=30, clock=clock)
    s.start()
    assert p.loaded and not x.loaded
    result = s.run(task(), model="x")
    assert result.status == "error" and result.error.code == "model_unavailable" and result.error.retryable
    clock.now += 1000
    assert s.reap() == [] and p.loaded  # pinned: no keep-alive


def test_a_model_in_use_is_never_unloaded_and_the_task_waits_then_fails_retryably():
    a, b = member("a", 150, latency_ms=600), member("b", 150)
    s = ModelSet([a, b], budget_bytes=250 * MIB, keep_alive_s=60, wait_s=0.2)
    running = threading.Thread(target=lambda: s.run(task(), model="a"))
    running.start()
    time.sleep(0.15)  # a is running its task
    t0 = time.monotonic()
    result = s.run(task(), model="b")
    waited = time.monotonic() - t0
    assert result.error is not None and result.error.code == "model_unavailable" and result.error.retryable
    assert 0.2 <= waited < 1.5 and a.loaded and a.unloads == 0  # it waited, and never pulled a from under its task
    running.join(5)
    s.wait_s = 5
    assert s.run(task(), model="b").status == "ok" and not a.loaded  # a's task ended: its room is b's


def test_a_waiting_task_gets_the_room_when_the_running_one_ends():
    a, b = member("a", 150, latency_ms=300), member("b", 150)
    s = ModelSet([a, b], budget_bytes=250 * MIB, keep_alive_s=60, wait_s=5)
    running = threading.Thread(target=lambda: s.run(task(), model="a"))
    running.start()
    time.sleep(0.1)
    assert s.run(task(), model="b").status == "ok"
    running.join(5)
    assert a.unloads == 1 and b.loaded


def test_an_unknown_model_and_a_model_over_the_budget():
    s = ModelSet([member("a", 100)], budget_bytes=250 * MIB)
    r = s.run(task(), model="nope")
    assert r.error.code == "invalid_task" and not r.error.retryable
    with pytest.raises(ValueError, match="over the set's budget"):
        ModelSet([member("big", 300)], budget_bytes=250 * MIB)
    with pytest.raises(TaskFailed):
        s.member("nope")


def test_a_worker_process_serves_two_models_under_a_budget_for_one(tmp_path, isolated_env):
    """Alternating tasks bound to each of two fake models, with room for one at a time: every task done on its
    own model, each load evicting the other."""
    url = f"sqlite://{tmp_path / 'queue.db'}"
    broker = open_broker(url, tmp_path)
    client = Client(broker)
    specs = ["fake:mem_mb=100,fail=[x]", "fake:mem_mb=100,fail=[y]"]
    ids = [client.submit(task(f"item {i}"), model=specs[i % 2]) for i in range(8)]
    env = {**isolated_env, **QUIET_GUARD, "NODEAGENT_KEEP_ALIVE_S": "60"}
    # the set's budget is the plan's: the fake plans none, so a profile's budget is not what bounds it here;
    # the made-up sizes are checked by the tests above. This one proves the door: several --model, routing.
    proc = cli(["worker", "--model", specs[0], "--model", specs[1], "--pin", specs[0], "--broker", url, "--burst",
                "--json"], env)
    assert json.loads(proc.stdout)["completed"] == 8
    results = [broker.result(i) for i in ids]
    assert all(r.status == "ok" for r in results)
    assert [r.model for r in results] == [specs[i % 2] for i in range(8)]  # each on its own model
    [record] = broker.nodes()
    assert set(specs) <= set(record.models) and record.labels["model_set"] == ",".join(specs)
    bad = cli(["worker", "--model", specs[0], "--model", specs[1], "--pin", "other", "--broker", url, "--burst"],
              env, check=False)
    assert bad.returncode == 2 and "--pin 'other'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.real_model
def test_server_routes_by_model_across_two_real_models(tmp_path, smollm2_path, gemma3_path):
    """`serve` with two --model: the official openai client's `model` picks the model, /v1/models lists both
    with their state, an unknown model is OpenAI's 404, and keep_alive 0 unloads a model after its request."""
    import httpx
    import openai
    from test_server import Served

    server = Served(str(smollm2_path), {"NODEAGENT_HOME": str(tmp_path), "NODEAGENT_CONFIG": str(tmp_path / "c")},
                    "--model", str(gemma3_path), "--pin", str(smollm2_path), "--ctx", "1024")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        listed = {m.id: m for m in client.models.list().data}
        smol, gemma = smollm2_path.stem, gemma3_path.stem
        assert set(listed) == {smol, gemma}
        assert listed[smol].model_extra["loaded"] and listed[smol].model_extra["pinned"]
        assert not listed[gemma].model_extra["loaded"]  # loaded at its first request
        for name in (gemma, smol, gemma):
            r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Say hi."}],
                                               max_tokens=4, temperature=0)
            assert r.model == name and r.choices[0].message.content is not None
        assert client.models.retrieve(gemma).model_extra["loaded"]
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        assert missing.value.body["code"] == "model_not_found"
        r = httpx.post(server.url + "/v1/chat/completions", json={
            "model": gemma, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "keep_alive": 0},
            timeout=60)
        assert r.status_code == 200, r.text
        end = time.time() + 10
        while time.time() < end and client.models.retrieve(gemma).model_extra["loaded"]:
            time.sleep(0.2)
        assert not client.models.retrieve(gemma).model_extra["loaded"]  # keep_alive 0: unloaded after it
        assert client.models.retrieve(smol).model_extra["loaded"]  # pinned
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert f'nodeagent_model_loads_total{{model="{gemma3_path}"}} 1.0' in metrics  # loaded once, kept
        assert f'nodeagent_model_unloads_total{{model="{gemma3_path}"}} 1.0' in metrics
        bad = httpx.post(server.url + "/v1/chat/completions", json={
            "model": smol, "messages": [{"role": "user", "content": "hi"}], "keep_alive": "soon"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"
    finally:
        server.stop()


def _sized(mb: int, budget_mb: int, overhead_mb: int = 50):
    plan = Node(f"fake:mem_mb={mb}", config=resolve(env={})).plan
    memory = plan.memory.model_copy(update={"overhead_bytes": overhead_mb * MIB,
                                            "total_bytes": (mb + overhead_mb) * MIB})
    return plan.model_copy(update={"memory": memory, "budget": plan.budget.model_copy(
        update={"host_limit_bytes": budget_mb * MIB})})


def test_a_set_planned_against_one_budget_names_what_to_drop():
    from nodeagent.planner.modelset import plan_set

    together = plan_set(["a", "b"], [_sized(100, 300), _sized(100, 300)])
    assert together.fits_together and together.total_bytes == 250 * MIB  # the overhead once: 50 + 100 + 100
    apart = plan_set(["small", "big", "mid"], [_sized(50, 300), _sized(200, 300), _sized(120, 300)])
    assert not apart.fits_together and apart.fits_one_at_a_time
    assert apart.largest_together == ["small", "big"]  # two fit: the pair that keeps the most loaded
    assert any(r.startswith("drop mid") for r in apart.reasons)
    assert any("swaps them" in r for r in apart.reasons)
    never = plan_set(["a", "huge"], [_sized(100, 300), _sized(400, 300)])
    assert not never.fits_one_at_a_time and any("huge does not fit even alone" in r for r in never.reasons)


@pytest.mark.real_model
def test_plan_of_two_real_models_charges_the_overhead_once(isolated_env):
    out = json.loads(cli(["plan", "smollm2-135m-instruct", "gemma-3-270m-it", "--ctx", "2048", "--json"],
                         isolated_env).stdout)
    plans, whole = out["models"], out["set"]
    overhead = whole["overhead_bytes"]
    assert whole["total_bytes"] == overhead + sum(p["memory"]["total_bytes"] - p["memory"]["overhead_bytes"]
                                                  for p in plans)
    assert whole["total_bytes"] < sum(p["memory"]["total_bytes"] for p in plans)
    assert whole["fits_together"] and whole["reasons"][-1].endswith("all loaded at once")


def test_the_hosts_ledger_holds_a_second_process_to_what_is_left(tmp_path, isolated_env):
    """A worker process holding a model reserves its plan in the host's ledger; a second process plans against
    what is left (a model that would fit the machine but not beside the first is refused); kill -9 the first
    and its reservation is gone at the next look."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    env = {**isolated_env, **QUIET_GUARD}
    avail = psutil.virtual_memory().available
    first_mb = int(avail * 0.6) >> 20  # made up: no memory is really taken
    second = f"fake:mem_mb={int(avail * 0.5) >> 20}"
    alone = json.loads(cli(["plan", second, "--json"], env).stdout)
    assert alone["fits"]  # on its own it fits this machine
    url = f"sqlite://{tmp_path / 'queue.db'}"
    a = subprocess.Popen([sys.executable, "-m", "nodeagent", "worker", "--model", f"fake:mem_mb={first_mb}",
                          "--broker", url], env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        end = time.time() + 60
        while time.time() < end and not json.loads(cli(["status", "--broker", url, "--json"], env).stdout)["ledger"]:
            time.sleep(0.2)
        [entry] = json.loads(cli(["status", "--broker", url, "--json"], env).stdout)["ledger"]
        assert entry["pid"] == a.pid and entry["host_bytes"] == first_mb << 20
        beside = json.loads(cli(["plan", second, "--json"], env).stdout)
        assert not beside["fits"] and "reserved by other nodeagent processes" in beside["reasons"][0]
        assert beside["budget"]["host_limit_bytes"] <= psutil.virtual_memory().total - (first_mb << 20)
        refused = cli(["worker", "--model", second, "--broker", url, "--burst"], env, check=False)
        assert refused.returncode != 0 and "does not fit" in refused.stderr  # never overcommitted
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(10)
    assert json.loads(cli(["status", "--broker", url, "--json"], env).stdout)["ledger"] == []  # reclaimed
    assert json.loads(cli(["plan", second, "--json"], env).stdout)["fits"]


def test_the_worker_takes_tasks_of_its_loaded_model_first(broker):
    """Two models with room for one: with tasks of both queued, the worker serves the loaded model's first,
    so it swaps once, not at every task."""
    from nodeagent.fleet.worker import Worker, WorkerConfig

    a, b = member("a", 100, pinned=False), member("b", 100)
    s = ModelSet([a, b], budget_bytes=150 * MIB, keep_alive_s=600, wait_s=5)
    s.acquire(a)
    s.release(a)  # a is loaded
    client = Client(broker)
    spec_a, spec_b = next(iter(a.names)), next(iter(b.names))
    ids = [client.submit(task(f"t{i}"), model=spec_b if i % 2 == 0 else spec_a) for i in range(8)]
    config = WorkerConfig(node_id="w1", queues=["classify.v1"], burst=True, idle_max_s=0.05,
                          models=sorted(a.names | b.names))
    Worker(broker, s, config).run()
    results = [broker.result(i) for i in ids]
    assert all(r.status == "ok" for r in results)
    order = sorted(ids, key=lambda i: broker.get(i).history[0].started_at)
    models = [broker.result(i).model for i in order]
    assert models == [spec_a] * 4 + [spec_b] * 4  # the loaded one's first, then one swap
    assert (a.unloads, b.loads) == (1, 1)


def test_models_from_the_config_file_with_their_own_settings_and_aliases(tmp_path, isolated_env):
    url = f"sqlite://{tmp_path / 'queue.db'}"
    config = tmp_path / "config.toml"
    config.write_text('[[models]]\nmodel = "fake:mem_mb=10,fail=[x]"\npin = true\naliases = ["small"]\n\n'
                      '[[models]]\nmodel = "fake:mem_mb=20,fail=[y]"\naliases = ["big"]\nslots = 2\n')
    env = {**isolated_env, **QUIET_GUARD, "NODEAGENT_CONFIG": str(config)}
    broker = open_broker(url, tmp_path)
    client = Client(broker)
    ids = [client.submit(task(f"item {i}"), model=["small", "big"][i % 2]) for i in range(4)]
    out = cli(["worker", "--broker", url, "--burst", "--json"], env)
    assert json.loads(out.stdout)["completed"] == 4
    assert [broker.result(i).model for i in ids] == ["fake:mem_mb=10,fail=[x]", "fake:mem_mb=20,fail=[y]"] * 2
    [record] = broker.nodes()
    assert {"small", "big"} <= set(record.models)
    assert record.labels["model_set"] == "fake:mem_mb=10,fail=[x],fake:mem_mb=20,fail=[y]"
    config.write_text('[[models]]\nmodel = "fake"\ncolour = "red"\n')
    bad = cli(["worker", "--broker", url, "--burst"], env, check=False)
    assert bad.returncode != 0 and "models[0] has unknown keys: colour" in bad.stderr and "Traceback" not in bad.stderr
    config.write_text("")
    none = cli(["worker", "--broker", url, "--burst"], env, check=False)
    assert none.returncode == 2 and "no model to serve" in none.stderr


# -- a swap storm: requests alternating between two models that cannot be loaded together ----------------------
def storm(call, clients: int = 4, each: int = 30) -> tuple[list, int]:
    """``clients`` threads, each sending ``each`` requests that alternate between models 0 and 1 (client i starts
    at i % 2): every answer, and the changes of model (a client's request for the other model than its last)."""
    answers: list = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for k in range(each):
            got = call((i + k) % 2)
            with lock:
                answers.append(got)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, clients * (each - 1)


def test_a_swap_storm_refuses_nothing_and_swaps_by_the_group():
    """120 tasks from four clients alternating between two models with room for one: every task answered on its
    model (none refused "does not fit beside the pinned models": nothing is pinned), and the waiting tasks grouped
    by model, one load a group: fewer loads than half the changes of model."""
    a, b = member("a", 150, latency_ms=20), member("b", 150, latency_ms=20)
    s = ModelSet([a, b], budget_bytes=250 * MIB, keep_alive_s=60, wait_s=30)
    answers, changes = storm(lambda m: s.run(task(), model="ab"[m]))
    assert [r.error for r in answers if r.status != "ok"] == []
    assert a.loads + b.loads < changes / 2, (a.loads, b.loads, changes)
    assert not (a.loaded and b.loaded)


def test_a_swap_storm_through_serve(tmp_path, isolated_env):
    """The same on `serve` with two fake models that fit this (recorded) Pi 4 one at a time: 120 chat requests
    from four clients, every one answered 200 by its model, fewer loads than half the changes of model."""
    import httpx
    from conftest import HARDWARE
    from test_server import Served

    specs = ["fake:mem_mb=1600,latency_ms=20,fail=[x]", "fake:mem_mb=1600,latency_ms=20,fail=[y]"]
    server = Served(specs[0], {**isolated_env, "NODEAGENT_HARDWARE_FIXTURE": str(HARDWARE / "rpi4-4gb.json")},
                    "--model", specs[1])
    try:
        with httpx.Client(timeout=120) as http:
            def chat(m: int) -> tuple[int, str]:
                r = http.post(server.url + "/v1/chat/completions", json={
                    "model": specs[m], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                return r.status_code, r.json().get("model", r.text)

            answers, changes = storm(chat)
            metrics = http.get(server.url + "/metrics").text
    finally:
        server.stop()
    assert [a for a in answers if a[0] != 200] == []
    loads = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("nodeagent_model_loads_total{"))
    assert 2 <= loads < changes / 2, (loads, changes)


# -- a member that fails to load at its first request: a clear refusal, never a 500 --------------------------------

@pytest.mark.real_model
def test_a_member_that_fails_to_load_later_is_a_503_with_the_reason(tmp_path, smollm2_path, gemma3_path):
    """`serve` with two --model: the first's plan fits and is checked at start, but its file is broken before its
    first request (llama.cpp cannot load it). A typed task (which the set's first member takes) gets an error Result
    naming the model and why, a chat for it a 503 saying the same, and the other model keeps serving."""
    import httpx
    from test_server import Served

    gemma, smol = tmp_path / "gemma.gguf", tmp_path / "smol.gguf"
    gemma.symlink_to(gemma3_path)
    smol.symlink_to(smollm2_path)
    server = Served(str(gemma), {"NODEAGENT_HOME": str(tmp_path / "home"), "NODEAGENT_CONFIG": str(tmp_path / "c")},
                    "--model", str(smol), "--ctx", "1024")
    try:
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(gemma3_path.read_bytes()[:1 << 20])  # its header, its weights cut off
        gemma.unlink()
        gemma.symlink_to(broken)
        got = httpx.post(server.url + "/v1/classify", json={"input": "hi", "labels": ["a", "b"]}, timeout=60)
        assert got.status_code == 200 and got.json()["error"]["code"] == "backend_error", got.text
        assert "gemma" in got.json()["error"]["message"] and "could not be loaded" in got.json()["error"]["message"]
        r = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "gemma", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "backend_error", r.text
        assert "could not be loaded" in r.json()["error"]["message"]
        ok = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        server.stop()
