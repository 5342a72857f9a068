"""Running the app under uvicorn with a graceful drain on SIGTERM/SIGINT.

First signal: the engine starts draining (/health → 503, new requests → 503) while uvicorn keeps listening;
once no request is in flight, or after ``drain_timeout_s`` (the requests still in flight then end with a 503,
in-band for a started stream), uvicorn is told to exit. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from dsinfer.entrypoints.async_engine import AsyncEngine

logger = logging.getLogger("dsinfer.server")
_FLUSH_S = 0.5  # after a drain timeout: time for the cut-off requests' handlers to send their 503


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout_s: float):
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

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
