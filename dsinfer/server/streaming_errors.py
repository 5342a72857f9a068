"""Errors that happen after a stream has started are reported in-band, in the route's error shape."""

from __future__ import annotations

import logging

from dsinfer.entrypoints.async_engine import EngineDeadError, EngineDrainingError, RequestRejectedError
from dsinfer.protocol.errors import ProtocolError, anthropic_error_body, openai_error_body

logger = logging.getLogger("dsinfer.server")


def _status_message(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, ProtocolError):
        return exc.status, exc.message
    if isinstance(exc, RequestRejectedError):
        return 400, str(exc)
    if isinstance(exc, EngineDeadError | EngineDrainingError):
        return 503, str(exc)
    logger.exception("error while streaming", exc_info=exc)
    return 500, "internal server error"


def stream_error_payload(exc: Exception) -> dict:
    return openai_error_body(*_status_message(exc))


def anthropic_stream_error_payload(exc: Exception, request_id: str | None = None) -> dict:
    return anthropic_error_body(*_status_message(exc), request_id)
