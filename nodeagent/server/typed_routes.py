"""The typed routes: one per task type of the registry (``/v1/extract``, ``/v1/classify``, ``/v1/embed``), taking the
task's contract and answering its Result (an error Result when the task failed). A client that goes away gives its
task up: on a node it stops at its next step and frees its slot; through the queue it is cancelled."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from nodeagent.errors import HttpError
from nodeagent.server.openai_routes import until_gone
from nodeagent.server.served import Served
from nodeagent.tasks import registry
from nodeagent.tasks.contracts import Result


def router(served: Served) -> Any:
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    api = APIRouter()

    async def typed(task: Any, request: Any) -> Any:
        executor = served.executor
        if task.idempotency_key:  # the queue honours the key: the same key again answers the first task's Result
            executor = served.queue_executor()
            if executor is None:
                raise HttpError(400, "idempotency_key needs a queue to be honoured: start `nodeagent serve` with "
                                     "--broker (the same key then returns the first task's result)",
                                code="unsupported_parameter", param="idempotency_key")
        result: Result = await until_gone(request, executor.task(task))
        served.metrics.task(result)
        request.state.access = {"prompt_tokens": result.tokens.prompt, "completion_tokens": result.tokens.generated}
        if result.error is not None:
            request.state.code = result.error.code
        return JSONResponse(json.loads(result.model_dump_json()))

    for spec in [t for t in registry.TYPES if not t.openai]:  # chat and completion: OpenAI's routes
        async def endpoint(task: Any, request: Request) -> Any:
            return await typed(task, request)

        endpoint.__annotations__ = {"task": spec.contract, "request": Request, "return": Any}
        endpoint.__doc__ = f"Run a {spec.name} task; the Result (an error Result when the task failed)."
        api.post(spec.route, response_model=Result, name=spec.role)(endpoint)
    return api
