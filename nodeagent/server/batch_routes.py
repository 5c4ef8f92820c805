"""The OpenAI Batch API over the fleet's queue: ``/v1/files`` and ``/v1/batches`` (``fleet/batches.py`` does the
work; this router parses and answers in OpenAI's shapes). They need the server to be on a broker
(``--broker``): a batch is spread over every worker of the broker, and any node's server answers for it."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request  # routes resolve their annotations from this module's names

from nodeagent.errors import HttpError
from nodeagent.fleet.batches import BatchError, Batches
from nodeagent.server.middleware import json_body
from nodeagent.server.served import Served
from nodeagent.tasks.openai.fields import BATCHES

LIST_LIMIT = 20  # a page of a list when the request names no limit
FILES_MOST, BATCHES_MOST = 10000, 100  # the most one page holds, as OpenAI's


def limit_of(text: str | None, most: int) -> int:
    """A list's ``?limit=``, parsed once: a whole number from 1 to ``most`` (none: LIST_LIMIT); anything else is a 400
    in one line naming it, as OpenAI answers (a huge number is never read whole)."""
    if text is None or text == "":
        return LIST_LIMIT
    digits = text.lstrip("0") if text.isascii() and text.isdigit() else ""
    if not digits or len(digits) > len(str(most)) or int(digits) > most:
        raise HttpError(400, f"limit must be a whole number from 1 to {most}, not {text[:24]!r}",
                        code="invalid_request", param="limit")
    return int(digits)


def router(served: Served) -> Any:
    from fastapi import APIRouter
    from fastapi.responses import StreamingResponse

    api = APIRouter()

    def service() -> Batches:
        if served.broker is None:
            raise HttpError(404, "batches run on the fleet's queue: start the server with --broker (or a worker's "
                                 "NODEAGENT_BROKER) to serve /v1/files and /v1/batches", "invalid_request_error",
                            "not_found")
        return served.batch_service()

    async def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except BatchError as exc:
            raise HttpError(exc.status, str(exc), "invalid_request_error", exc.code, param=exc.param) from None

    def page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
        """A page of a list, in OpenAI's shape (``after`` takes its last_id), from ``limit`` + 1 items asked for: the
        one past the page says there are more."""
        more, data = len(data) > limit, data[:limit]
        return {"object": "list", "data": data, "has_more": more,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}

    @api.post("/v1/files")
    async def upload(request: Request) -> Any:
        """Upload a batch input file (multipart: ``file`` and ``purpose=batch``)."""
        form = await request.form(max_part_size=served.config.max_batch_bytes)
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise HttpError(400, "the upload needs a file part named file", code="invalid_request", param="file")
        if not isinstance(purpose, str):
            raise HttpError(400, "the upload needs purpose=batch", code="invalid_request", param="purpose")
        return await call(service().put_file, upload.file, upload.filename or "input.jsonl", purpose)  # on disk

    @api.get("/v1/files")
    async def files(after: str | None = None, limit: str | None = None, purpose: str | None = None) -> Any:
        n = limit_of(limit, FILES_MOST)
        return page(await call(service().files, after or None, n + 1, purpose), n)

    @api.get("/v1/files/{file_id}")
    async def file(file_id: str) -> Any:
        return await call(service().file, file_id)

    @api.delete("/v1/files/{file_id}")
    async def delete(file_id: str) -> Any:
        return await call(service().delete_file, file_id)

    @api.get("/v1/files/{file_id}/content")
    async def content(file_id: str) -> Any:
        """The file's bytes; a batch's output or error file is made from its results as it streams."""
        chunks = await call(service().content, file_id)

        async def stream() -> Any:
            iterator = iter(chunks)
            while True:
                chunk = await asyncio.to_thread(next, iterator, None)
                if chunk is None:
                    return
                yield chunk

        return StreamingResponse(stream(), media_type="application/jsonl")

    @api.post("/v1/batches")
    async def create(request: Request) -> Any:
        await request.body()  # read (and parsed once, off the event loop) by the middleware
        body = json_body(request)
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object", code="invalid_request")
        BATCHES.check(body)  # the one field table (tasks/openai/fields.py): an unknown field is its 400
        for name in ("input_file_id", "endpoint"):
            if not isinstance(body.get(name), str):
                raise HttpError(400, f"{name} is required", code="invalid_request", param=name)
        return await call(service().create, body["input_file_id"], body["endpoint"],
                          body.get("completion_window") or "24h", body.get("metadata"))

    @api.get("/v1/batches")
    async def batches(after: str | None = None, limit: str | None = None) -> Any:
        n = limit_of(limit, BATCHES_MOST)
        return page(await call(service().list, after or None, n + 1), n)

    @api.get("/v1/batches/{batch_id}")
    async def batch(batch_id: str) -> Any:
        return await call(service().get, batch_id)

    @api.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request) -> Any:
        """Through the one operator API (``fleet/controls.py``): recorded in the fleet's event log, with who."""
        from nodeagent.fleet.controls import cancel_batch

        who = f"api {request.client.host if request.client else '?'}"
        batches = service()  # the 404 without a broker
        return await call(cancel_batch, served.broker, batch_id, who, batches)

    return api
