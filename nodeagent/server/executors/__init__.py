"""The executors: what runs a request the door checked. Both doors' routes take one ``Executor`` (as vLLM's serving
classes take one ``EngineClient``, in process or remote): ``local.py`` runs it on a node this process holds
(`nodeagent serve`), ``fleet.py`` puts it on the fleet's durable queue for a node that serves its model
(`nodeagent gateway`). The routes never ask which one they have."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from nodeagent.errors import HttpError
from nodeagent.tasks.contracts import Result
from nodeagent.tasks.events import Event
from nodeagent.tasks.openai.spec import CompletionSpec


@dataclass(frozen=True)
class Call:
    """A completion request the door checked: what an executor needs to run it."""

    spec: CompletionSpec  # the request as a node runs it (a local executor's way in)
    raw: dict[str, Any]  # the request as it came (what a gateway queues)
    request: Any = None  # the HTTP request (its headers: the client's own time limit)


class Executor(Protocol):
    """What a door asks of whatever runs its requests."""

    async def models(self) -> list[tuple[str, dict[str, Any]]]:
        """Every model it answers for: (id, its entry's fields, ``names`` among them)."""

    def resolve(self, model: str | None) -> str:
        """The name an answer to a request naming ``model`` carries; ``not_found(model)`` raised for a name it does
        not answer to."""

    def not_found(self, model: str | None) -> HttpError:
        """The one 404 for a model it does not answer for."""

    async def ready(self) -> tuple[bool, dict[str, Any]]:
        """Whether requests can be served now, and the facts /readyz shows."""

    def completion(self, call: Call) -> AsyncIterator[Event]:
        """The request's events (``server/events.py``): Prepared, Pieces, then Finished or Failed."""

    async def task(self, task: Any, model: str | None = None) -> Result:
        """A typed task (extract.v1, classify.v1, embed.v1) run to its Result, on ``model`` where a request names
        one."""

    def close(self) -> None:
        """Its threads and connections released (the app's shutdown)."""
