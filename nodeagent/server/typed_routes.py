"""The typed routes: one per task type of the registry (``/v1/extract``, ``/v1/classify``), taking the task's
contract and answering its Result (an error Result when the task failed)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request

from nodeagent.errors import HttpError
from nodeagent.server.served import Served
from nodeagent.tasks import registry
from nodeagent.tasks.contracts import Result


def router(served: Served) -> Any:
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    api = APIRouter()

    async def typed(task: Any, request: Any) -> Any:
        if task.idempotency_key and served.node is not None:
            result: Result = await queued(task)
        else:
            result = await served.executor.task(task)
        served.metrics.task(result)
        request.state.access = {"prompt_tokens": result.tokens.prompt, "completion_tokens": result.tokens.generated}
        if result.error is not None:
            request.state.code = result.error.code
        return JSONResponse(json.loads(result.model_dump_json()))

    async def queued(task: Any) -> Result:
        """A task with an idempotency key goes through the queue, which honours the key: the same key again
        returns the first task's Result (whichever node ran it)."""
        if served.broker is None:
            raise HttpError(400, "idempotency_key needs a queue to be honoured: start `nodeagent serve` with "
                                 "--broker (the same key then returns the first task's result)",
                            code="unsupported_parameter", param="idempotency_key")
        from nodeagent.fleet.client import Client, WaitTimeout

        client = Client(served.broker)
        limit = served.node.timeout_s(task.type)
        task_id = await asyncio.to_thread(client.submit, task)
        try:
            return await asyncio.to_thread(client.wait, task_id, limit * 2)
        except WaitTimeout:
            raise HttpError(504, f"the queued task {task_id} did not finish within {limit * 2:g} s; `nodeagent tasks "
                                 f"show {task_id}` follows it", "server_error", "timeout") from None

    for spec in [t for t in registry.TYPES if not t.openai]:  # chat and completion: OpenAI's routes
        async def endpoint(task: Any, request: Request) -> Any:
            return await typed(task, request)

        endpoint.__annotations__ = {"task": spec.contract, "request": Request, "return": Any}
        endpoint.__doc__ = f"Run a {spec.name} task; the Result (an error Result when the task failed)."
        api.post(spec.route, response_model=Result, name=spec.kind)(endpoint)
    return api
