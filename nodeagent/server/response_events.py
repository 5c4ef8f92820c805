"""The Responses API's streamed events, rendered from the same event sequence as a chat stream
(``server/events.py``): what the openai package's ``responses.stream()`` assembles, in OpenAI's order, each with
its ``sequence_number``:

``response.created``, ``response.in_progress``; for text, ``response.output_item.added`` (a message),
``response.content_part.added``, ``response.output_text.delta`` ..., then ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; for each function call,
``response.output_item.added``, ``response.function_call_arguments.delta`` and ``.done``,
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete`` when the answer was cut at
``max_output_tokens``). A failure after the first event ends the stream with an ``error`` event and
``response.failed``, the error in the Responses request's names. The final response is read off the same whole
chat answer as a non-streamed one. ``ResponseEvents`` is a ``Renderer`` of ``server/events.py``, whose one driver
streams it.
"""

from __future__ import annotations

import json
from typing import Any

from nodeagent.errors import HttpError
from nodeagent.tasks.events import Finished, Piece, Prepared
from nodeagent.tasks.openai import responses as rapi
from nodeagent.tasks.openai.fields import RESPONSES_NAMES


class ResponseEvents:
    """One streamed response's events, numbered."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any], store: bool) -> None:
        self.id, self.model, self.echo, self.store = response_id, model, echo, store
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output items begun, in order
        self.text: str | None = None  # the message being written (None: no message open)
        self.final: dict[str, Any] | None = None  # the finished response (what a stored one keeps)
        self.answer: dict[str, Any] | None = None  # the chat answer it was read off

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def _response(self, status: str, **kw: Any) -> dict[str, Any]:
        return rapi.response_object(self.id, self.model, self.echo, status=status, store=self.store, **kw)

    def begin(self, p: Prepared) -> list[bytes]:
        r = self._response("in_progress")
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _open_message(self) -> list[bytes]:
        self.text = ""
        item = rapi.message_item(self.id, None, "in_progress")
        self.items.append(item)
        index = len(self.items) - 1
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _close_message(self) -> list[bytes]:
        if self.text is None:
            return []
        index = len(self.items) - 1
        item = rapi.message_item(self.id, self.text, "completed")
        self.items[index] = item
        part = item["content"][0]
        out = [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=self.text, logprobs=[]),
               self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
               self._event("response.output_item.done", output_index=index, item=item)]
        self.text = None
        return out

    def piece(self, p: Piece) -> list[bytes]:
        if p.index != 0:
            return []
        if p.what == "content":
            out = self._open_message() if self.text is None else []
            self.text = (self.text or "") + p.value
            return out + [self._event("response.output_text.delta", item_id=self.items[-1]["id"],
                                      output_index=len(self.items) - 1, content_index=0, delta=p.value, logprobs=[])]
        out = self._close_message()
        for call in p.value:
            added = rapi.call_item(call, "in_progress", arguments="")
            self.items.append(added)
            index = len(self.items) - 1
            done = rapi.call_item(call, "completed")
            out += [self._event("response.output_item.added", output_index=index, item=added),
                    self._event("response.function_call_arguments.delta", item_id=added["id"], output_index=index,
                                delta=done["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=added["id"], output_index=index,
                                name=done["name"], arguments=done["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=done)]
            self.items[index] = done
        return out

    def end(self, finished: Finished) -> list[bytes]:
        out = self._close_message()
        self.answer = finished.body
        self.final = self._response_done(finished.body)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return out + [self._event(kind, response=self.final)]

    def _response_done(self, chat_body: dict[str, Any]) -> dict[str, Any]:
        return rapi.response_object(self.id, self.model, self.echo, chat_body=chat_body, store=self.store,
                                    output=list(self.items) or None)

    def failed(self, error: HttpError) -> list[bytes]:
        body = error.renamed(RESPONSES_NAMES).body()["error"]
        failed = self._response("failed", output=list(self.items))
        failed["error"] = {"code": body.get("code") or "server_error", "message": body.get("message", "")}
        return [self._event("error", code=body.get("code"), message=body.get("message", ""), param=body.get("param")),
                self._event("response.failed", response=failed)]
