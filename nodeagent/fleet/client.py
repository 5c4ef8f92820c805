"""The orchestrator's side: submit typed tasks, fan them out, fan the results back in, wait, cancel.

    from nodeagent.client import Client

    client = Client("redis://queue-host:6379/0")          # or Client() for this machine's SQLite queue
    fan = client.map([ClassifyTask(input=t, labels=["bug", "question"]) for t in texts], max_in_flight=8)
    for index, result in fan.ok:          # successes, in submission order
        ...
    for index, result in fan.failed:      # failures, listed apart: never merged into the successes
        ...

Any Python orchestrator can use it (Prefect, Airflow, a script); orchestrators in other languages enqueue
with plain Redis commands (``schemas/redis-contract.md``).
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta
from typing import Any, Iterable

from pydantic import Field

from nodeagent.broker.base import Broker, Envelope, TaskView
from nodeagent.broker.open import open_broker
from nodeagent.clock import pause
from nodeagent.errors import ErrorInfo, NodeAgentError, NotFoundError, TaskFailed
from nodeagent.tasks.contracts import BATCH_SUFFIX, AnyTask, Result
from nodeagent.values import Frozen

CANCELLED = "cancelled before it finished (by an operator, or by the gateway whose client went away)"
FORGOTTEN = "the broker no longer knows the task (expired or purged after the retention)"


class WaitTimeout(NodeAgentError):
    """A task did not finish within the time the caller waited."""

    exit_code = 14


class FanIn(Frozen):
    """The results of a fan-out, in submission order, with failures kept apart."""

    task_ids: list[str | None] = Field(description="By submission index; None where it was never submitted")
    results: list[Result | None] = Field(description="By submission index; None where none came (``why``). A "
                                                     "cancelled task's is an error Result, code ``cancelled``")
    why: list[str | None] = Field(default_factory=list, description="By submission index: why no result came "
                                                                    "(None where one did)")

    @property
    def ok(self) -> list[tuple[int, Result]]:
        return [(i, r) for i, r in enumerate(self.results) if r is not None and r.status == "ok"]

    @property
    def failed(self) -> list[tuple[int, Result]]:
        return [(i, r) for i, r in enumerate(self.results) if r is not None and r.status != "ok"]

    @property
    def missing(self) -> list[int]:
        return [i for i, r in enumerate(self.results) if r is None]


class Client:
    def __init__(self, broker: Broker | str | None = None, state_dir: Any = None,
                 max_attempts: int | None = None) -> None:
        """``broker``: a Broker, a URL, or None for NODEAGENT_BROKER (default: this machine's SQLite queue).
        ``max_attempts``: the default for submitted tasks (NODEAGENT_MAX_ATTEMPTS, 4)."""
        from nodeagent.config import load

        config = load()
        if broker is None or isinstance(broker, str):
            broker = open_broker(broker or config.broker, state_dir or config.state_dir, config=config)
        self.broker: Broker = broker
        self.max_attempts = max_attempts or config.max_attempts

    def submit(self, task: AnyTask, *, model: str | None = None, idempotency_key: str | None = None,
               deadline: datetime | timedelta | float | None = None, max_attempts: int | None = None,
               batch: str | None = None, index: int | None = None) -> str:
        """Enqueue a task; the same idempotency key returns the first task's id and enqueues nothing.
        ``deadline``: an instant (a datetime, or Unix seconds), or a timedelta from now on the broker's clock (this
        machine's own clock may be off; the workers compare deadlines on the broker's)."""
        key = idempotency_key or task.idempotency_key
        now = self.broker.now()
        if isinstance(deadline, timedelta):
            when: float | None = now + deadline.total_seconds()
        else:
            when = deadline.timestamp() if isinstance(deadline, datetime) else deadline
        if when is None and task.deadline is not None:
            when = task.deadline.timestamp()
        envelope = Envelope.of(task, id=task.id, model=model, idempotency_key=key, deadline=when, batch=batch,
                               index=index, max_attempts=max_attempts or self.max_attempts, created_at=now)
        return self.broker.enqueue(envelope)

    def get(self, task_id: str) -> TaskView:
        view = self.broker.get(task_id)
        if view is None:
            raise NotFoundError(f"no task {task_id}", hint="check the id, and that this is the same broker")
        return view

    def wait(self, task_id: str, timeout: float | None = None, poll_s: float = 0.02) -> Result:
        """The task's Result (an error Result for a task that failed for good, or was cancelled: code
        ``cancelled``); NotFoundError for a task the broker does not know (never, or no longer: purged after the
        retention); WaitTimeout past ``timeout``."""
        end = None if timeout is None else time.monotonic() + timeout
        delay = poll_s
        while True:
            result = self.broker.result(task_id)
            if result is not None:
                return result
            view = self.broker.get(task_id)
            if view is None:
                raise NotFoundError(f"no task {task_id}: {FORGOTTEN}, or it was never submitted to this broker",
                                    hint="check the id, and that this is the same broker")
            if view.state in ("done", "dead"):  # it ended since the result was read: read it again
                result = view.result or self.broker.result(task_id)
            ended = _ended(task_id, view.queue.removesuffix(BATCH_SUFFIX), view.state, result, view.attempts)
            if ended is not None:
                if isinstance(ended, str):
                    raise NotFoundError(f"task {task_id}: {ended}", hint="check the retention "
                                        "(NODEAGENT_RESULT_RETENTION_S) against how long the result is wanted")
                return ended
            if end is not None and time.monotonic() >= end:
                raise WaitTimeout(f"task {task_id} is still {view.state} after {timeout:g} s",
                                  hint=f"see 'nodeagent tasks show {task_id}'")
            pause(delay)
            delay = min(delay * 1.5, 0.5)

    def cancel(self, task_id: str) -> bool:
        return self.broker.cancel(task_id)

    def embed(self, texts: list[str] | str, *, model: str | None = None, dimensions: int | None = None,
              timeout: float | None = None) -> list[list[float]]:
        """A vector per text from an embedding model of the fleet (one ``embed.v1`` task, its inputs in one of the
        node's forward batches): the floats, in order. ``TaskFailed`` (its code) for a task that failed."""
        from nodeagent.tasks.contracts import EmbedOutput, EmbedTask

        result = self.wait(self.submit(EmbedTask(input=texts, dimensions=dimensions), model=model), timeout)
        if result.status != "ok":
            assert result.error is not None
            raise TaskFailed(result.error.code, result.error.message, result.error.retryable)
        out = result.output if isinstance(result.output, EmbedOutput) else EmbedOutput.model_validate(result.output)
        return out.vectors()

    def register_labelled_set(self, labels: list[Any], items: list[dict[str, str]]) -> str:
        """Register texts labelled with ``labels`` (names, or {"name", "description"}) for the whole fleet: a
        classify task with these labels that names no model and brings no examples is answered by the route
        measured on them (``fleet/labelled_sets.py``); its id. A later set for the same labels replaces it."""
        from nodeagent.fleet.labelled_sets import LabelledSet, register

        return register(self.broker, LabelledSet.model_validate({"labels": labels, "items": items}))

    def map(self, tasks: Iterable[AnyTask], *, max_in_flight: int = 8, model: str | None = None,
            timeout: float | None = None, poll_s: float = 0.02) -> FanIn:
        """Fan out with at most ``max_in_flight`` tasks queued or running at once; fan in by submission index.
        Every way a task ends ends its wait: done or dead (its Result), cancelled (an error Result, code
        ``cancelled``), gone from the broker (missing, with ``why``); past ``timeout`` the rest are missing."""
        batch = uuid.uuid4().hex
        pending = list(enumerate(tasks))
        types = {i: task.type for i, task in pending}
        n = len(pending)
        pending.reverse()
        ids: dict[int, str] = {}
        results: dict[int, Result] = {}
        why: dict[int, str] = {}
        in_flight: dict[int, str] = {}
        end = None if timeout is None else time.monotonic() + timeout
        while pending or in_flight:
            while pending and len(in_flight) < max_in_flight:
                i, task = pending.pop()
                ids[i] = in_flight[i] = self.submit(task, model=model, batch=batch, index=i)
            for i, ended in self._ended(in_flight, types).items():
                del in_flight[i]
                if isinstance(ended, str):
                    why[i] = ended
                else:
                    results[i] = ended
            if end is not None and time.monotonic() >= end:
                break
            if in_flight:
                pause(poll_s)
        for i in range(n):
            if i not in results and i not in why:
                why[i] = f"not ended within {timeout:g} s" if i in ids else f"not submitted within {timeout:g} s"
        return FanIn(task_ids=[ids.get(i) for i in range(n)], results=[results.get(i) for i in range(n)],
                     why=[why.get(i) for i in range(n)])

    def _ended(self, in_flight: dict[int, str], types: dict[int, str]) -> dict[int, Result | str]:
        """The tasks in flight that ended, by index: a Result, or why none will come. The states are read before
        the results, so a task the states call ended has its result in the read after."""
        states = self.broker.states(list(in_flight.values()))
        got = self.broker.results(list(in_flight.values()))
        out: dict[int, Result | str] = {}
        for i, task_id in in_flight.items():
            state = states.get(task_id)
            view = self.broker.get(task_id) if state == "cancelled" and task_id not in got else None
            ended = _ended(task_id, types[i], state, got.get(task_id), view.attempts if view else 0)
            if ended is not None:
                out[i] = ended
        return out

    @property
    def batches(self) -> Any:
        """The Batch API on this broker (``fleet/batches.py``): files, create, get, list, cancel, content."""
        from nodeagent.fleet.batches import Batches

        if getattr(self, "_batches", None) is None:
            self._batches = Batches(self.broker)
        return self._batches

    def batch(self, requests: Iterable[dict[str, Any]] | bytes, endpoint: str, *, model: str | None = None,
              completion_window: str = "24h", metadata: dict[str, str] | None = None, wait: bool = False,
              timeout: float | None = None, poll_s: float = 0.5) -> dict[str, Any]:
        """A batch of requests (OpenAI's lines ``{custom_id, method, url, body}``, or a JSONL file's bytes) on
        the queue; with ``wait``, the ended batch (WaitTimeout past ``timeout``). ``client.batches.content(id)``
        reads its output and error files."""
        import json as _json

        data = requests if isinstance(requests, bytes) else \
            "".join(_json.dumps(r, ensure_ascii=False) + "\n" for r in requests).encode()
        service = self.batches
        service.check(endpoint, completion_window)
        made = service.create(service.put_file(data, "batch.jsonl", "batch")["id"], endpoint, completion_window,
                              metadata, model=model)
        end = None if timeout is None else time.monotonic() + timeout
        while wait and made["status"] not in ("completed", "failed", "expired", "cancelled"):
            if end is not None and time.monotonic() >= end:
                raise WaitTimeout(f"batch {made['id']} is still {made['status']} after {timeout:g} s",
                                  hint=f"see 'nodeagent batch show {made['id']}'")
            pause(poll_s)
            made = service.get(made["id"])
        return made

    def close(self) -> None:
        self.broker.close()


def _ended(task_id: str, task_type: str, state: str | None, result: Result | None,
           attempts: int = 0) -> Result | str | None:
    """How a task stands for a caller waiting on it: its Result once it has one; an error Result (code
    ``cancelled``) once cancelled; why no result will come, once the broker no longer knows it or lost its
    result; None while it may still run. ``state``: None for a task the broker does not know."""
    if result is not None:
        return result
    if state == "cancelled":
        return Result(task_id=task_id, type=task_type, status="error", attempts=attempts,
                      error=ErrorInfo(code="cancelled", message=f"task {task_id} was {CANCELLED}", retryable=False))
    if state is None:
        return FORGOTTEN
    if state in ("done", "dead"):
        return f"the task ended {state} but its result is gone (expired or purged after the retention)"
    return None
