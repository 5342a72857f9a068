"""Running one request on the AsyncEngine for a route: disconnect-aware waiting and latency metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any, TypeVar

from starlette.requests import Request

from dsinfer.engine.outputs import RequestOutput
from dsinfer.engine.sampling_params import SamplingParams
from dsinfer.protocol.errors import ProtocolError
from dsinfer.server.context import ServingContext

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first: then it is cancelled, and waited for so that its
    cleanup (the engine abort) has run, and ``ClientDisconnected`` is raised."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    gone = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            gone = True
            task.cancel()
            # a cancelled task is only "cancelling" until it runs again: wait for it, whatever it ends with
            await asyncio.wait({task})
    if gone:
        if not task.cancelled():
            task.exception()  # retrieved: an error while it was being cancelled is not the answer
        raise ClientDisconnected()
    return task.result()


class Generation:
    """One engine request: its outputs as an async iterator, with metrics recorded when it ends."""

    def __init__(self, ctx: ServingContext, prompt_ids: list[int], params: SamplingParams, request_id: str):
        self.ctx = ctx
        self.prompt_ids = prompt_ids
        self.params = params
        self.request_id = request_id
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.num_generated = 0
        self.num_cached = 0
        self.choice_tokens = [0] * params.n  # tokens of each choice: the longest took the decode steps

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        gen = self.ctx.engine.generate({"prompt_token_ids": self.prompt_ids}, self.params, self.request_id)
        finished = False
        async with aclosing(gen):
            async for out in gen:
                new = sum(len(c.token_ids) for c in out.outputs)
                self.num_cached = out.num_cached_tokens  # known from the first output on
                if new and self.first_token is None:
                    self.first_token = time.monotonic()
                if self.params.output_kind == 1:  # DELTA
                    self.num_generated += new
                    for c in out.outputs:
                        self.choice_tokens[c.index] += len(c.token_ids)
                if out.finished:
                    finished = True
                    self._finish(out)
                yield out
        if not finished:
            self.ctx.metrics.e2e.observe(time.monotonic() - self.start)

    def _finish(self, out: RequestOutput) -> None:
        if self.params.output_kind != 1:  # not DELTA: the final output holds every token
            self.num_generated = sum(len(c.token_ids) for c in out.outputs)
            for c in out.outputs:
                self.choice_tokens[c.index] = len(c.token_ids)
        self.num_cached = out.num_cached_tokens
        now = time.monotonic()
        ttft = None if self.first_token is None else self.first_token - self.start
        self.ctx.metrics.record_request(len(self.prompt_ids), self.num_generated, ttft, now - self.start,
                                        max(self.choice_tokens, default=0))

    async def final(self, request: Request) -> RequestOutput:
        """The finished output (FINAL_ONLY params), aborting the request if the client leaves."""

        async def last() -> RequestOutput:
            result = None
            async for out in self.outputs():
                result = out
            if result is None:
                raise ProtocolError("the engine returned no output", status=500)
            return result

        return await until_disconnect(request, last())

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": self.num_generated,
            "total_tokens": len(self.prompt_ids) + self.num_generated,
            "prompt_tokens_details": {"cached_tokens": self.num_cached},
        }


async def primed(request: Request, stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Start ``stream`` and wait for its first item before answering, so early errors become 4xx responses."""
    first = await until_disconnect(request, anext(stream))

    async def rest() -> AsyncIterator[T]:
        async with aclosing(stream):
            yield first
            async for item in stream:
                yield item

    return rest()
