"""GET /health (and HEAD, and /ping), /metrics, /version and /v1/models."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from dsinfer.server.context import ServingContext

router = APIRouter()
_STARTED = int(time.time())


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> Response:
    engine = request.app.state.ctx.engine
    if engine.dead:
        return JSONResponse({"status": "dead"}, status_code=503)
    if engine.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.api_route("/ping", methods=["GET", "POST", "HEAD"])
async def ping(request: Request) -> Response:
    """Liveness for load balancers (as vLLM's /ping): the same answer as /health."""
    return await health(request)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    return Response(ctx.metrics.render(ctx.engine.stats), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version(request: Request) -> dict:
    return {"version": request.app.state.ctx.settings.version}


def _model_card(ctx: ServingContext, name: str) -> dict:
    """vLLM's model card: ``root`` is the model's own name (not its path on this machine), ``permission`` the
    fixed one entry vLLM gives."""
    root = getattr(ctx.engine.model_config, "served_model_name", None) or name
    permission = {
        "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, name).hex}",
        "object": "model_permission",
        "created": _STARTED,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {"id": name, "object": "model", "created": _STARTED, "owned_by": "dsinfer", "root": root,
            "parent": None, "max_model_len": ctx.max_model_len, "permission": [permission]}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    ctx: ServingContext = request.app.state.ctx
    return {"object": "list", "data": [_model_card(ctx, name) for name in ctx.served_names]}


@router.get("/v1/models/{name:path}")
async def model(request: Request, name: str) -> dict:
    """One model (``client.models.retrieve``); a name this server does not serve is a 404."""
    ctx: ServingContext = request.app.state.ctx
    ctx.check_model(name, strict=True)
    return _model_card(ctx, name)
