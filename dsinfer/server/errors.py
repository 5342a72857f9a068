"""Exception handlers: every error leaves as the envelope of its route family, never as a bare 500."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsinfer.entrypoints.async_engine import (
    EngineCrashedError,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    RequestRejectedError,
)
from dsinfer.protocol.errors import ProtocolError, describe_validation_errors, error_body

logger = logging.getLogger("dsinfer.server")

# ASGI scope key under which RequestIdHeaders (app.py) leaves an Anthropic request's ``req_...`` id, the value of
# its ``request-id`` header, for the error bodies (handlers here, the guard, in-stream errors) to carry
REQUEST_ID_KEY = "dsinfer.request_id"


def anthropic_request_id(scope: Mapping) -> str | None:
    """The ``request-id`` header's value of this request; None off Anthropic's routes (no such header)."""
    return scope.get(REQUEST_ID_KEY)


def is_shared_path(path: str) -> bool:
    """Routes both SDKs call (``client.models.list()`` / ``.retrieve(id)``): the request's headers pick the API."""
    return path == "/v1/models" or path.startswith("/v1/models/")


def speaks_anthropic(headers: Mapping[str, str]) -> bool:
    """An Anthropic client: its SDKs send ``anthropic-version`` on every request, OpenAI's never do. An
    ``OpenAI-Organization`` / ``-Project`` / ``-Beta`` header says OpenAI client even so (a client that sets both)."""
    return "anthropic-version" in headers and not any(key.lower().startswith("openai-") for key in headers)


def family_for(path: str, headers: Mapping[str, str] | None = None) -> str:
    """Which API (and error envelope) a request answers in: /v1/messages Anthropic's; a shared route
    Anthropic's when the request ``headers`` are an Anthropic client's; the rest OpenAI's."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if headers is not None and is_shared_path(path) and speaks_anthropic(headers):
        return "anthropic"
    return "openai"


def error_response(
    path: str,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    request_headers: Mapping[str, str] | None = None,
    request_id: str | None = None,
) -> JSONResponse:
    family = family_for(path, request_headers)
    return JSONResponse(error_body(family, status, message, param, code, request_id), status, headers=headers)


def _reply(request: Request, status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return error_response(request.url.path, status, message, param, code, headers, request.headers,
                          anthropic_request_id(request.scope))


class InternalErrors:
    """Innermost ASGI wrapper: an exception that no handler took becomes its route family's 500 here, inside the
    other middlewares, so the answer carries the request ids (and the Anthropic body its ``request_id``) and the
    CORS headers, and the metrics count it. Starlette's own catch-all (``_internal`` below, still there for errors
    in the outer middlewares) answers outside them all. A response already started (a stream) cannot be replaced:
    its error goes on to the server."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error on %s", scope["path"], exc_info=exc)
            response = error_response(scope["path"], 500, "internal server error",
                                      request_headers=Headers(scope=scope), request_id=anthropic_request_id(scope))
            await response(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def _protocol(request: Request, exc: ProtocolError) -> JSONResponse:
        return _reply(request, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return _reply(request, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = (
            f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        )
        return _reply(request, exc.status_code, message)

    @app.exception_handler(RequestRejectedError)
    async def _rejected(request: Request, exc: RequestRejectedError) -> JSONResponse:
        return _reply(request, 400, str(exc))

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        # a full queue: OpenAI's API answers 429, Anthropic's 529 overloaded_error (its SDK's OverloadedError);
        # both SDKs retry either, after Retry-After
        anthropic = family_for(request.url.path, request.headers) == "anthropic"
        return _reply(request, 529 if anthropic else 429, str(exc), headers={"Retry-After": "1"})

    @app.exception_handler(EngineDrainingError)
    async def _draining(request: Request, exc: EngineDrainingError) -> JSONResponse:
        return _reply(request, 503, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _reply(request, 503, str(exc))

    @app.exception_handler(EngineCrashedError)
    async def _crashed(request: Request, exc: EngineCrashedError) -> JSONResponse:
        # in flight when the engine died: vLLM's 500 (a request after it is refused with the 503 above)
        return _reply(request, 500, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return _reply(request, 500, "internal server error")
