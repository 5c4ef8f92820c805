"""The typed routes: one per task type of the registry (``/v1/extract``, ``/v1/classify``), taking the task's
contract and answering its Result (an error Result when the task failed)."""

from __future__ import annotations

import json
from typing import Any

from nodeagent.server.state import Served
from nodeagent.tasks import registry
from nodeagent.tasks.contracts import Result


def router(served: Served) -> Any:
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    api = APIRouter()

    async def typed(task: Any) -> Any:
        result: Result = await served.in_thread(served.node.run, task)
        served.metrics.task(result)
        return JSONResponse(json.loads(result.model_dump_json()))

    for spec in registry.TYPES:
        async def endpoint(task: Any) -> Any:
            return await typed(task)

        endpoint.__annotations__ = {"task": spec.contract, "return": Any}
        endpoint.__doc__ = f"Run a {spec.name} task; the Result (an error Result when the task failed)."
        api.post(spec.route, response_model=Result, name=spec.kind)(endpoint)
    return api
