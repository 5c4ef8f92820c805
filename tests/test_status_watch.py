"""`nodeagent status --watch` as a user runs it, in a child process on a SQLite queue in a temporary home: with
--json it prints one JSON document per refresh, a line each, flushed; a task queued between two refreshes shows in
a later one; Ctrl-C (SIGINT) ends it with exit code 0 and no traceback. Piped without --json, each refresh's tables
print one after another."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import cli

from nodeagent.broker.open import open_broker
from nodeagent.client import Client
from nodeagent.config import load
from nodeagent.node import make_task

DEADLINE_S = 30.0  # for a refresh every 0.3 s: generous for a loaded 2-core machine


def start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, queue.Queue]:
    """`nodeagent ARGS` with its stdout lines handed to a queue as they come (None at the end)."""
    proc = subprocess.Popen([sys.executable, "-m", "nodeagent", *args], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def next_line(lines: queue.Queue, proc: subprocess.Popen) -> str:
    try:
        line = lines.get(timeout=DEADLINE_S)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"no refresh in {DEADLINE_S:g} s") from None
    assert line is not None, f"it ended early: {proc.wait()}, {proc.stderr.read() if proc.stderr else ''}"
    return line


def ready(doc: dict, name: str = "classify.v1") -> int:
    return next((q["ready"] for q in doc["queues"] if q["queue"] == name), 0)


def interrupt(proc: subprocess.Popen) -> tuple[int, str]:
    """Ctrl-C: SIGINT, as a terminal sends it; the exit code and stderr."""
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("Ctrl-C did not stop it") from None
    return proc.returncode, err


def test_watch_json_prints_a_line_per_refresh_follows_the_queue_and_ctrl_c_exits_0(isolated_env, tmp_path: Path):
    config = load(env=isolated_env)
    broker = open_broker(config.broker, config.state_dir)  # the queue the command opens: queue.db in the home
    proc, lines = start(["status", "--watch", "--json", "--interval", "0.3"], isolated_env)
    try:
        first = json.loads(next_line(lines, proc))
        assert {"nodes", "queues", "alerts", "ledger"} <= set(first) and ready(first) == 0
        second = json.loads(next_line(lines, proc))  # a refresh: the same view again, a line of its own
        assert ready(second) == 0
        task_id = Client(broker).submit(make_task("classify", input="between refreshes", labels=["a", "b"]))
        end, seen = time.monotonic() + DEADLINE_S, []
        while time.monotonic() < end:
            doc = json.loads(next_line(lines, proc))  # every line is a whole JSON document
            seen.append(ready(doc))
            if seen[-1] == 1:
                break
        assert seen and seen[-1] == 1, f"the queued task {task_id} never showed: ready counts {seen}"
    finally:
        code, err = interrupt(proc)
        broker.close()
    assert code == 0, err
    assert "Traceback" not in err, err


def test_watch_piped_prints_each_refresh_after_the_last(isolated_env):
    """Not a terminal: rich's Live would print only the final view, so each refresh is printed in turn."""
    proc, lines = start(["status", "--watch", "--interval", "0.3"], isolated_env)
    try:
        heads, end = 0, time.monotonic() + DEADLINE_S
        while heads < 2 and time.monotonic() < end:
            heads += next_line(lines, proc).startswith("nodeagent status at ")
    finally:
        code, err = interrupt(proc)
    assert heads >= 2, "fewer than two refreshes printed"
    assert code == 0 and "Traceback" not in err, err


def test_interval_without_watch_is_a_one_line_error(isolated_env):
    proc = cli(["status", "--interval", "5"], isolated_env, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[0] == "error: --interval sets how often --watch refreshes"
