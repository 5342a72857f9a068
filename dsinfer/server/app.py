"""build_app: the FastAPI application on one AsyncEngine."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response

from dsinfer.entrypoints.async_engine import AsyncEngine
from dsinfer.server import (
    anthropic_messages,
    health,
    openai_chat,
    openai_completions,
    openai_responses,
    tokenize,
)
from dsinfer.server.context import ServingContext
from dsinfer.server.errors import install_error_handlers
from dsinfer.server.generation import ClientDisconnected
from dsinfer.server.guard import GuardMiddleware
from dsinfer.server.metrics import StatusCounter
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
        openapi_url=None,
    )
    app.state.ctx = ctx = ServingContext(engine, settings)
    for module in (openai_chat, openai_completions, openai_responses, anthropic_messages, tokenize, health):
        app.include_router(module.router)
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    app.add_middleware(GuardMiddleware, settings=settings, is_draining=lambda: engine.draining)
    app.add_middleware(StatusCounter, metrics=ctx.metrics)
    return app
