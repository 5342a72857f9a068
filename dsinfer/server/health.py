"""GET /health (and HEAD, and /ping), /metrics, /version and /v1/models."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from dsinfer.protocol.errors import ProtocolError
from dsinfer.server.context import ServingContext
from dsinfer.server.errors import speaks_anthropic

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


def _anthropic_model(ctx: ServingContext, name: str) -> dict:
    """Anthropic's model object (its SDK's ``ModelInfo``): ``created_at`` is an RFC 3339 time; the SDK's type
    requires ``lifecycle`` too. A prompt must leave room for one output token, so both limits are the context
    less one (max_tokens also under --generation-config's max_new_tokens when it sets a ceiling)."""
    created = datetime.fromtimestamp(_STARTED, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    room = ctx.max_model_len - 1
    max_tokens = min(room, ctx.max_tokens_limit) if ctx.max_tokens_limit else room
    return {"type": "model", "id": name, "display_name": name, "created_at": created, "lifecycle": "active",
            "max_input_tokens": room, "max_tokens": max_tokens}


def _anthropic_page(ctx: ServingContext, query: Mapping[str, str]) -> dict:
    """Anthropic's cursor page: ``limit`` (1 to 1000, default 20) models after ``after_id`` or before
    ``before_id``; its SDK's auto-pagination asks again with ``after_id=last_id`` while ``has_more``."""
    names = list(ctx.served_names)
    raw_limit = query.get("limit", "20")
    try:
        limit = int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= 1000:
        raise ProtocolError(f"limit must be an integer from 1 to 1000, got {raw_limit!r}", param="limit")
    after, before = query.get("after_id"), query.get("before_id")
    if after is not None and before is not None:
        raise ProtocolError("give after_id or before_id, not both", param="before_id")
    if after is not None:  # a cursor this server never listed starts nothing: an empty page, not the first one
        rest = names[names.index(after) + 1:] if after in names else []
        page, has_more = rest[:limit], len(rest) > limit
    elif before is not None:
        rest = names[:names.index(before)] if before in names else []
        page, has_more = rest[-limit:], len(rest) > limit
    else:
        page, has_more = names[:limit], len(names) > limit
    return {"data": [_anthropic_model(ctx, name) for name in page], "has_more": has_more,
            "first_id": page[0] if page else None, "last_id": page[-1] if page else None}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    """OpenAI's list, or Anthropic's page for an Anthropic client (its SDK calls this same path)."""
    ctx: ServingContext = request.app.state.ctx
    if speaks_anthropic(request.headers):
        return _anthropic_page(ctx, request.query_params)
    return {"object": "list", "data": [_model_card(ctx, name) for name in ctx.served_names]}


@router.get("/v1/models/{name:path}")
async def model(request: Request, name: str) -> dict:
    """One model (``client.models.retrieve``), in the client's API's shape; a name this server does not serve is a
    404 (in that API's envelope: see errors.family_for)."""
    ctx: ServingContext = request.app.state.ctx
    ctx.check_model(name, strict=True)
    return _anthropic_model(ctx, name) if speaks_anthropic(request.headers) else _model_card(ctx, name)
