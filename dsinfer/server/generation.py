"""Running requests on the AsyncEngine for a route: one, or a batch answered as one (a completions request with
several prompts); disconnect-aware waiting and latency metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine
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

    def __init__(self, ctx: ServingContext, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 priority: int = 0, first_token: int | None = None):
        self.ctx = ctx
        self.priority = priority
        self.first_token_id = first_token  # preset by the router's prefill step (``server/load.py``)
        self.prompt_ids = prompt_ids
        self.params = params
        self.request_id = request_id
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.num_generated = 0
        self.num_cached = 0
        self.choice_tokens = [0] * params.n  # tokens of each choice: the longest took the decode steps

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        extra = {} if self.first_token_id is None else {"first_token": self.first_token_id}
        gen = self.ctx.engine.generate({"prompt_token_ids": self.prompt_ids}, self.params, self.request_id,
                                       self.priority, **extra)
        started = finished = False
        try:
            async with aclosing(gen):
                async for out in gen:
                    started = True
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
        finally:
            if started and not finished:  # aborted (the client left, or the batch it was part of failed)
                self._abort()

    def _finish(self, out: RequestOutput) -> None:
        if self.params.output_kind != 1:  # not DELTA: the final output holds every token
            self.num_generated = sum(len(c.token_ids) for c in out.outputs)
            for c in out.outputs:
                self.choice_tokens[c.index] = len(c.token_ids)
        self.num_cached = out.num_cached_tokens
        now = time.monotonic()
        ttft = None if self.first_token is None else self.first_token - self.start
        self.ctx.metrics.record_request(len(self.prompt_ids), self.num_generated, max(self.choice_tokens, default=0),
                                        ttft, now - self.start, tuple(c.finish_reason for c in out.outputs))

    def _abort(self) -> None:
        """An aborted request's metrics: its tokens so far still count (vLLM counts every step's); a FINAL_ONLY
        request learns its tokens only at the end, so its abort counts none."""
        self.ctx.metrics.prompt_tokens.inc(len(self.prompt_ids))
        self.ctx.metrics.generation_tokens.inc(self.num_generated)
        self.ctx.metrics.e2e.observe(time.monotonic() - self.start)
        self.ctx.metrics.request_success.labels("abort").inc(self.params.n)

    async def final(self, request: Request) -> RequestOutput:
        """The finished output (FINAL_ONLY params), aborting the request if the client leaves."""
        return await until_disconnect(request, self.last())

    async def last(self) -> RequestOutput:
        result = None
        async for out in self.outputs():
            result = out
        if result is None:
            raise ProtocolError("the engine returned no output", status=500)
        return result

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


async def _all_of(coroutines: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result, run together. When one fails (or this is cancelled) the others are cancelled and waited for,
    so that their cleanup (the engine aborts) has run before the error goes on."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # nothing to a finished one
        await asyncio.wait(tasks)


class Batch:
    """Several generations answered as one (a completions request with several prompts: one engine request each,
    each recording its own metrics); one failing, or the client leaving, aborts them all."""

    def __init__(self, gens: list[Generation]):
        self.gens = gens

    async def finals(self, request: Request) -> list[RequestOutput]:
        """Every generation's finished output (FINAL_ONLY params), in order."""

        async def lasts() -> list[RequestOutput]:
            return await _all_of([gen.last() for gen in self.gens])

        return await until_disconnect(request, lasts())

    async def outputs(self, request: Request) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every generation started and its first output awaited before answering, as ``primed`` (an early error
        is a 4xx response and leaves nothing running); then the outputs of all as they come, each with the index
        of its generation. An error in one ends the iterator with it; closing the iterator aborts them all."""
        streams = [gen.outputs() for gen in self.gens]

        async def first(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
            return await anext(stream)

        async def firsts() -> list[RequestOutput]:
            try:
                return await _all_of([first(stream) for stream in streams])
            except BaseException:
                for stream in streams:  # those that gave their first output wait there: closing them aborts
                    await stream.aclose()
                raise

        return _merged(streams, await until_disconnect(request, firsts()))

    def usage(self) -> dict[str, Any]:
        """The generations' usage summed (the prompts' tokens and every choice's)."""
        total: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        for gen in self.gens:
            usage = gen.usage()
            for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                total[key] += usage[key]
            total["prompt_tokens_details"]["cached_tokens"] += usage["prompt_tokens_details"]["cached_tokens"]
        return total


async def _merged(streams: list[AsyncGenerator[T, None]], firsts: list[T]) -> AsyncIterator[tuple[int, T]]:
    """``firsts`` (each stream's first item, already taken), then the streams' other items as they come, tagged
    with their stream's index. A task per stream feeds one queue (bounded: a slow client holds the outputs back
    in the engine's streams, as with one request); whatever ends the iterator (the last item, an error, the client
    leaving) cancels the tasks and closes the streams: the engine aborts the requests still running."""
    queue: asyncio.Queue[tuple[int, T | None, Exception | None]] = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put((index, item, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))  # this stream is done

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        for index, item in enumerate(firsts):
            yield index, item
        running = len(tasks)
        while running:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        for stream in streams:  # a task cancelled before it ran never opened its stream: close it here
            await stream.aclose()
