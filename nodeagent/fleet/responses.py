"""The stored Responses (``store``): what ``GET /v1/responses/{id}`` answers and ``previous_response_id`` continues
from, kept in the broker (so every gateway in front of it reads them), each for NODEAGENT_RESPONSES_KEEP_S, and
all of them within NODEAGENT_RESPONSES_MAX_COUNT and NODEAGENT_RESPONSES_MAX_BYTES: the oldest go first as a new
one is written (``Broker.kv_put`` with a bound), and one larger than the whole allowance is answered but not kept.
Beside ``batches.py``: the broker's documents of the OpenAI doors."""

from __future__ import annotations

import json
import logging
from typing import Any

from nodeagent.broker.base import Broker

log = logging.getLogger(__name__)
KEY = "response:"


class ResponseStore:
    def __init__(self, broker: Broker, keep_s: float, max_count: int, max_bytes: int) -> None:
        self.broker, self.keep_s, self.max_count, self.max_bytes = broker, keep_s, max_count, max_bytes

    def keep(self, response_id: str, stored: str) -> bool:
        """Keep a response (its JSON, as ``tasks/openai/responses.py``'s ``stored`` makes it); False when it is
        larger than the whole allowance and so is not kept."""
        if len(stored.encode("utf-8", "surrogatepass")) > self.max_bytes:
            log.warning("response %s is not stored: %d bytes, over NODEAGENT_RESPONSES_MAX_BYTES (%d)", response_id,
                        len(stored), self.max_bytes)
            return False
        self.broker.kv_put(KEY + response_id, stored, self.keep_s, bound=(self.max_count, self.max_bytes))
        return True

    def load(self, response_id: str) -> dict[str, Any] | None:
        text = self.broker.kv_get(KEY + response_id)
        return None if text is None else json.loads(text)

    def delete(self, response_id: str) -> None:
        self.broker.kv_delete(KEY + response_id)
