"""Server-sent events framing."""

from __future__ import annotations

import json
from typing import Any


def sse_data(payload: Any) -> str:
    """An OpenAI-style event: ``data: {json}``."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_event(event: str, payload: Any) -> str:
    """An Anthropic-style event: ``event: type`` + ``data: {json}``."""
    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
