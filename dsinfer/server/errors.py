"""Exception handlers: every error leaves as the envelope of its route family, never as a bare 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsinfer.entrypoints.async_engine import (
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    RequestRejectedError,
)
from dsinfer.protocol.errors import ProtocolError, describe_validation_errors, error_body

logger = logging.getLogger("dsinfer.server")


def family_for(path: str) -> str:
    """Which error envelope a path answers with."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_response(
    path: str,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(family_for(path), status, message, param, code), status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def _protocol(request: Request, exc: ProtocolError) -> JSONResponse:
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return error_response(request.url.path, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = (
            f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        )
        return error_response(request.url.path, exc.status_code, message)

    @app.exception_handler(RequestRejectedError)
    async def _rejected(request: Request, exc: RequestRejectedError) -> JSONResponse:
        return error_response(request.url.path, 400, str(exc))

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        return error_response(request.url.path, 429, str(exc), headers={"Retry-After": "1"})

    @app.exception_handler(EngineDrainingError)
    async def _draining(request: Request, exc: EngineDrainingError) -> JSONResponse:
        return error_response(request.url.path, 503, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(request.url.path, 503, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(request.url.path, 500, "internal server error")
