"""build_app: the FastAPI application on one AsyncEngine."""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware

from dsinfer.entrypoints.async_engine import AsyncEngine
from dsinfer.server import (
    anthropic_messages,
    health,
    load,
    openai_chat,
    openai_completions,
    openai_responses,
    tokenize,
)
from dsinfer.server.context import ServingContext
from dsinfer.server.errors import REQUEST_ID_KEY, InternalErrors, family_for, install_error_handlers
from dsinfer.server.generation import ClientDisconnected
from dsinfer.server.guard import GuardMiddleware
from dsinfer.server.metrics import StatusCounter
from dsinfer.server.openapi import install_openapi
from dsinfer.server.settings import ServerSettings


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The app serves ``engine`` (started on app startup, stopped on shutdown)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(
        title="dsinfer",
        version=settings.version,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",  # the schema, for client generators and schemathesis (no docs pages)
    )
    app.state.ctx = ctx = ServingContext(engine, settings)
    app.state.replica_constants = load.replica_constants(getattr(engine, "engine", None))  # /load's fixed facts
    for module in (openai_chat, openai_completions, openai_responses, anthropic_messages, tokenize, health, load):
        app.include_router(module.router)
    install_error_handlers(app)
    install_openapi(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    app.add_middleware(InternalErrors)  # innermost: its 500s pass the middlewares below like any answer
    app.add_middleware(load.KVFlush, wait_saves=lambda: engine.wait_kv_saves())  # the router's prefill answers
    app.add_middleware(GuardMiddleware, settings=settings, is_draining=lambda: engine.draining)
    app.add_middleware(StatusCounter, metrics=ctx.metrics)
    # outside the guard, so that its 401/413 replies carry the ids too
    app.add_middleware(RequestIdHeaders)
    if settings.cors_allowed_origins is not None:
        # outside the guard: a browser's preflight carries no API key, and a 401 needs the CORS headers to be read
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_allowed_origins),
                           allow_methods=list(settings.cors_allowed_methods),
                           allow_headers=list(settings.cors_allowed_headers),
                           allow_credentials=settings.cors_allow_credentials)
    if settings.root_path:
        app.add_middleware(RootPath, root_path=settings.root_path)
    return app


class RootPath:
    """vLLM's --root-path (FastAPI's root_path): behind a proxy that serves this app under a prefix, a request path
    may come with the prefix or without it (a proxy that strips it). The prefix is taken off here, outermost, so that
    the guard's public paths and the metrics' path labels see the same paths as without a proxy; uvicorn's own
    root_path would instead prepend it to every path."""

    def __init__(self, app, root_path: str):
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            path, raw, root = scope["path"], scope.get("raw_path"), self.root_path
            scope = {**scope, "root_path": root}
            if path == root or path.startswith(root + "/"):
                scope["path"] = path[len(root):] or "/"
                if raw is not None and raw.startswith(root.encode()):  # raw_path keeps the percent-encoding
                    scope["raw_path"] = raw[len(root):] or b"/"
        await self.app(scope, receive, send)


class RequestIdHeaders:
    """Request ids on every response, streams and errors included, added here rather than in each route:
    ``x-request-id`` as vLLM's --enable-request-id-headers (the client's X-Request-Id echoed, else a new id), and
    on Anthropic's API (/v1/messages, and /v1/models for an Anthropic client) Anthropic's ``request-id: req_...``,
    which its SDK exposes as ``message._request_id`` and ``APIStatusError.request_id``. Anthropic's error bodies
    carry that id as ``request_id`` too: it is left in the scope (``REQUEST_ID_KEY``) for them."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        new_id = uuid.uuid4().hex
        added = [(b"x-request-id", (headers.get("x-request-id") or new_id).encode("latin-1"))]
        if family_for(scope["path"], headers) == "anthropic":
            added.append((b"request-id", f"req_{new_id}".encode()))
            scope = {**scope, REQUEST_ID_KEY: f"req_{new_id}"}

        async def send_with_ids(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        await self.app(scope, receive, send_with_ids)
