"""The typed routes: one per task type of the registry (``/v1/extract``, ``/v1/classify``, ``/v1/embed``), taking the
task's contract and answering its Result (an error Result when the task failed). A request may name the model that
runs it (``model``, as on OpenAI's routes, and as a queued task's envelope does): a member of `serve`'s model set, or
a model of the fleet through the gateway; a name nothing serves is OpenAI's 404. A client that goes away gives its
task up: on a node it stops at its next step and frees its slot; through the queue it is cancelled. Beside them, the
fleet's labelled sets (``/v1/classify/sets``: register, read, delete), which a classify task naming no model and
bringing no examples is measured on (``fleet/labelled_sets.py``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request

from nodeagent.errors import HttpError
from nodeagent.fleet import labelled_sets
from nodeagent.fleet.labelled_sets import LabelledSet
from nodeagent.server.openai_routes import until_gone
from nodeagent.server.served import Served
from nodeagent.tasks import registry
from nodeagent.tasks.contracts import Result


def router(served: Served) -> Any:
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    api = APIRouter()

    async def typed(task: Any, request: Any, model: str | None) -> Any:
        executor = served.executor
        if task.idempotency_key:  # the queue honours the key: the same key again answers the first task's Result
            executor = served.queue_executor()
            if executor is None:
                raise HttpError(400, "idempotency_key needs a queue to be honoured: start `nodeagent serve` with "
                                     "--broker (the same key then returns the first task's result)",
                                code="unsupported_parameter", param="idempotency_key")
        if model is not None:
            executor.resolve(model)  # a name it does not serve: the 404, before anything runs
        result: Result = await until_gone(request, executor.task(task, model))
        served.metrics.task(result)
        request.state.access = {"prompt_tokens": result.tokens.prompt, "completion_tokens": result.tokens.generated}
        if result.error is not None:
            request.state.code = result.error.code
        return JSONResponse(json.loads(result.model_dump_json()))

    def fleet_broker() -> Any:
        if served.broker is None:
            raise HttpError(404, "labelled sets are the fleet's, kept in its queue: start the server with --broker, "
                                 "or ask the gateway", "invalid_request_error", "not_found")
        return served.broker

    @api.post("/v1/classify/sets")
    async def register_set(body: LabelledSet) -> Any:
        """Register a labelled set for its label set, for the whole fleet: a classify task with these labels that
        names no model and brings no examples is answered by the route measured on it (a later set replaces it)."""
        key = await asyncio.to_thread(labelled_sets.register, fleet_broker(), body)
        return {"id": key, "object": "labelled_set", "labels": [lb.name for lb in body.labels],
                "items": len(body.items)}

    @api.get("/v1/classify/sets/{set_id}")
    async def read_set(set_id: str) -> Any:
        found = await asyncio.to_thread(labelled_sets.read, fleet_broker(), set_id)
        if found is None:
            raise HttpError(404, f"no labelled set {set_id!r} is registered", "invalid_request_error", "not_found")
        return {"id": set_id, "object": "labelled_set", **found.model_dump(mode="json")}

    @api.delete("/v1/classify/sets/{set_id}")
    async def delete_set(set_id: str) -> Any:
        return {"id": set_id, "object": "labelled_set.deleted",
                "deleted": await asyncio.to_thread(labelled_sets.delete, fleet_broker(), set_id)}

    for spec in [t for t in registry.TYPES if not (t.openai or t.own_door)]:  # (those: openai_routes.py)
        async def endpoint(body: Any, request: Request, contract: Any = spec.contract) -> Any:
            task = contract.model_validate(body.model_dump(exclude={"model"}, exclude_unset=True, by_alias=True))
            return await typed(task, request, body.model)

        endpoint.__annotations__ = {"body": named(spec.contract), "request": Request, "return": Any}
        endpoint.__doc__ = f"Run a {spec.name} task; the Result (an error Result when the task failed)."
        api.post(spec.route, response_model=Result, name=spec.role)(endpoint)
    return api


def named(contract: Any) -> Any:
    """The typed route's body: the task's contract and the model that runs it (``model``: not a field of the task,
    which the queue routes by its envelope)."""
    from pydantic import Field, create_model

    return create_model(f"{contract.__name__}Request", __base__=contract, __doc__=contract.__doc__,
                        model=(str | None, Field(None, max_length=200, description="The model that runs it (as on "
                                                                                   "OpenAI's routes): a member of "
                                                                                   "the node's set, or of the fleet")))
