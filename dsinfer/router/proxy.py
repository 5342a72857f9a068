"""Forwarding one request to a replica: retries before the first byte, a clean in-band error after it.

``open_answer`` tries replicas until one answers: a refused or broken connection, or a 503 (draining, dead), before
any byte reached the client, is tried again on another replica when one is left (else the same one), after a
backoff of ``retry_backoff_s x 2^attempt`` with jitter, at most ``max_retries`` times. A stream is committed
(its status line sent to the client) with its first chunk, so a replica that dies before sending one is retried
too. Once committed, nothing is retried: a stream that breaks is ended with one error event in its API's shape
(OpenAI's ``data: {"error": ...}``, Anthropic's ``event: error``), after its last whole event. A replica silent
for ``read_timeout_s`` is a 504 (not retried: it may have been generating all that time).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from dsinfer.protocol.errors import error_body
from dsinfer.router.policy import RequestInfo
from dsinfer.router.pool import ReplicaPool
from dsinfer.router.replica import Replica
from dsinfer.server.sse import sse_data, sse_event

# request headers not forwarded (hop-by-hop, or recomputed by httpx); accept-encoding: answers are relayed as sent
_DROP_REQUEST = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                           "trailer", "upgrade", "accept-encoding"})
_DROP_RESPONSE = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"})
REPLICA_HEADER = "x-dsinfer-replica"  # on every relayed answer: the replica that served it
RETRY_STATUSES = frozenset({503})

Chooser = Callable[[set[str]], "tuple[Replica, str] | None"]


def family_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_response(path: str, status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(family_of(path), status, message), status_code=status)


def stream_error_event(path: str, status: int, message: str) -> bytes:
    body = error_body(family_of(path), status, message)
    return (sse_event("error", body) if family_of(path) == "anthropic" else sse_data(body)).encode()


@dataclass
class Forward:
    """One request as the router forwards it."""

    method: str
    path: str
    content: bytes
    headers: list[tuple[str, str]]
    stream: bool
    info: RequestInfo
    started: float = field(default_factory=time.monotonic)
    remember_prefix: bool = True  # whether the chosen replica now holds the prompt's prefix (not for prefill)


def forward_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The client's headers for the replica, with an ``x-request-id`` (the client's, else a new one) so that the
    replica's answer, logs and this router's all carry one id."""
    out = [(k, v) for k, v in headers if k.lower() not in _DROP_REQUEST]
    if not any(k.lower() == "x-request-id" for k, _ in out):
        out.append(("x-request-id", uuid.uuid4().hex))
    return out


@dataclass
class Opened:
    """A replica's committed answer: its status, headers and first bytes (a stream's first chunk, else the body)."""

    replica: Replica
    response: httpx.Response
    first: bytes
    chunks: AsyncIterator[bytes] | None  # the rest of a stream; None: ``first`` is the whole body


class Proxy:
    def __init__(self, pool: ReplicaPool, client: httpx.AsyncClient, rng: random.Random | None = None):
        self.pool = pool
        self.settings = pool.settings
        self.client = client
        self.metrics = pool.metrics
        self._rng = rng or random.Random()
        s = self.settings
        self.timeout = httpx.Timeout(connect=s.connect_timeout_s, read=s.read_timeout_s, write=s.read_timeout_s,
                                     pool=s.connect_timeout_s)

    def backoff_s(self, attempt: int) -> float:
        base = self.settings.retry_backoff_s * (2 ** (attempt - 1))
        return base * (0.5 + self._rng.random())

    async def open_answer(self, fwd: Forward, choose: Chooser) -> Opened | Response:
        """The first committed answer of a replica, or the router's error response when none came."""
        tried: set[str] = set()
        failure: Response | None = None
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s(attempt))
            pick = choose(tried)
            if pick is None:
                failure = failure or error_response(fwd.path, 503, "no replica is available to serve this request")
                continue
            replica, reason = pick
            self.metrics.decisions.labels(reason).inc()
            outcome = await self._try(replica, fwd)
            if isinstance(outcome, Opened):
                return outcome
            cause, failure = outcome
            tried.add(replica.url)
            if cause is None:  # not retryable (a timeout)
                return failure
            if attempt < self.settings.max_retries:
                self.metrics.retries.labels(cause).inc()
        return failure

    async def _try(self, replica: Replica, fwd: Forward) -> Opened | tuple[str | None, Response]:
        """One attempt: the committed answer, or (the retry cause, None when it must not be retried; the error
        response to give when no attempt is left)."""
        replica.begin(fwd.info.num_tokens)
        if fwd.remember_prefix:
            replica.remember(fwd.info.hashes(replica.block_size))
        request = self.client.build_request(fwd.method, replica.url + fwd.path, content=fwd.content or None,
                                            headers=fwd.headers, timeout=self.timeout)
        response = None
        try:
            response = await self.client.send(request, stream=True)
            if response.status_code in RETRY_STATUSES:
                body = await response.aread()
                await response.aclose()
                replica.end()
                self.pool.eject(replica, f"status_{response.status_code}")
                return f"status_{response.status_code}", Response(
                    body, response.status_code, headers=answer_headers(response, replica))
            if fwd.stream and response.status_code == 200:
                chunks = response.aiter_raw()
                first = await anext(chunks, b"")
                self.metrics.ttft.observe(time.monotonic() - fwd.started)
                return Opened(replica, response, first, chunks)
            body = await response.aread()
            await response.aclose()
            return Opened(replica, response, body, None)
        except httpx.TimeoutException as exc:
            await _close(response)
            replica.end()
            cause = "connect_timeout" if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout) else None
            self.pool.request_failed(replica, cause or "timeout")
            if cause is not None:
                return cause, error_response(fwd.path, 503, f"replica {replica.url} did not accept the connection "
                                                            f"within {self.settings.connect_timeout_s}s")
            return None, error_response(fwd.path, 504, f"replica {replica.url} sent nothing for "
                                                       f"{self.settings.read_timeout_s}s")
        except httpx.TransportError as exc:
            await _close(response)
            replica.end()
            cause = "connect" if isinstance(exc, httpx.ConnectError) else "broken_before_first_byte"
            self.pool.request_failed(replica, cause)
            return cause, error_response(fwd.path, 503, f"replica {replica.url} failed before answering "
                                                        f"({type(exc).__name__}: {exc})")

    async def send(self, fwd: Forward, choose: Chooser) -> Response:
        """The client's answer: the replica's, relayed (a stream as it comes), or the router's error."""
        opened = await self.open_answer(fwd, choose)
        if not isinstance(opened, Opened):
            self.metrics.e2e.observe(time.monotonic() - fwd.started)
            return opened
        headers = answer_headers(opened.response, opened.replica)
        if opened.chunks is None:
            self.finished(opened, fwd)
            return Response(opened.first, opened.response.status_code, headers=headers)
        return StreamingResponse(self._relay(opened, fwd), opened.response.status_code, headers=headers)

    def finished(self, opened: Opened, fwd: Forward, broken: str | None = None, last: bool = True) -> None:
        """``opened`` is over (``broken``: the cause when its stream broke); ``last``: it was the client's answer
        (its end-to-end latency observed)."""
        opened.replica.end()
        if broken is not None:
            self.pool.request_failed(opened.replica, broken)
        elif opened.response.status_code >= 500:
            self.pool.request_failed(opened.replica, f"status_{opened.response.status_code}")
        else:
            self.pool.request_succeeded(opened.replica)
        if last:
            self.metrics.e2e.observe(time.monotonic() - fwd.started)

    async def _relay(self, opened: Opened, fwd: Forward) -> AsyncIterator[bytes]:
        """The stream's events, each whole; a break ends it after the last whole one with an error event."""
        pending, broken = opened.first, None
        try:
            cut = pending.rfind(b"\n\n") + 2
            if cut > 1:
                yield pending[:cut]
                pending = pending[cut:]
            async for chunk in opened.chunks:
                pending += chunk
                cut = pending.rfind(b"\n\n") + 2
                if cut > 1:
                    yield pending[:cut]
                    pending = pending[cut:]
            if pending:
                yield pending
        except httpx.TransportError as exc:
            broken = "broken_stream"
            self.metrics.stream_errors.inc()
            yield stream_error_event(fwd.path, 502, f"the replica serving this stream ({opened.replica.url}) "
                                                    f"failed mid-way ({type(exc).__name__}: {exc})")
        finally:
            await opened.response.aclose()
            self.finished(opened, fwd, broken)


async def _close(response: httpx.Response | None) -> None:
    if response is not None:
        await response.aclose()


def answer_headers(response: httpx.Response, replica: Replica) -> dict[str, str]:
    headers = {k: v for k, v in response.headers.items() if k.lower() not in _DROP_RESPONSE}
    headers[REPLICA_HEADER] = replica.url
    return headers
