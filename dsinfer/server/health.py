"""GET /health, /metrics, /version and /v1/models."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from dsinfer.server.context import ServingContext

router = APIRouter()
_STARTED = int(time.time())


@router.get("/health")
async def health(request: Request) -> Response:
    engine = request.app.state.ctx.engine
    if engine.dead:
        return JSONResponse({"status": "dead"}, status_code=503)
    if engine.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    return Response(ctx.metrics.render(ctx.engine.stats), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version(request: Request) -> dict:
    return {"version": request.app.state.ctx.settings.version}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    ctx: ServingContext = request.app.state.ctx
    names = ctx.settings.served_model_names or (ctx.model_name,)
    data = [
        {
            "id": name,
            "object": "model",
            "created": _STARTED,
            "owned_by": "dsinfer",
            "max_model_len": ctx.max_model_len,
        }
        for name in names
    ]
    return {"object": "list", "data": data}
