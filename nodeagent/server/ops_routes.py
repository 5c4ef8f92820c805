"""Operations: /healthz (the process is alive), /readyz (it can serve), /metrics (Prometheus)."""

from __future__ import annotations

from typing import Any

from nodeagent.server.served import Served


def router(served: Served) -> Any:
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, PlainTextResponse

    api = APIRouter()

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @api.get("/readyz")
    async def readyz() -> Any:
        """Whether requests can be served: a node's model loaded, its guard not tripped, its queue loop serving
        (with --broker); a gateway's broker answering, with a live node behind it."""
        ok, facts = await served.executor.ready()
        if not ok:
            return JSONResponse({"status": "not ready", **facts}, status_code=503)
        return {"status": "ready", **facts}

    @api.get("/metrics")
    async def prometheus() -> Any:
        return PlainTextResponse(served.metrics.render(), media_type="text/plain; version=0.0.4")

    return api
