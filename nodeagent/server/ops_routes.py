"""Operations: /healthz (the process is alive), /readyz (it can serve), /metrics (Prometheus)."""

from __future__ import annotations

from typing import Any

from nodeagent.server.state import Served


def router(served: Served) -> Any:
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, PlainTextResponse

    api = APIRouter()
    node, guard, worker = served.node, served.guard, served.worker

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @api.get("/readyz")
    async def readyz() -> Any:
        """The model is loaded, the guard is not tripped, and the queue's worker loop (with --broker) serves."""
        state = guard.state if guard is not None else "ok"
        queue = None if worker is None else ("serving" if worker.serving else
                                             "stopped" if worker.stopped.is_set() else "broker unreachable")
        loaded = node.loaded or served.models is not None  # a model set loads its models on demand
        if not loaded or state != "ok" or queue not in (None, "serving"):
            return JSONResponse({"status": "not ready", "loaded": loaded, "guard": state, "queue": queue},
                                status_code=503)
        return {"status": "ready", "model": served.model_id, "guard": state, "queue": queue}

    @api.get("/metrics")
    async def prometheus() -> Any:
        return PlainTextResponse(served.metrics.render(), media_type="text/plain; version=0.0.4")

    return api
