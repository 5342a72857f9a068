"""Bounds on slow and oversized HTTP clients: uvicorn's h11 protocol with a deadline for a request's head, an idle
timeout while its body arrives, and a size limit on the head.

uvicorn bounds only the idle time between requests (``timeout_keep_alive``); a client that never finishes its
headers, or announces ``Content-Length: 999999999999`` and sends one byte, holds a connection for good. Here:
- a request's head (request line and headers) must be complete within ``header_timeout_s`` of its first byte, or
  of the connection's opening for the first request (408 and the connection closed);
- a body must not pause longer than ``body_timeout_s`` between two reads (the connection is closed: the handler
  sees a disconnect and its request is aborted);
- a head over ``max_header_bytes`` is answered 431 and the connection closed.
The number of connections is uvicorn's ``limit_concurrency`` (503 above it).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _reply(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


def bounded_h11(header_timeout_s: float, body_timeout_s: float, max_header_bytes: int) -> type[H11Protocol]:
    """An ``H11Protocol`` class (uvicorn's ``http=``) with these bounds."""

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head = bytearray()
            self._timer: asyncio.TimerHandle | None = None
            self._arm(header_timeout_s, self._head_timed_out)

        def _arm(self, delay: float, callback: Any) -> None:
            self._disarm()
            self._timer = self.loop.call_later(delay, callback)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _close_with(self, reply: bytes | None) -> None:
            self._disarm()
            if not self.transport.is_closing():
                if reply is not None:
                    self.transport.write(reply)
                self.transport.close()

        def _head_timed_out(self) -> None:
            self._close_with(_reply(408, "Request Timeout",
                                    f"the request's headers did not arrive within {header_timeout_s:g}s"))

        def _body_timed_out(self) -> None:
            self._close_with(None)

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                if not self._head and self._timer is None:  # a later request on a kept-alive connection
                    self._arm(header_timeout_s, self._head_timed_out)
                self._head += data
                end = self._head.find(b"\r\n\r\n")
                if (end + 4 if end >= 0 else len(self._head)) > max_header_bytes:
                    self._close_with(_reply(431, "Request Header Fields Too Large",
                                            f"the request's headers pass the limit of {max_header_bytes} bytes"))
                    return
            super().data_received(data)
            if self.transport.is_closing():
                return
            state = self.conn.their_state
            if state is not h11.IDLE:
                self._head.clear()
            if state is h11.SEND_BODY:
                self._arm(body_timeout_s, self._body_timed_out)
            elif state is not h11.IDLE:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedH11Protocol
