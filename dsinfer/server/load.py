"""What ``dsinfer router`` reads from a replica: ``GET /load`` and the ``x-dsinfer-kv-flush`` request header.

``/load`` is light (the engine's stats of its last step, no lock, no engine call), public like ``/health``:
running and waiting requests, KV tokens in use (the running requests' computed tokens: the next decode step's
attention cost), the prefix cache's counters, and the constants the router balances with (sequence slots, KV
capacity, block size, the KV store's directory and grain).

``x-dsinfer-kv-flush: 1`` on a request (the router's prefill step of prefill/decode disaggregation): the answer
is held until the KV store's queued saves are written, so that the decode replica it goes to next finds the
prompt's grains in the shared directory. Bounded by ``FLUSH_TIMEOUT_S``; the answer goes out either way (a grain
not yet written is recomputed by the decode replica: time lost, never tokens).

``x-dsinfer-first-token: ID`` on a chat or text completion (the router's decode step): the prefill replica's
first output token, which the engine takes as the request's first sample (``LLMEngine.add_request``): it goes
to the client at once, and decoding continues from it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request

from dsinfer.protocol.errors import ProtocolError

logger = logging.getLogger("dsinfer.server")
router = APIRouter()
FLUSH_HEADER = b"x-dsinfer-kv-flush"
FLUSH_TIMEOUT_S = 10.0
FIRST_TOKEN_HEADER = "x-dsinfer-first-token"


def first_token_of(request: Request) -> int | None:
    """The ``x-dsinfer-first-token`` header's token id (None: absent); a 400 when it is not a token id."""
    value = request.headers.get(FIRST_TOKEN_HEADER)
    if value is None:
        return None
    if not value.strip().isdigit():
        raise ProtocolError(f"{FIRST_TOKEN_HEADER} must be a token id, got {value!r}", param=FIRST_TOKEN_HEADER)
    return int(value)


def replica_constants(llm_engine: Any) -> dict[str, Any]:
    """The replica's fixed facts: sequence slots, KV capacity in tokens, block size, the store's dir and grain."""
    config = getattr(llm_engine, "config", None) if hasattr(llm_engine, "kv_manager") else None
    if config is None:  # an engine without the engine config (tests' fakes): no capacity facts
        return {}
    pool = llm_engine.kv_manager.pool
    store = config.kv_store
    return {"max_num_seqs": config.scheduler.max_num_seqs,
            "kv_capacity_tokens": (pool.num_blocks - 1) * config.cache.block_size,
            "block_size": config.cache.block_size,
            "enable_prefix_caching": config.cache.enable_prefix_caching,
            "kv_store_dir": None if store.dir is None else str(store.dir),
            "kv_store_grain": store.grain if store.enabled else None}


@router.get("/load")
async def load(request: Request) -> dict[str, Any]:
    engine = request.app.state.ctx.engine
    stats = engine.stats
    return {"status": "dead" if engine.dead else "draining" if engine.draining else "ok",
            "num_running": int(stats.get("num_running", 0)),
            "num_waiting": int(stats.get("num_waiting", 0)),
            "num_waiting_tokens": int(stats.get("num_waiting_tokens", 0)),
            "num_kv_tokens": int(stats.get("num_kv_tokens", 0)),
            "kv_cache_usage": float(stats.get("kv_cache_usage", 0.0)),
            "num_in_flight": engine.num_in_flight,
            "prefix_cache_queries": int(stats.get("prefix_cache_queries", 0)),
            "prefix_cache_hits": int(stats.get("prefix_cache_hits", 0)),
            **request.app.state.replica_constants}


class KVFlush:
    """ASGI: a request with ``x-dsinfer-kv-flush`` gets its answer after the KV store's queued saves are written
    (see the module doc). ``wait_saves``: blocking, run in a thread; returns False when it cannot wait (no store
    in this process)."""

    def __init__(self, app: Any, wait_saves: Any):
        self.app = app
        self.wait_saves = wait_saves

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not any(k == FLUSH_HEADER for k, _ in scope.get("headers", [])):
            return await self.app(scope, receive, send)
        held: list[dict] = []

        async def hold(message: dict) -> None:
            held.append(message)

        await self.app(scope, receive, hold)
        try:
            await asyncio.wait_for(asyncio.to_thread(self.wait_saves), FLUSH_TIMEOUT_S)
        except TimeoutError:
            logger.warning("the KV store's saves were not written within %.0fs: answered anyway", FLUSH_TIMEOUT_S)
        for message in held:
            await send(message)
