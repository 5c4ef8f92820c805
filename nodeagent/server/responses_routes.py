"""``/v1/responses``: OpenAI's Responses API on `serve` and the gateway, through the same door as chat. A body is
checked against its own field table (``tasks/openai/responses.py``), translated to the chat request it runs as, run
by the same executor (a node this process holds, or the fleet's queue as a chat task), and the chat answer is
rendered back as a ``response`` object, whole or as the Responses stream's events (``server/response_events.py``).

``store``: where there is a broker (`serve --broker`, the gateway), a response is kept there for
NODEAGENT_RESPONSES_KEEP_S within NODEAGENT_RESPONSES_MAX_COUNT and _MAX_BYTES (``fleet/responses.py``; the
default: stored; ``store: false`` keeps nothing), with the conversation that led to it, so ``previous_response_id``
continues it and ``GET``/``DELETE /v1/responses/{id}`` work on any gateway of the fleet. Without a broker nothing is
kept: ``previous_response_id`` is a 400 that says so.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Request  # routes resolve their annotations from this module's names

from nodeagent.errors import HttpError
from nodeagent.fleet.responses import ResponseStore
from nodeagent.server import events as ev
from nodeagent.server import response_events
from nodeagent.server.openai_routes import Door
from nodeagent.server.served import Served
from nodeagent.tasks.openai import responses as rapi
from nodeagent.tasks.openai.fields import RESPONSES_NAMES

log = logging.getLogger(__name__)


def router(served: Served, door: Door) -> Any:
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, StreamingResponse

    api = APIRouter()

    def broker_or_404() -> Any:
        if served.broker is None:
            raise HttpError(404, "responses are not stored here: this server has no broker (serve --broker, or a "
                                 "gateway, keeps them)", "invalid_request_error", "not_found")
        return served.broker

    def store() -> ResponseStore:
        c = served.config
        return ResponseStore(broker_or_404(), c.responses_keep_s, c.responses_max_count, c.responses_max_bytes)

    async def load(response_id: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(store().load, response_id)

    async def keep(response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        try:
            await asyncio.to_thread(store().keep, response["id"], rapi.stored(response, messages))
        except Exception as exc:  # noqa: BLE001  (the answer stands; only its keeping failed)
            log.warning("response %s not stored: %s", response["id"], exc)

    @api.post("/v1/responses")
    async def create(request: Request) -> Any:
        """A response: the input (a string, or message and function-call items) answered as chat is, whole or
        streamed; stored where there is a broker."""
        raw = await door.body_of(request)
        rapi.check(raw)  # Refused: a 400 naming the field
        notes: list[str] = []
        store = served.broker is not None if raw.get("store") is None else bool(raw["store"])
        if store and served.broker is None:
            store = False
            notes.append("store: this server has no broker, so the response is not kept (serve --broker keeps it)")
        earlier = None
        if raw.get("previous_response_id") is not None:
            if served.broker is None:
                raise HttpError(400, "previous_response_id needs stored responses, and this server has no broker: "
                                     "send the whole conversation as input, or run serve --broker or a gateway",
                                code="invalid_value", param="previous_response_id")
            kept = await load(str(raw["previous_response_id"]))
            if kept is None:
                raise HttpError(400, f"Previous response with id '{raw['previous_response_id']}' not found (never "
                                     "stored, deleted, or older than NODEAGENT_RESPONSES_KEEP_S)",
                                code="previous_response_not_found", param="previous_response_id")
            earlier = kept["conversation"]
        translated = rapi.to_chat(raw, earlier)  # Refused: a 400 naming the Responses request's field
        try:
            call = door.call("chat", translated.chat, request)
        except HttpError as exc:
            raise exc.renamed(RESPONSES_NAMES) from None
        response_id = rapi.new_id()
        model = door.executor.resolve(call.spec.model)
        if not call.spec.stream:
            try:
                done = await door.whole(call, request)
            except HttpError as exc:
                raise exc.renamed(RESPONSES_NAMES) from None
            response = rapi.response_object(response_id, model, translated.echo, chat_body=done.body, store=store)
            if store:
                await keep(response, rapi.conversation(translated, done.body))
            return JSONResponse(response, headers=ev.headers(done.notes + tuple(notes), done))
        try:
            head, events = await door.streamed(call, request)
        except HttpError as exc:
            raise exc.renamed(RESPONSES_NAMES) from None
        out = response_events.ResponseEvents(response_id, model, translated.echo, store)

        async def body() -> Any:
            try:
                async for b in ev.stream(out, head, events):
                    yield b
                if store and out.final is not None and out.answer is not None:  # the response as it ended
                    await keep(out.final, rapi.conversation(translated, out.answer))
            finally:  # the client went away mid-stream: the executor stops its work
                await events.aclose()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers=ev.headers(head.notes + tuple(notes),
                                                    head if isinstance(head, ev.Finished) else None))

    @api.get("/v1/responses/{response_id}")
    async def get(response_id: str) -> Any:
        """A stored response, as it was answered."""
        kept = await load(response_id)
        if kept is None:
            raise HttpError(404, f"No response found with id '{response_id}'", "invalid_request_error", "not_found")
        return kept["response"]

    @api.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Any:
        """A stored response deleted (a later previous_response_id naming it is a 400)."""
        if await load(response_id) is None:
            raise HttpError(404, f"No response found with id '{response_id}'", "invalid_request_error", "not_found")
        await asyncio.to_thread(store().delete, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return api
