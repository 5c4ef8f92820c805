"""The OpenAI Batch API on the fleet's queue: end to end with the official ``openai`` package against real
servers and real worker processes (SQLite with two workers; Redis with two workers and the server a third
process), kill -9 of a worker mid-batch and of the server mid-expansion, cancel and expiry with an injected clock
on both engines, bad input in OpenAI's shape, and the CLI as a user types it. The model is the fake backend: the
other side of the boundary."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import cli
from test_fleet_processes import QUIET_GUARD, start_worker, url  # noqa: F401  (url: a fixture)
from test_server import Served, json_error
from test_worker import worker

from nodeagent.broker.open import open_broker
from nodeagent.fleet.batches import BatchError, Batches

FAIL = "[boom]"  # the workers' fake backend fails a line whose input holds it (retryable, so after every attempt)


def lines(n: int, failing: set[int] = frozenset(), url: str = "/v1/classify") -> list[dict]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": url,
             "body": {"input": f"item {i}" + (f" {FAIL}" if i in failing else ""), "labels": ["yes", "no"]}}
            for i in range(n)]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def serve(url: str, home, *extra: str, env: dict | None = None) -> Served:
    env = {**QUIET_GUARD, "NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml"), **(env or {})}
    return Served("fake", env, "--broker", url, "--types", "chat", *extra)  # its own worker serves no classify


def workers(url: str, home, n: int = 2, model: str = f"fake:latency_ms=20,fail={FAIL}") -> list[subprocess.Popen]:
    return [start_worker(url, {"NODEAGENT_HOME": str(home / f"w{i}"), "NODEAGENT_CONFIG": str(home / "c.toml"),
                               "NODEAGENT_MAX_ATTEMPTS": "2", "NODEAGENT_RETRY_BASE_S": "0.05"}, model)
            for i in range(n)]


def stop(procs) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(30)


def wait_done(client, batch_id: str, timeout_s: float = 120):
    end = time.time() + timeout_s
    while time.time() < end:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} did not end: {b}")


def check_files(client, batch, n: int, failing: set[int]) -> None:
    """Every custom_id exactly once across the output and error files, failures in the error file."""
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    err = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()] \
        if batch.error_file_id else []
    ids = [r["custom_id"] for r in out + err]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(n)) and len(ids) == len(set(ids))
    assert [r["custom_id"] for r in out] == [f"req-{i}" for i in range(n) if i not in failing]  # input order
    assert {r["custom_id"] for r in err} == {f"req-{i}" for i in failing}
    for r in out:
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert r["response"]["body"]["status"] == "ok" and r["response"]["body"]["output"]["label"] in ("yes", "no")
    for r in err:
        assert r["response"]["status_code"] >= 500 and r["response"]["body"]["error"]["code"] == "backend_error"
    c = batch.request_counts
    assert (c.total, c.completed, c.failed) == (n, n - len(failing), len(failing))


@pytest.mark.parametrize("engine", ["sqlite", "redis"])
def test_openai_client_end_to_end_200_lines(engine, tmp_path, request):
    import openai

    url = f"sqlite://{tmp_path / 'queue.db'}" if engine == "sqlite" else request.getfixturevalue("redis_server").url
    if engine == "redis":
        import redis

        redis.Redis.from_url(url).flushall()
    procs = workers(url, tmp_path)
    server = serve(url, tmp_path / "server")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        failing = set(range(7, 200, 20))  # 10 lines fail after their attempts
        f = client.files.create(file=("input.jsonl", jsonl(lines(200, failing))), purpose="batch")
        assert f.purpose == "batch" and f.bytes > 0
        assert client.files.retrieve(f.id).id == f.id and f.id in [x.id for x in client.files.list().data]
        assert client.files.content(f.id).content == jsonl(lines(200, failing))
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/classify", completion_window="24h",
                                  metadata={"job": "test"})
        assert b.status in ("in_progress", "completed") and b.metadata == {"job": "test"}
        b = wait_done(client, b.id)
        assert b.status == "completed" and b.completed_at and b.in_progress_at and b.finalizing_at
        check_files(client, b, 200, failing)
        assert b.id in [x.id for x in client.batches.list(limit=5).data]
    finally:
        server.stop()
        stop(procs)


def test_chat_lines_run_as_chat_tasks(tmp_path):
    """A chat batch: each line's body is a chat completion request, answered by the chat.v1 task type (the same
    implementation as the route), its output line the chat.completion body."""
    import openai

    url = f"sqlite://{tmp_path / 'queue.db'}"
    server = serve(url, tmp_path / "server")  # its own worker serves chat
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 8}} for i in range(5)]
        f = client.files.create(file=("chat.jsonl", jsonl(rows)), purpose="batch")
        b = wait_done(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id, 60)
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        assert [r["custom_id"] for r in out] == [f"c{i}" for i in range(5)]
        for r in out:
            body = r["response"]["body"]
            assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
            assert body["usage"]["completion_tokens"] <= 8
    finally:
        server.stop()


def test_responses_lines_run_as_chat_tasks_and_answer_as_responses(tmp_path):
    """A /v1/responses batch: each line's body is a Responses request, run as the chat task it translates to, its
    output line a response object (as openai's Response parses it); a line that cannot run is its line's error."""
    import openai
    from openai.types.responses import Response

    url = f"sqlite://{tmp_path / 'queue.db'}"
    server = serve(url, tmp_path / "server")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                 "body": {"input": f"Say {i}", "instructions": "Be brief.", "max_output_tokens": 8}}
                for i in range(3)]
        f = client.files.create(file=("responses.jsonl", jsonl(rows)), purpose="batch")
        b = wait_done(client, client.batches.create(input_file_id=f.id, endpoint="/v1/responses",
                                                    completion_window="24h").id, 60)
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        assert [r["custom_id"] for r in out] == ["r0", "r1", "r2"]
        for r in out:
            response = Response.model_validate(r["response"]["body"])
            assert response.object == "response" and response.output_text is not None
            assert response.usage.output_tokens <= 8 and response.status in ("completed", "incomplete")
        bad = [{"custom_id": "p", "method": "POST", "url": "/v1/responses",
                "body": {"input": "hi", "previous_response_id": "resp_1"}},
               {"custom_id": "b", "method": "POST", "url": "/v1/responses", "body": {"input": "hi", "background": True}}]
        f = client.files.create(file=("bad.jsonl", jsonl(bad)), purpose="batch")
        failed = client.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
        deadline = time.time() + 30
        while failed.status not in ("failed", "completed") and time.time() < deadline:
            time.sleep(0.2)
            failed = client.batches.retrieve(failed.id)
        errors = {e.line: e.message for e in failed.errors.data}
        assert failed.status == "failed" and "previous_response_id" in errors[1] and "background" in errors[2]
    finally:
        server.stop()


def test_bad_input_in_openais_shape(tmp_path):
    import openai

    url = f"sqlite://{tmp_path / 'queue.db'}"
    server = Served("fake", {**QUIET_GUARD, "NODEAGENT_HOME": str(tmp_path), "NODEAGENT_CONFIG": str(tmp_path / "c"),
                             "NODEAGENT_MAX_BATCH_BYTES": "5000"}, "--broker", url)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as big:
            client.files.create(file=("big.jsonl", jsonl(lines(100))), purpose="batch")
        assert big.value.status_code == 413
        with pytest.raises(openai.BadRequestError) as purpose:
            client.files.create(file=("x.jsonl", jsonl(lines(1))), purpose="fine-tune")
        assert purpose.value.body["param"] == "purpose"
        good = client.files.create(file=("x.jsonl", jsonl(lines(3))), purpose="batch")
        with pytest.raises(openai.BadRequestError) as endpoint:
            client.batches.create(input_file_id=good.id, endpoint="/v1/moderations", completion_window="24h")
        assert endpoint.value.body["param"] == "endpoint"
        with pytest.raises(openai.NotFoundError):
            client.batches.create(input_file_id="file-nope", endpoint="/v1/classify", completion_window="24h")
        # the whole file is checked first: each bad line with its number and code, nothing queued
        rows = lines(6)
        rows[1]["body"] = {"input": "no labels"}
        rows[3]["custom_id"] = "req-2"
        rows[4]["url"] = "/v1/extract"
        text = jsonl(rows) + b"this is not json\n"
        f = client.files.create(file=("bad.jsonl", text), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/classify", completion_window="24h")
        assert b.status == "failed" and b.failed_at
        errors = {(e.line, e.code) for e in b.errors.data}
        assert errors == {(2, "invalid_body"), (4, "duplicate_custom_id"), (5, "mismatched_url"),
                          (7, "invalid_json_line")}
        broker = open_broker(url, tmp_path)
        assert sum(s.ready + s.done for s in broker.stats()) == 0  # nothing queued
        chat = client.files.create(file=("m.jsonl", jsonl([{"custom_id": "a", "method": "POST",
                                                            "url": "/v1/chat/completions", "body": {
                                                                "model": "no-such-model",
                                                                "messages": [{"role": "user", "content": "hi"}]}}])),
                                   purpose="batch")
        b = client.batches.create(input_file_id=chat.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert b.status == "failed" and b.errors.data[0].code == "model_not_found"
        err = json_error(httpx.post(server.url + "/v1/batches", json={"input_file_id": good.id, "endpoint":
                                                                     "/v1/classify", "completion_window": "1y"}), 400)
        assert err["param"] == "completion_window"
    finally:
        server.stop()


def test_kill_9_of_a_worker_mid_batch_answers_each_line_once(url, tmp_path):
    broker = open_broker(url, tmp_path)
    service = Batches(broker)
    n = 60
    made = service.create(service.put_file(jsonl(lines(n)), "in.jsonl", "batch")["id"], "/v1/classify")
    a, b = workers(url, tmp_path, 2, "fake:latency_ms=60")
    deadline = time.time() + 30
    while time.time() < deadline and service.get(made["id"])["request_counts"]["completed"] < 10:
        time.sleep(0.05)
    a.send_signal(signal.SIGKILL)  # mid-task: its lease expires and the other worker takes the line over
    a.wait(10)
    try:
        end = time.time() + 90
        while time.time() < end and (done := service.get(made["id"]))["status"] != "completed":
            time.sleep(0.2)
    finally:
        stop([b])
    assert done["status"] == "completed" and done["request_counts"] == {"total": n, "completed": n, "failed": 0}
    out = [json.loads(x) for chunk in service.content(done["output_file_id"]) for x in chunk.decode().splitlines()]
    assert [r["custom_id"] for r in out] == [f"req-{i}" for i in range(n)]  # each once, in input order
    assert sum(s.done for s in broker.stats()) == n  # exactly one result each


TAKEOVER_S = 3.0  # NODEAGENT_BATCH_TAKEOVER_S of the servers below (15 s by default)


def test_kill_9_of_the_server_mid_expansion_queues_each_line_once(tmp_path):
    """The expansion is killed part-way; a restarted server takes it over (after NODEAGENT_BATCH_TAKEOVER_S of
    silence) and queues the rest: every custom_id exactly once."""
    import openai

    url = f"sqlite://{tmp_path / 'queue.db'}"
    broker = open_broker(url, tmp_path)
    service = Batches(broker)
    n = 6000
    file_id = service.put_file(jsonl(lines(n)), "in.jsonl", "batch")["id"]
    server = serve(url, tmp_path / "s1", env={"NODEAGENT_BATCH_TAKEOVER_S": str(TAKEOVER_S)})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    threading.Thread(target=lambda: _ignore(lambda: client.batches.create(
        input_file_id=file_id, endpoint="/v1/classify", completion_window="24h")), daemon=True).start()
    end = time.time() + 60
    while time.time() < end and not sum(s.ready for s in broker.stats()):
        time.sleep(0.005)
    server.proc.send_signal(signal.SIGKILL)  # at once: the expansion is under way (a few thousand lines to go)
    server.proc.wait(10)
    [batch] = service.list()
    queued = sum(s.ready for s in broker.stats())
    assert batch["status"] == "validating" and 0 < queued < n, (batch["status"], queued)
    again = serve(url, tmp_path / "s2", env={"NODEAGENT_BATCH_TAKEOVER_S": str(TAKEOVER_S)})
    try:
        end = time.time() + TAKEOVER_S + 60
        while time.time() < end and service.get(batch["id"])["status"] == "validating":
            time.sleep(0.5)
        assert service.get(batch["id"])["status"] == "in_progress"
        assert sum(s.ready for s in broker.stats()) == n  # each line queued once
        procs = workers(url, tmp_path, 2, "fake")
        try:
            end = time.time() + 120
            while time.time() < end and service.get(batch["id"])["status"] != "completed":
                time.sleep(0.3)
        finally:
            stop(procs)
        done = service.get(batch["id"])
        assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}
        assert sum(s.done for s in broker.stats()) == n
    finally:
        again.stop()


def _ignore(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001  (the server it talks to is killed under it)
        pass


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_cancel_stops_unstarted_lines_and_running_ones_finish(broker):
    clock = Clock()
    service = Batches(broker, clock=clock)
    made = service.create(service.put_file(jsonl(lines(30)), "in.jsonl", "batch")["id"], "/v1/classify")
    w = worker(broker, "fake:latency_ms=100", burst=False, queues=["classify.v1"])
    t = threading.Thread(target=w.run)
    t.start()
    try:
        end = time.time() + 30
        while time.time() < end and service.get(made["id"])["request_counts"]["completed"] < 3:
            time.sleep(0.02)
        cancelling = service.cancel(made["id"])
        assert cancelling["status"] in ("cancelling", "cancelled") and cancelling["cancelling_at"]
        end = time.time() + 30
        while time.time() < end and (b := service.get(made["id"]))["status"] != "cancelled":
            time.sleep(0.05)
    finally:
        w.stop()
        t.join(10)
    assert b["status"] == "cancelled" and b["cancelled_at"]
    c = b["request_counts"]
    assert 3 <= c["completed"] < 30 and c["completed"] + c["failed"] == 30
    err = [json.loads(x) for chunk in service.content(b["error_file_id"]) for x in chunk.decode().splitlines()]
    assert len(err) == c["failed"] and {r["error"]["code"] for r in err} == {"batch_cancelled"}
    out = [json.loads(x) for chunk in service.content(b["output_file_id"]) for x in chunk.decode().splitlines()]
    assert {r["custom_id"] for r in out}.isdisjoint({r["custom_id"] for r in err})
    assert service.cancel(made["id"])["status"] == "cancelled"  # cancelling again changes nothing


def test_expiry_ends_unstarted_lines_as_batch_expired(broker):
    clock = Clock()
    service = Batches(broker, clock=clock)
    made = service.create(service.put_file(jsonl(lines(20)), "in.jsonl", "batch")["id"], "/v1/classify",
                          completion_window="1h")
    assert made["expires_at"] == int(clock.now) + 3600
    w = worker(broker, "fake:latency_ms=100", burst=False, queues=["classify.v1"])  # a few lines in the window
    t = threading.Thread(target=w.run)
    t.start()
    end = time.time() + 30
    while time.time() < end and service.get(made["id"])["request_counts"]["completed"] < 5:
        time.sleep(0.01)
    w.stop()
    t.join(10)
    answered = service.get(made["id"])["request_counts"]["completed"]
    assert 5 <= answered < 20
    clock.now += 3601  # past the window
    b = service.get(made["id"])
    assert b["status"] == "expired" and b["expired_at"]
    c = b["request_counts"]
    assert c == {"total": 20, "completed": answered, "failed": 20 - answered}
    err = [json.loads(x) for chunk in service.content(b["error_file_id"]) for x in chunk.decode().splitlines()]
    assert len(err) == 20 - answered and {r["error"]["code"] for r in err} == {"batch_expired"}


def test_batch_queues_wait_for_interactive_work(broker):
    """Fairness: with a batch queued and interactive tasks arriving, the worker takes the interactive ones first."""
    from nodeagent.client import Client
    from nodeagent.tasks.contracts import ClassifyTask

    service = Batches(broker)
    made = service.create(service.put_file(jsonl(lines(20)), "in.jsonl", "batch")["id"], "/v1/classify")
    ids = [Client(broker).submit(ClassifyTask(input=f"now {i}", labels=["a", "b"])) for i in range(5)]
    w = worker(broker, "fake", queues=["classify.v1"])
    w.run()  # burst: everything
    interactive_starts = [broker.get(i).history[0].started_at for i in ids]
    batch_starts = [broker.get(f"{made['id']}-{i}").history[0].started_at for i in range(20)]
    assert max(interactive_starts) < min(batch_starts)


def test_cli_create_wait_show_list_results(tmp_path, isolated_env):
    url = f"sqlite://{tmp_path / 'queue.db'}"
    env = {**isolated_env, "NODEAGENT_BROKER": url}
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(lines(12, {3})))
    procs = workers(url, tmp_path, 1)
    try:
        made = json.loads(cli(["batch", "create", str(path), "--endpoint", "/v1/classify", "--wait", "--json"],
                              env).stdout)
    finally:
        stop(procs)
    assert made["status"] == "completed" and made["request_counts"] == {"total": 12, "completed": 11, "failed": 1}
    shown = json.loads(cli(["batch", "show", made["id"], "--json"], env).stdout)
    assert shown["id"] == made["id"] and shown["status"] == "completed"
    assert made["id"] in [b["id"] for b in json.loads(cli(["batch", "list", "--json"], env).stdout)]
    out = tmp_path / "out.jsonl"
    cli(["batch", "results", made["id"], "-o", str(out)], env)
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == \
        [f"req-{i}" for i in range(12) if i != 3]
    errors = cli(["batch", "results", made["id"], "--errors"], env).stdout.splitlines()
    assert [json.loads(x)["custom_id"] for x in errors] == ["req-3"]
    status = json.loads(cli(["status", "--json"], env).stdout)
    assert status["batches"][0]["id"] == made["id"]
    bad = cli(["batch", "show", "batch_nope"], env, check=False)
    assert bad.returncode != 0 and "no batch batch_nope" in bad.stderr and "Traceback" not in bad.stderr
    bad = cli(["batch", "cancel", made["id"]], env, check=False)
    assert bad.returncode == 2 and "only a validating or in-progress batch" in bad.stderr


def test_readme_batch_example_runs(tmp_path):
    """The documented batch run (docs/batches.md) with the openai client, as written (on this test's port)."""
    from test_worker import readme_block

    url = f"sqlite://{tmp_path / 'queue.db'}"
    procs = workers(url, tmp_path, 1, "fake")
    server = serve(url, tmp_path / "server")
    try:
        code = readme_block("<!-- batch-example -->", "docs/batches.md").replace("http://127.0.0.1:8400", server.url)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    finally:
        server.stop()
        stop(procs)
    assert proc.returncode == 0, proc.stderr
    first, *rest = proc.stdout.strip().splitlines()
    assert first == "completed 20 of 20"
    assert [r.split()[0] for r in rest] == [f"review-{i}" for i in range(20)]
    assert {r.split()[1] for r in rest} <= {"complaint", "praise"}


def test_the_sweep_reads_only_active_batches(broker):
    service = Batches(broker)
    done = service.create(service.put_file(jsonl(lines(2)), "a.jsonl", "batch")["id"], "/v1/classify")
    worker(broker, "fake", queues=["classify.v1"]).run()
    assert service.sweep() == 1 and service.get(done["id"])["status"] == "completed"
    service.create(service.put_file(jsonl(lines(2)), "b.jsonl", "batch")["id"], "/v1/classify")
    assert service.sweep() == 1  # the ended batch is no longer looked at
    assert [b["status"] for b in service.list()] == ["in_progress", "completed"]


def test_client_batch_and_a_chat_line_that_asks_too_much(broker):
    from nodeagent.client import Client

    client = Client(broker)
    w = worker(broker, "fake", burst=False, queues=["classify.v1"])
    t = threading.Thread(target=w.run)
    t.start()
    try:
        done = client.batch(lines(8), "/v1/classify", wait=True, timeout=60, poll_s=0.05)
    finally:
        w.stop()
        t.join(10)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 8
    out = b"".join(client.batches.content(done["output_file_id"])).decode().splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == [f"req-{i}" for i in range(8)]
    chat = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}},
            {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": "hi"}], "stream": True}},
            {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "x"}}}]
    failed = client.batch(chat, "/v1/chat/completions")
    assert failed["status"] == "failed"
    messages = {e["line"]: e["message"] for e in failed["errors"]["data"]}
    assert "top_logprobs" in messages[1] and "not streamed" in messages[2] and "audio" in messages[3]


def test_an_ended_batch_and_its_files_go_after_the_retention(broker):
    """A batch, its output and error files are kept as long as the results its output is made from
    (NODEAGENT_RESULT_RETENTION_S) once it ends, then go on their own; its input as long after the window it was
    given; an upload no batch used as long after it came. The files say when (``expires_at``). Nothing of the Batch
    API is kept for ever."""
    service = Batches(broker, keep_s=1)
    unused = service.put_file(jsonl(lines(2)), "spare.jsonl", "batch")
    assert unused["expires_at"] <= broker.now() + 1
    made = service.create(service.put_file(jsonl(lines(4)), "in.jsonl", "batch")["id"], "/v1/classify",
                          completion_window="1s")
    assert service.file(made["input_file_id"])["expires_at"] >= made["expires_at"]  # not before the batch ends
    worker(broker, queues=["classify.v1.batch"]).run()
    ended = service.get(made["id"])
    while ended["status"] not in ("completed", "expired"):  # a loaded machine may end it by its window
        time.sleep(0.2)
        ended = service.get(made["id"])
    outputs = [ended[k] for k in ("output_file_id", "error_file_id") if ended[k]]
    ended_at = ended["completed_at"] or ended["expired_at"]
    assert outputs
    for file_id in outputs:  # kept until the retention after the end, and says so; a loaded machine may read it late
        try:
            assert service.file(file_id)["expires_at"] <= broker.now() + 1
        except BatchError:
            assert broker.now() >= ended_at + service.keep_s - 1, "an output went before its retention"
    gone_by = max(made["expires_at"], ended_at) + service.keep_s + 1  # past the window, the end and the retention
    time.sleep(max(0.0, gone_by - broker.now()))
    broker.purge(older_than_s=3600)  # SQLite drops expired documents at a purge; Redis expired them already
    for file_id in (unused["id"], made["input_file_id"], *outputs):
        with pytest.raises(BatchError):
            service.file(file_id)
    with pytest.raises(BatchError):
        service.get(made["id"])
    assert service.list() == [] and service.files() == []


@pytest.mark.parametrize("engine", ["sqlite", "redis"])
def test_a_batch_that_outlasts_the_retention_completes_with_every_line(engine, tmp_path, request):
    """Lines finishing one at a time for longer than the retention (2 s here), the brokers purging as workers do:
    the batch completes (its lines finished early were not dropped before it ended), and its output file holds
    every line for as long as the file is listed (before the fix: in_progress for ever, 0 completed)."""
    if engine == "redis":
        import redis as redis_py

        server = request.getfixturevalue("redis_server")
        redis_py.Redis.from_url(server.url).flushall()
        broker = open_broker(server.url, tmp_path, retention_s=2)
    else:
        broker = open_broker(f"sqlite://{tmp_path / 'queue.db'}", tmp_path)
    service = Batches(broker, keep_s=2)
    made = service.create(service.put_file(jsonl(lines(10)), "in.jsonl", "batch")["id"], "/v1/classify")
    w = worker(broker, "fake:latency_ms=500", burst=False, queues=["classify.v1.batch"])
    t = threading.Thread(target=w.run)
    t.start()
    try:
        end = time.time() + 60
        while time.time() < end and (b := service.get(made["id"]))["status"] == "in_progress":
            broker.purge(older_than_s=2)
            time.sleep(0.2)
    finally:
        w.stop()
        t.join(10)
    assert b["status"] == "completed" and b["request_counts"] == {"total": 10, "completed": 10, "failed": 0}, b
    listed_until = service.file(b["output_file_id"])["expires_at"]
    while broker.now() < listed_until - 0.5:  # as long as the file is listed, every line is in it
        broker.purge(older_than_s=2)
        out = [json.loads(x) for chunk in service.content(b["output_file_id"]) for x in chunk.decode().splitlines()]
        assert [r["custom_id"] for r in out] == [f"req-{i}" for i in range(10)]
        time.sleep(0.3)
    broker.close()
