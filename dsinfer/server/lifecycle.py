"""Running the app under uvicorn with a graceful drain on SIGTERM/SIGINT, and an exit when the engine dies.

First signal: the engine starts draining (/health → 503, new requests → 503) while uvicorn keeps listening;
once no request is in flight, or after ``drain_timeout_s`` (the requests still in flight then end with a 503,
in-band for a started stream), uvicorn is told to exit. A second signal exits at once.

A dead engine (an exception escaped its step loop, a dead worker included) cannot recover: a watcher sees it
within ``_WATCH_S``, waits ``death_grace_s`` while the failed requests' handlers send their errors (/health and
new requests are answered 503 meanwhile), then tells uvicorn to exit; ``engine_error`` says why, and the serve
command exits non-zero so that an orchestrator restarts the server (as vLLM's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import FrameType

import uvicorn

from dsinfer.entrypoints.async_engine import AsyncEngine

logger = logging.getLogger("dsinfer.server")
_FLUSH_S = 0.5  # after a drain timeout: time for the cut-off requests' handlers to send their 503
_WATCH_S = 0.1  # how often the watcher looks at engine.dead


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout_s: float,
                 death_grace_s: float = 1.0):
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.death_grace_s = death_grace_s
        self.engine_error: str | None = None  # set when the server exits because the engine died: what killed it
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        watcher = asyncio.ensure_future(self.watch_engine())
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def watch_engine(self) -> None:
        """Wait for the engine to die, then (after the grace period) tell uvicorn to exit."""
        while not self.engine.dead:
            await asyncio.sleep(_WATCH_S)
        self.engine_error = self.engine.death_reason  # the serve command logs it as it exits
        await asyncio.sleep(self.death_grace_s)
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.engine.draining or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        self.engine.start_draining()
        logger.info(
            "signal %d: draining %d in-flight requests (up to %.0fs)",
            sig,
            self.engine.num_in_flight,
            self.drain_timeout_s,
        )
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        drained = await self.engine.wait_idle(self.drain_timeout_s)
        if not drained:
            # fail them cleanly (503, in-band for a started stream) and give the handlers a moment to send
            # that, rather than leave uvicorn to cancel their tasks mid-response
            cut = self.engine.cut_off()
            logger.warning("drain timeout: %d requests still in flight are cut off (503)", cut)
            await asyncio.sleep(_FLUSH_S)
        self.should_exit = True
