"""The OpenAI Batch API on the fleet's durable queue: files and batches kept in the broker's document store (so
any node's server, and the CLI, answers for any batch), a batch's lines expanded into queue tasks, its progress
read from those tasks, its output and error files made from their results in input order.

- **Files** (``file-<hex>``): an uploaded JSONL is stored whole in the broker; a batch's output and error files
  hold no copy of anything: their content is made from the tasks' results when it is read, so it cannot drift
  from them.
- **Validation first**: every line (``{custom_id, method, url, body}``) is checked before anything is queued: JSON,
  the endpoint, the body against its task contract (the same field table and validation as the routes), the
  model, duplicate ``custom_id``s. One bad line fails the batch with OpenAI's ``errors`` list, queueing nothing.
- **Expansion is idempotent**: line *i* is task ``<batch>-<i>`` with the idempotency key (batch, custom_id), so a
  server killed mid-expansion and started again (or another server, after NODEAGENT_BATCH_TAKEOVER_S of its
  silence) queues each line once.
- **The lifecycle is OpenAI's**, advanced by whoever looks (a route, the CLI, the servers' sweep) and written
  over the version read, so two servers never step on each other: validating -> in_progress -> finalizing ->
  completed; failed; expired (past the window: unstarted lines are cancelled and end as ``batch_expired``, and a
  line a worker claims past it meets its task's deadline, the window's end); cancelling -> cancelled (unstarted
  lines stop, running ones finish).
- A batch's tasks go to the ``<type>.batch`` queues, which workers take after the interactive ones.
"""

from __future__ import annotations

import codecs
import io
import json
import logging
import re
import uuid
from typing import Any, BinaryIO, Callable, Iterator

from pydantic import ValidationError

from nodeagent.broker.base import Broker, Envelope
from nodeagent.codes import code as code_of
from nodeagent.errors import ConflictError, NotFoundError, UsageError, validation_message
from nodeagent.payload import PayloadError
from nodeagent.tasks import registry
from nodeagent.tasks.contracts import wire
from nodeagent.tasks.openai.fields import Refused, check_metadata

log = logging.getLogger(__name__)

RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
# a batch's endpoint: the route of a task type that answers its Result (or OpenAI's body); /v1/responses lines run
# as the chat requests they translate to, /v1/embeddings lines as embed.v1 tasks (/v1/rerank is not one: its own
# door's shape)
ENDPOINTS = {**{r: t for r, t in registry.BY_ROUTE.items() if not t.own_door},
             RESPONSES: registry.BY_ROUTE["/v1/chat/completions"], EMBEDDINGS: registry.BY_ROUTE["/v1/embed"]}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
WINDOW = re.compile(r"^([1-9][0-9]{0,4})([smhd])$")
UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400
PUBLIC_FILE = ("id", "object", "bytes", "created_at", "expires_at", "filename", "purpose", "status",
               "status_details")


class BatchError(UsageError):
    """A request the Batch API refuses: its HTTP status, code and parameter go with it."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request", param: str | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status, self.code, self.param = status, code, param


def window_s(window: str) -> int:
    """A completion window in seconds: OpenAI's ``24h``, or any ``<n>s|m|h|d`` up to 7 days."""
    m = WINDOW.match(window or "")
    if not m or not 0 < int(m[1]) * UNITS_S[m[2]] <= MAX_WINDOW_S:
        raise BatchError(f"completion_window {window!r} is not a window: use 24h (or <n>s, m, h or d, up to 7d)",
                         param="completion_window")
    return int(m[1]) * UNITS_S[m[2]]


class Batches:
    """Files and batches over one broker. ``clock``: the broker's time, which a batch's times, its expiry and the
    takeover of its expansion are on (default ``broker.now``; injected by the tests of expiry)."""

    def __init__(self, broker: Broker, clock: Callable[[], float] | None = None, max_bytes: int = 200 << 20,
                 keep_s: float | None = None, takeover_s: float | None = None) -> None:
        """``keep_s``: how long an ended batch, its files and an unused upload are kept (NODEAGENT_RESULT_RETENTION_S:
        as long as the results its output is made from); ``takeover_s``: how long an expansion not heard from waits
        before the next server that looks takes it over (NODEAGENT_BATCH_TAKEOVER_S)."""
        from nodeagent.config import default_of

        self.broker, self.max_bytes = broker, max_bytes
        self.clock = clock or broker.now
        self.keep_s = float(keep_s if keep_s is not None else default_of("result_retention_s"))
        self.takeover_s = float(takeover_s if takeover_s is not None else default_of("batch_takeover_s"))

    # -- files ------------------------------------------------------------------------------------------------
    def put_file(self, content: bytes | BinaryIO, filename: str, purpose: str) -> dict[str, Any]:
        """An uploaded batch input file: its bytes, or a file it was spooled to (an upload: read once, in pieces,
        never held twice)."""
        if purpose != "batch":
            raise BatchError(f"purpose {purpose!r} is not served here: files are for batches (purpose batch)",
                             param="purpose")
        stream = io.BytesIO(content) if isinstance(content, bytes) else content
        decoder, blank, size = codecs.getincrementaldecoder("utf-8")(), True, 0  # checked in pieces, none kept
        try:
            while chunk := stream.read(1 << 20):
                size += len(chunk)
                if size > self.max_bytes:
                    raise BatchError(f"the file is over this node's limit of {self.max_bytes} bytes "
                                     "(NODEAGENT_MAX_BATCH_BYTES)", status=413, code="file_too_large", param="file")
                blank = blank and not decoder.decode(chunk).strip()
            blank = blank and not decoder.decode(b"", final=True).strip()
        except UnicodeDecodeError:
            raise BatchError("the file is not UTF-8 text: a batch file is JSONL", param="file") from None
        if blank:
            raise BatchError("the file is empty: a batch file holds one request per line", param="file")
        meta = {"id": f"file-{uuid.uuid4().hex[:24]}", "object": "file", "bytes": size,
                "created_at": int(self.clock()), "expires_at": self._kept_until(),
                "filename": filename or "input.jsonl", "purpose": purpose, "status": "processed",
                "status_details": None}
        self.broker.doc_put("file", meta["id"], meta, body=stream)  # its bytes as they came, read again from the file
        self.broker.doc_expire("file", meta["id"], meta["expires_at"])
        return meta

    def _kept_until(self, after_s: float = 0.0) -> int:
        """When something kept from now (and ``after_s`` more) goes: on the broker's time, which expires it."""
        return int(self.broker.now() + after_s + self.keep_s)

    def _keep_file(self, file_id: str, until: float) -> None:
        """A file kept until ``until`` (its object's ``expires_at`` says so), never sooner than it was."""
        for _ in range(10):
            found = self.broker.doc_get("file", file_id)
            if found is None or (found[0].get("expires_at") or 0) >= until:
                return
            if self.broker.doc_put("file", file_id, {**found[0], "expires_at": int(until)}, version=found[1]):
                self.broker.doc_expire("file", file_id, int(until))
                return

    def file(self, file_id: str) -> dict[str, Any]:
        found = self.broker.doc_get("file", file_id)
        if found is None:
            raise BatchError(f"no file {file_id}", status=404, code="not_found", param="file_id")
        return {k: found[0].get(k) for k in PUBLIC_FILE}

    def files(self, after: str | None = None, limit: int = 20, purpose: str | None = None) -> list[dict[str, Any]]:
        rows = self.broker.doc_list("file", after, limit)
        return [{k: r.get(k) for k in PUBLIC_FILE} for r in rows if purpose is None or r.get("purpose") == purpose]

    def delete_file(self, file_id: str) -> dict[str, Any]:
        self.file(file_id)
        self.broker.doc_delete("file", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    def content(self, file_id: str) -> Iterator[bytes]:
        """A file's bytes: an upload as stored; a batch's output or error file made from its tasks' results."""
        found = self.broker.doc_get("file", file_id)
        if found is None:
            raise BatchError(f"no file {file_id}", status=404, code="not_found", param="file_id")
        meta = found[0]
        if "source" not in meta:
            return iter([(self.broker.doc_body("file", file_id) or "").encode()])
        batch = self._batch_doc(meta["source"]["batch"])[0]
        return self._lines(batch, meta["source"]["errors"])

    # -- batches ----------------------------------------------------------------------------------------------
    @staticmethod
    def check(endpoint: str, completion_window: str) -> int:
        """The window in seconds; BatchError for an endpoint or window a batch cannot have (asked before an
        upload, so a bad request leaves no file behind)."""
        if endpoint not in ENDPOINTS:
            raise BatchError(f"endpoint {endpoint!r} is not one a batch can use: {', '.join(ENDPOINTS)}",
                             param="endpoint")
        return window_s(completion_window)

    def create(self, input_file_id: str, endpoint: str, completion_window: str = "24h",
               metadata: dict[str, str] | None = None, model: str | None = None) -> dict[str, Any]:
        window = self.check(endpoint, completion_window)
        try:
            check_metadata(metadata)
        except Refused as exc:  # the one translation of a Refused: into the Batch API's own error (the CLI's too)
            raise BatchError(str(exc), param=exc.param) from None
        meta = self.file(input_file_id)
        if meta["purpose"] != "batch":
            raise BatchError(f"file {input_file_id} is not a batch input file", param="input_file_id")
        now = int(self.clock())
        batch = {"id": f"batch_{uuid.uuid4().hex[:24]}", "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + window, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata, "model": model,
                 "usage": None, "x_expanding_at": self.clock()}
        self.broker.doc_put("batch", batch["id"], batch)
        self.broker.doc_put("active", batch["id"], {"id": batch["id"]})  # what the sweep looks at
        self._keep_file(input_file_id, self._kept_until(window))  # past any end of the batch
        return self._expand(batch["id"])

    def get(self, batch_id: str) -> dict[str, Any]:
        """The batch as it stands, advanced first (expansion taken over, expiry, finalization)."""
        return _public(self.advance(batch_id))

    def list(self, after: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        return [_public(self.advance(b["id"]) if b.get("status") in ACTIVE else b)
                for b in self.broker.doc_list("batch", after, limit)]

    def cancel(self, batch_id: str) -> dict[str, Any]:
        def step(b: dict[str, Any]) -> dict[str, Any] | None:
            if b["status"] not in ("validating", "in_progress"):
                return None
            return {**b, "status": "cancelling", "cancelling_at": int(self.clock())}

        batch = self._update(batch_id, step)
        if batch["status"] not in ("cancelling", "cancelled"):
            raise BatchError(f"batch {batch_id} is {batch['status']}: only a validating or in-progress batch can be "
                             "cancelled", status=409, code="conflict")
        return self.get(batch_id)

    def sweep(self) -> int:
        """Advance every active batch (the servers call it every few seconds); how many were looked at. Only
        the active ones are read: an ended batch leaves the index of active ones."""
        seen, after = 0, None
        while True:
            page = self.broker.doc_list("active", after, 100)
            for b in page:
                try:
                    self.advance(b["id"])
                except BatchError:  # gone
                    self.broker.doc_delete("active", b["id"])
                except Exception:  # noqa: BLE001  (one batch's trouble must not stop the sweep of the rest)
                    log.exception("advancing batch %s failed", b["id"])
                seen += 1
            if len(page) < 100:
                return seen
            after = page[-1]["id"]

    def advance(self, batch_id: str) -> dict[str, Any]:
        batch = self._batch_doc(batch_id)[0]
        if batch["status"] == "validating":
            if self.clock() - batch.get("x_expanding_at", 0) < self.takeover_s:
                return batch  # another server is expanding it
            return self._expand(batch_id)
        if batch["status"] not in ("in_progress", "finalizing", "cancelling"):
            return batch
        ids = _task_ids(batch)
        states = self.broker.states(ids)
        now = self.clock()
        expiring = batch.get("x_expiring") or (batch["status"] == "in_progress" and now >= batch["expires_at"])
        if batch["status"] == "cancelling" or expiring:
            for task_id in ids:  # unstarted lines stop; leased ones finish
                if states.get(task_id) in ("ready", "delayed") and self.broker.cancel(task_id):
                    states[task_id] = "cancelled"
                elif task_id not in states:  # never queued (its expansion stopped): it will not run
                    states[task_id] = "cancelled"
        counts = _counts(ids, states)

        def step(b: dict[str, Any]) -> dict[str, Any] | None:
            out = {**b, "request_counts": counts}
            if expiring and counts["completed"] < counts["total"]:
                out["x_expiring"] = True  # past the window with lines unanswered: it ends expired
            if counts["pending"] == 0 and b["status"] in ("in_progress", "cancelling", "finalizing"):
                ending = "cancelled" if b["status"] == "cancelling" else \
                    "expired" if out.get("x_expiring") else "completed"
                out.update(self._files(b, counts))
                out["finalizing_at"] = out.get("finalizing_at") or int(now)
                out["status"] = ending
                out[f"{ending}_at"] = int(now)
            return out

        return self._update(batch_id, step)

    # -- results as OpenAI's output and error files -----------------------------------------------------------
    def _files(self, batch: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for errors, key, n in ((False, "output_file_id", counts["completed"]), (True, "error_file_id",
                                                                             counts["failed"])):
            if batch.get(key) or not n:
                continue
            size = sum(len(chunk) for chunk in self._lines(batch, errors))
            meta = {"id": f"file-{uuid.uuid4().hex[:24]}", "object": "file", "bytes": size,
                    "created_at": int(self.clock()), "expires_at": None,
                    "filename": f"{batch['id']}_{'error' if errors else 'output'}.jsonl",
                    "purpose": "batch_output", "status": "processed", "status_details": None,
                    "source": {"batch": batch["id"], "errors": errors}}
            self.broker.doc_put("file", meta["id"], meta)
            out[key] = meta["id"]
        return out

    def _lines(self, batch: dict[str, Any], errors: bool) -> Iterator[bytes]:
        ids, custom = _task_ids(batch), batch["x_custom_ids"]
        expired = batch["status"] == "expired" or batch.get("x_expiring")
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            results = self.broker.results(chunk)
            states = self.broker.states(chunk) if errors else {}
            lines = []
            for i, task_id in enumerate(chunk, start):
                line = _line(task_id, custom[i], results.get(task_id), states.get(task_id), expired, batch["endpoint"])
                if line is not None and (line["error"] is not None or line["response"]["status_code"] != 200) == errors:
                    lines.append(json.dumps(line, ensure_ascii=False) + "\n")
            if lines:
                yield "".join(lines).encode()

    # -- expansion --------------------------------------------------------------------------------------------
    def _expand(self, batch_id: str) -> dict[str, Any]:
        """Validate every line, then queue them (idempotently); the batch then runs, or has failed."""
        claimed = self._update(batch_id, lambda b: {**b, "x_expanding_at": self.clock()}
                               if b["status"] == "validating" else None)
        if claimed["status"] != "validating":
            return claimed
        text = self.broker.doc_body("file", claimed["input_file_id"])
        if text is None:
            return self._fail(batch_id, [{"code": "file_not_found", "line": None, "param": "input_file_id",
                                          "message": f"the input file {claimed['input_file_id']} is gone"}])
        try:
            lines, errors = self._validate(text, claimed)
        except Exception as exc:  # noqa: BLE001  (whatever a line provokes, the batch ends failed, once)
            log.exception("batch %s: its lines could not be validated", batch_id)
            errors = [{"code": "invalid_file", "line": None, "param": None,
                       "message": f"the input file could not be validated: {type(exc).__name__}: {exc}"[:500]}]
        if errors:
            return self._fail(batch_id, errors)
        queue_of = registry.batch_queue(ENDPOINTS[claimed["endpoint"]].name)
        ids = [f"{batch_id}-{i}" for i in range(len(lines))]
        recorded = self._update(batch_id, lambda b: {
            **b, "x_custom_ids": [c for c, _, _ in lines], "x_tasks": len(lines),
            "request_counts": {"total": len(lines), "completed": 0, "failed": 0}} if b["status"] == "validating"
            else None)
        if recorded["status"] != "validating":
            return recorded  # cancelled meanwhile: nothing is queued
        beat = self.clock()
        for i, (custom_id, task, model) in enumerate(lines):
            if i % 100 == 99 and self._batch_doc(batch_id)[0]["status"] != "validating":
                break  # cancelled while queueing: the rest are never queued (and counted as stopped)
            envelope = Envelope.of(None, queue=queue_of, task_json=task, id=ids[i], model=model, batch=batch_id,
                                   index=i, idempotency_key=f"{batch_id}:{custom_id}",
                                   deadline=float(claimed["expires_at"]), created_at=self.clock())
            try:
                self.broker.enqueue(envelope)
            except ConflictError:
                pass  # queued by an expansion before this one
            if self.clock() - beat > self.takeover_s / 3:  # still at it: no other server takes it over
                beat = self.clock()
                self._update(batch_id, lambda b: {**b, "x_expanding_at": beat})
        return self._update(batch_id, lambda b: {**b, "status": "in_progress", "in_progress_at": int(self.clock())}
                            if b["status"] == "validating" else None)

    def _validate(self, text: str, batch: dict[str, Any]) -> tuple[list[tuple[str, dict, str | None]], list[dict]]:
        """Each line as (custom_id, task fields, model), or OpenAI's errors (line numbers from 1)."""
        spec = ENDPOINTS[batch["endpoint"]]
        served = self._served_models()
        lines: list[tuple[str, dict, str | None]] = []
        errors: list[dict[str, Any]] = []
        seen: set[str] = set()

        def bad(n: int, code: str, message: str, param: str | None = None) -> None:
            if len(errors) < 1000:
                errors.append({"code": code, "message": message, "param": param, "line": n})

        for n, raw in enumerate(text.splitlines(), 1):
            if not raw.strip():
                continue
            try:
                from nodeagent import payload

                line = payload.loads(raw)
            except (PayloadError, ValueError) as exc:
                bad(n, "invalid_json_line", f"line {n} is not JSON: {exc}"[:300])
                continue
            if not isinstance(line, dict) or not {"custom_id", "method", "url", "body"} <= set(line):
                bad(n, "invalid_request", "a line is {custom_id, method, url, body}")
                continue
            custom_id, body = line["custom_id"], line["body"]
            if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
                bad(n, "invalid_custom_id", "custom_id is a string of 1 to 512 characters", "custom_id")
                continue
            if custom_id in seen:
                bad(n, "duplicate_custom_id", f"custom_id {custom_id!r} is on an earlier line too", "custom_id")
                continue
            seen.add(custom_id)
            if line["method"] != "POST":
                bad(n, "invalid_method", f"method {line['method']!r}: a batch line is a POST", "method")
            elif line["url"] != batch["endpoint"]:
                bad(n, "mismatched_url", f"url {line['url']!r} is not the batch's endpoint {batch['endpoint']}",
                    "url")
            elif not isinstance(body, dict):
                bad(n, "invalid_body", "body is the request's JSON object", "body")
            else:
                body, refused = _responses_line(body) if batch["endpoint"] == RESPONSES else \
                    _embeddings_line(body) if batch["endpoint"] == EMBEDDINGS else (body, None)
                named = body.pop("model", None) if batch["endpoint"] == EMBEDDINGS and refused is None else None
                task, model, problem = self._task(spec, body, named or batch.get("model"), served) \
                    if refused is None else ({}, None, ("invalid_body", refused, "body"))
                if problem is not None:
                    bad(n, problem[0], problem[1], problem[2])
                else:
                    lines.append((custom_id, task, model))
        if not lines and not errors:
            errors.append({"code": "empty_file", "message": "the input file holds no request", "param": None,
                           "line": None})
        return lines, errors

    def _task(self, spec: Any, body: dict[str, Any], model: str | None, served: set[str] | None
              ) -> tuple[dict, str | None, tuple[str, str, str | None] | None]:
        model = body.get("model") if spec.openai and body.get("model") else model
        if model is not None and served is not None and model not in served:
            return {}, None, ("model_not_found", f"no node on this broker serves the model {model!r}", "model")
        try:
            task = spec.contract.model_validate({"request": body} if spec.openai else body)
        except ValidationError as exc:
            return {}, None, ("invalid_body", validation_message(exc), "body")
        return {k: v for k, v in wire(task).items() if k != "id"}, model, None

    def _served_models(self) -> set[str] | None:
        """Every model name a node on this broker answers to (None when no node has registered yet: a batch may
        be queued before its workers start)."""
        nodes = self.broker.nodes()
        if not nodes:
            return None
        return {name for node in nodes for name in (node.models or []) + [node.model or ""] if name}

    # -- the document, written over the version read -------------------------------------------------------------
    def _batch_doc(self, batch_id: str) -> tuple[dict[str, Any], int]:
        found = self.broker.doc_get("batch", batch_id)
        if found is None:
            raise BatchError(f"no batch {batch_id}", status=404, code="not_found", param="batch_id")
        return found

    def _update(self, batch_id: str, step: Callable[[dict[str, Any]], dict[str, Any] | None]) -> dict[str, Any]:
        """``step`` over the batch as it is; None: no change. Read again and step again when another writer won."""
        for _ in range(50):
            batch, version = self._batch_doc(batch_id)
            new = step(batch)
            if new is None or new == batch:
                return batch
            if self.broker.doc_put("batch", batch_id, new, version=version):
                if new["status"] not in ACTIVE:
                    self.broker.doc_delete("active", batch_id)
                    self._ended(new)
                return new
        raise ConflictError(f"batch {batch_id} kept changing under this writer", hint="try again")

    def _ended(self, batch: dict[str, Any]) -> None:
        """An ended batch is kept, with its output and error files, a retention from its end; then it goes. The
        line results its files are made from are kept as long (``broker.keep``): a line finished early counts its
        retention from the window's end while the batch runs (``broker.base.kept_from``), and from the batch's end
        once it ends, so a batch that outlasts the retention still completes with every line in its files. (Its
        input file goes at the end of the window it was given, and as long again: another batch may use the same
        file.)"""
        until = self._kept_until()
        self.broker.keep(_task_ids(batch), self.broker.now())
        self.broker.doc_expire("batch", batch["id"], until)
        for key in ("output_file_id", "error_file_id"):
            if batch.get(key):
                self._keep_file(batch[key], until)

    def _fail(self, batch_id: str, errors: list[dict[str, Any]]) -> dict[str, Any]:
        return self._update(batch_id, lambda b: {**b, "status": "failed", "failed_at": int(self.clock()),
                                                 "errors": {"object": "list", "data": errors}})


def _task_ids(batch: dict[str, Any]) -> list[str]:
    return [f"{batch['id']}-{i}" for i in range(batch.get("x_tasks", 0))]


def _counts(ids: list[str], states: dict[str, str]) -> dict[str, int]:
    done = sum(states.get(i) == "done" for i in ids)
    failed = sum(states.get(i) in ("dead", "cancelled") for i in ids)
    return {"total": len(ids), "completed": done, "failed": failed, "pending": len(ids) - done - failed}


def _public(batch: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in batch.items() if not k.startswith("x_")}
    out["request_counts"] = {k: batch["request_counts"][k] for k in ("total", "completed", "failed")}
    return out


def _line(task_id: str, custom_id: str, result: Any, state: str | None, expired: bool, endpoint: str
          ) -> dict[str, Any] | None:
    """A line of the output file (an ok result) or of the error file (a failed or stopped line); None while the
    line is still to run."""
    ident = f"batch_req_{task_id}"
    if result is not None and result.status == "ok":
        body = result.output if ENDPOINTS[endpoint].openai else result.model_dump(mode="json")
        if endpoint == RESPONSES:
            from nodeagent.tasks.openai import responses as rapi

            body = rapi.response_object("resp_" + task_id.replace("-", "_"), body.get("model", ""), {},
                                                 chat_body=body)
        elif endpoint == EMBEDDINGS:
            from nodeagent.tasks.openai.embeddings import embeddings_body

            body = embeddings_body(result, result.model or "")
        return {"id": ident, "custom_id": custom_id, "response": {"status_code": 200, "request_id": task_id,
                                                                  "body": body}, "error": None}
    if result is not None:
        e = result.error
        if expired and e.code == "deadline_exceeded":
            return _stopped(ident, custom_id, "batch_expired")
        return {"id": ident, "custom_id": custom_id, "response": {
            "status_code": code_of(e.code).http_status, "request_id": task_id,
            "body": {"error": {"message": e.message, "type": "invalid_request_error" if code_of(e.code).fault == "task"
                               else "server_error", "param": None, "code": e.code}}}, "error": None}
    if state == "cancelled":
        return _stopped(ident, custom_id, "batch_expired" if expired else "batch_cancelled")
    return None


def _embeddings_line(body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A /v1/embeddings line's body as the embed.v1 task it runs as (its model kept for the line's binding), or
    what is wrong with it."""
    from nodeagent.tasks.contracts import wire
    from nodeagent.tasks.openai.embeddings import embed_task

    try:
        request, task = embed_task(body)
    except ValueError as exc:
        return body, str(exc)
    return {**{k: v for k, v in wire(task).items() if k not in ("id", "type")},
            **({"model": request.model} if request.model else {})}, None


def _responses_line(body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A /v1/responses line's body as the chat request it runs as, or what is wrong with it (a refused field; a
    continuation: batch lines are not stored, so previous_response_id has nothing to continue)."""
    from nodeagent.tasks.openai import responses as rapi

    try:
        rapi.check(body)
        if body.get("previous_response_id") is not None:
            return body, ("previous_response_id: a batch line has no stored response to continue (send the "
                          "conversation as input)")
        return rapi.to_chat({k: v for k, v in body.items() if k != "store"}).chat, None
    except ValueError as exc:
        return body, str(exc)


def _stopped(ident: str, custom_id: str, why: str) -> dict[str, Any]:
    message = ("the batch's completion window ended before this request ran" if why == "batch_expired" else
               "the batch was cancelled before this request ran")
    return {"id": ident, "custom_id": custom_id, "response": None, "error": {"code": why, "message": message}}


__all__ = ["BatchError", "Batches", "ENDPOINTS", "NotFoundError", "window_s"]
