"""ASGI guard in front of every route: API key (401), body size (413) and JSON depth (400).

The body is read here, counting bytes as they arrive, and replayed to the application; after the replay the
original ``receive`` is used, so disconnects still reach the route.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from typing import Any

from dsinfer.protocol.errors import error_body
from dsinfer.server.errors import anthropic_request_id, family_for
from dsinfer.server.json_depth import json_depth
from dsinfer.server.settings import ServerSettings

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", "/openapi.json", "/load"})
_SCAN_INLINE_BYTES = 256 << 10  # bodies up to this are depth-checked on the event loop (well under 1 ms)
_DRAIN_LIMIT = 256 << 20  # an oversized body is read (and dropped) up to this, so the client sees the 413


class GuardMiddleware:
    def __init__(self, app: Any, settings: ServerSettings, is_draining: Callable[[], bool] = lambda: False):
        self.app = app
        self.settings = settings
        self.is_draining = is_draining
        self._keys = [k.encode() for k in settings.api_keys]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self._keys and path not in PUBLIC_PATHS and not self._authorized(headers):
            return await _reply(send, scope, headers, 401, "invalid or missing API key")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        if self.is_draining():
            return await _reply(send, scope, headers, 503, "the server is shutting down and accepts no new requests")
        body, status, message = await self._read_body(headers, receive)
        if status:
            return await _reply(send, scope, headers, status, message)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        offered = headers.get("x-api-key", b"")
        auth = headers.get("authorization", b"")
        if auth[:7].lower() == b"bearer ":
            offered = auth[7:].strip()
        found = False
        for key in self._keys:  # compare against every key: time does not depend on which one matched
            found |= hmac.compare_digest(offered, key)
        return found

    async def _read_body(self, headers: dict[str, bytes], receive: Any) -> tuple[bytes, int, str]:
        limit = self.settings.max_body_bytes
        too_large = f"request body exceeds the limit of {limit} bytes"
        declared = headers.get("content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await _discard(receive)
            return b"", 413, too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", 400, "client disconnected"
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                if message.get("more_body", False):
                    await _discard(receive)
                return b"", 413, too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        # linear, but a large body takes a while (8 MB: ~0.35 s): off the event loop, which serves everyone
        depth = json_depth(body) if len(body) < _SCAN_INLINE_BYTES else await asyncio.to_thread(json_depth, body)
        if depth > self.settings.max_json_depth:
            return b"", 400, f"JSON nesting depth {depth} exceeds the limit of {self.settings.max_json_depth}"
        return body, 0, ""


async def _discard(receive: Any) -> None:
    size = 0
    while size < _DRAIN_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _reply(send: Any, scope: dict, headers: dict[str, bytes], status: int, message: str) -> None:
    # the request's headers pick the envelope on the shared routes, as the handlers' (an Anthropic client's 401 on
    # /v1/models is Anthropic's), and its request-id header's value goes in Anthropic's body
    family = family_for(scope["path"], headers)
    body = json.dumps(error_body(family, status, message, request_id=anthropic_request_id(scope))).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
