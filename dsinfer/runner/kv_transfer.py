"""KVTransfer: the worker's side of the KV store, between the KV cache tensors and ``kvstore.KVStore``.

A grain's payload is every layer's rows of the grain's blocks, as bytes, layer after layer (the ``layout``
string names each part's block dimension, shape and dtype, and every file read checks it). Saves run after a
step's forward: the grain's blocks are gathered (on CUDA on the compute stream, so no later step's write can
overtake the gather, then copied to pinned host memory on a copy stream) and queued for the writer thread; the
step never waits for the copy or the write. Loads are read by the store's loader thread; a finished read is
copied into the request's blocks (on CUDA on the copy stream, behind the compute stream's earlier work), and
reported once the copy is complete, so the request is scheduled only after its KV is in place.

Full-attention (GQA) and MLA caches only: sliding-window and compressed layers (DeepSeek-V4) keep state that a
stored grain does not hold yet, so they are refused at start-up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from dsinfer.config import EngineConfig
from dsinfer.core.kv_cache_spec import CompressedSpec, FullAttentionSpec, IndexedMLACache, SlidingWindowSpec
from dsinfer.core.plan import KVLoad, KVSave
from dsinfer.kvstore.store import KVStore


class KVTransfer:
    def __init__(self, caches: list, specs: list, config: EngineConfig, fingerprint: bytes, has_state: bool):
        """``caches``: every paged layer's KV cache (as bound to the layers), ``specs`` their KVCacheSpecs."""
        refused = [type(s).__name__ for s in specs if isinstance(s, (SlidingWindowSpec, CompressedSpec))]
        if refused or has_state:
            raise ValueError(f"kv_store: {config.model.architecture} has sliding-window or compressed layers "
                             f"({sorted(set(refused)) or 'per-sequence state'}); the KV store serves full-attention "
                             "and MLA models only for now: leave kv_store unset for this model")
        self.device = config.device.device
        self.block_size = config.cache.block_size
        self.grain = config.kv_store.grain
        self.blocks_per_grain = self.grain // self.block_size
        self.parts: list[tuple[torch.Tensor, int]] = []  # (uint8 view of a cache, its block dimension)
        for cache, spec in zip(caches, specs, strict=True):
            tensors = list(cache) if isinstance(cache, IndexedMLACache) else [cache]
            dim = 1 if isinstance(spec, FullAttentionSpec) else 0  # [2, blocks, ...] or [blocks, ...]
            self.parts += [(t.view(torch.uint8), dim) for t in tensors]
        self.shapes = [self._grain_shape(t, dim) for t, dim in self.parts]
        self.layout = ";".join(f"{dim}:{list(shape)}" for (_, dim), shape in zip(self.parts, self.shapes))
        self.bytes_per_grain = sum(math.prod(shape) for shape in self.shapes)
        cuda = self.device.type == "cuda"
        self.store = KVStore(config.kv_store, fingerprint, self.layout, pin=cuda)
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._pending: dict[str, KVLoad] = {}
        self._landing: list[tuple[str, int, torch.cuda.Event]] = []  # CUDA: loads whose copy is in flight

    def _grain_shape(self, tensor: torch.Tensor, dim: int) -> tuple[int, ...]:
        shape = list(tensor.shape)
        shape[dim] = self.blocks_per_grain
        return tuple(shape)

    # ----------------------------------------------------------------- saves
    def save(self, saves: list[KVSave]) -> None:
        for save in saves:
            for i, key in enumerate(save.keys):
                if not self.store.has_room():  # dropped before any copy is made
                    continue
                blocks = save.block_ids[i * self.blocks_per_grain:(i + 1) * self.blocks_per_grain]
                payload, ready = self._gather(blocks)
                self.store.save(key, payload, save.ttl_s, ready)

    def _gather(self, block_ids: list[int]) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """The grain's payload in host memory, and (CUDA) what waits for its copy to land there."""
        idx = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
        flat = torch.cat([t.index_select(dim, idx).reshape(-1) for t, dim in self.parts])
        if self.copy_stream is None:
            return flat, None
        host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        flat.record_stream(self.copy_stream)
        return host, done.synchronize

    # ----------------------------------------------------------------- loads
    def start(self, loads: list[KVLoad]) -> None:
        for load in loads:
            self._pending[load.request_id] = load
            self.store.load(load.request_id, load.keys)

    def finished(self, poll_s: float = 0.0) -> dict[str, int]:
        """Tokens each load completed since the last call filled; waits up to ``poll_s`` for one when loads are
        pending (a step with nothing to compute)."""
        done: dict[str, int] = {}
        deadline = time.monotonic() + poll_s
        while True:
            wait = max(deadline - time.monotonic(), 0.0) if self._pending and not self._landing else 0.0
            for load_id, payloads in self.store.finished_loads(wait):
                load = self._pending.pop(load_id)
                sizes = [p.numel() == self.bytes_per_grain for p in payloads] + [False]
                payloads = payloads[:sizes.index(False)]  # a payload of another size is a miss from there on
                event = self._scatter(load, payloads)
                if event is None:
                    done[load_id] = len(payloads) * self.grain
                else:
                    self._landing.append((load_id, len(payloads) * self.grain, event))
            still = []
            for load_id, tokens, event in self._landing:
                if event.query():
                    done[load_id] = tokens
                else:
                    still.append((load_id, tokens, event))
            self._landing = still
            if done or not (self._pending or self._landing) or time.monotonic() >= deadline:
                return done
            if self._landing:
                time.sleep(1e-4)

    def _scatter(self, load: KVLoad, payloads: list[torch.Tensor]) -> torch.cuda.Event | None:
        if self.copy_stream is None:
            for i, payload in enumerate(payloads):
                self._scatter_grain(load.block_ids[i * self.blocks_per_grain:(i + 1) * self.blocks_per_grain],
                                    payload)
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the blocks' earlier users first
        with torch.cuda.stream(self.copy_stream):
            for i, payload in enumerate(payloads):
                self._scatter_grain(load.block_ids[i * self.blocks_per_grain:(i + 1) * self.blocks_per_grain],
                                    payload.to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record()
        return event

    def _scatter_grain(self, block_ids: list[int], payload: torch.Tensor) -> None:
        keep = [j for j, b in enumerate(block_ids) if b >= 0]
        idx = torch.tensor([block_ids[j] for j in keep], dtype=torch.long).to(payload.device, non_blocking=True)
        rows = None if len(keep) == len(block_ids) else torch.tensor(keep).to(payload.device, non_blocking=True)
        offset = 0
        for (tensor, dim), shape in zip(self.parts, self.shapes):
            n = math.prod(shape)
            chunk = payload[offset:offset + n].view(shape)
            offset += n
            tensor.index_copy_(dim, idx, chunk if rows is None else chunk.index_select(dim, rows))

    def report(self) -> tuple[list[list], dict[str, float]]:
        """(host-tier events, counters) for the step's RunnerOutput."""
        return [[k, p] for k, p in self.store.host_events()], self.store.counters.snapshot()

    def close(self) -> None:
        self.store.close()
