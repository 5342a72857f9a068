"""KVTransfer: the worker's side of the KV store, between the KV cache tensors and ``kvstore.KVStore``.

A grain's payload is every full-attention layer's rows of the grain's blocks, as bytes, layer after layer (the
``layout`` string names each part's block dimension, shape and dtype, and every file read checks it). Saves run
after a step's forward: the grain's blocks are gathered (on CUDA on the compute stream, so no later step's write
can overtake the gather, then copied to pinned host memory on a copy stream) and queued for the writer thread;
the step never waits for the copy or the write. Loads are read by the store's loader thread; a finished read is
copied into the request's blocks (on CUDA on the copy stream, behind the compute stream's earlier work), and
reported once the copy is complete, so the request is scheduled only after its KV is in place.

Sliding-window groups (Mistral, GPT-OSS): a grain boundary's window state is a second payload, each sliding
group's layers' rows of its ``window_blocks`` window blocks (-1 entries: padding, gathered from the null block and
skipped on load), so a sliding group's entries hold only its window, whatever the context. A load whose window
state does not come back fills nothing (reported as 0 tokens).

Compressed layers with per-sequence state (DeepSeek-V4): a grain's payload is every compressed layer's entries
(and CSA's indexer keys) of the grain's blocks; its boundary state, the second payload, is the grain's last
block's ``BoundaryStateSpec`` rows (the state slot's rows at the grain's end), which the runner restores into the
request's slot when it first runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from dsinfer.config import EngineConfig
from dsinfer.core.kv_cache_spec import (
    BoundaryStateSpec,
    FullAttentionSpec,
    IndexedMLACache,
    kv_cache_groups,
    window_blocks,
)
from dsinfer.core.plan import KVLoad, KVSave
from dsinfer.kvstore.store import KVStore

Part = tuple[torch.Tensor, int, tuple[int, ...]]  # (uint8 view of a cache, its block dimension, a grain's shape)


class KVTransfer:
    def __init__(self, caches: list, specs: list, config: EngineConfig, fingerprint: bytes):
        """``caches``: every paged layer's KV cache (as bound to the layers), ``specs`` their KVCacheSpecs
        (``BoundaryStateSpec`` ones last: a state model's block-end rows)."""
        self.device = config.device.device
        self.block_size = config.cache.block_size
        self.grain = config.kv_store.grain
        self.blocks_per_grain = self.grain // self.block_size
        self.parts: list[Part] = []  # the full groups' layers, a grain's blocks each
        self.window_parts: list[tuple[list[Part], int]] = []  # per sliding group: its layers, its window blocks
        boundary = [i for i, spec in enumerate(specs) if isinstance(spec, BoundaryStateSpec)]
        if boundary:  # the state at a grain's end: its last block's rows, as a sliding group's window state is
            rows = [self._part(t, specs[i], 1) for i in boundary for t in caches[i].rings.values()]
            self.window_parts.append((rows, 1))
            caches, specs = caches[:boundary[0]], specs[:boundary[0]]
        for group in kv_cache_groups(specs):
            n = self.blocks_per_grain if group.sliding_window is None else window_blocks(group.sliding_window,
                                                                                         self.block_size)
            parts = [self._part(t, spec, n) for i in group.layers for spec in [specs[i]]
                     for t in (list(caches[i]) if isinstance(caches[i], (IndexedMLACache, list)) else [caches[i]])]
            if group.sliding_window is None:
                self.parts += parts
            else:
                self.window_parts.append((parts, n))
        self.layout = ";".join(f"{dim}:{list(shape)}" for _, dim, shape in self.parts)
        if self.window_parts:
            self.layout += "|window:" + ";".join(f"{dim}:{list(shape)}" for parts, _ in self.window_parts
                                                 for _, dim, shape in parts)
        self.bytes_per_grain = sum(math.prod(shape) for _, _, shape in self.parts)
        self.bytes_per_window = sum(math.prod(shape) for parts, _ in self.window_parts for _, _, shape in parts)
        cuda = self.device.type == "cuda"
        self.store = KVStore(config.kv_store, fingerprint, self.layout, pin=cuda)
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._pending: dict[str, KVLoad] = {}
        self._landing: list[tuple[str, int, torch.cuda.Event]] = []  # CUDA: loads whose copy is in flight

    @staticmethod
    def _part(tensor: torch.Tensor, spec, num_blocks: int) -> Part:
        dim = 1 if isinstance(spec, FullAttentionSpec) else 0  # [2, blocks, ...] or [blocks, ...]
        view = tensor.view(torch.uint8)
        shape = list(view.shape)
        shape[dim] = num_blocks
        return view, dim, tuple(shape)

    def _grain_segments(self, block_ids: list[int], i: int) -> list[tuple[list[Part], list[int]]]:
        return [(self.parts, block_ids[i * self.blocks_per_grain:(i + 1) * self.blocks_per_grain])]

    def _window_segments(self, block_ids: list[int]) -> list[tuple[list[Part], list[int]]]:
        segments, offset = [], 0
        for parts, n in self.window_parts:
            segments.append((parts, block_ids[offset:offset + n]))
            offset += n
        return segments

    # ----------------------------------------------------------------- saves
    def save(self, saves: list[KVSave]) -> None:
        for save in saves:
            entries = [(key, self._grain_segments(save.block_ids, i)) for i, key in enumerate(save.keys)]
            entries += [(key, self._window_segments(ids))
                        for key, ids in zip(save.window_keys, save.window_block_ids, strict=True)]
            for key, segments in entries:
                if not self.store.has_room():  # dropped before any copy is made
                    continue
                payload, ready = self._gather(segments)
                self.store.save(key, payload, save.ttl_s, ready)

    def _gather(self, segments: list[tuple[list[Part], list[int]]]
                ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """The entry's payload in host memory, and (CUDA) what waits for its copy to land there."""
        rows = []
        for parts, block_ids in segments:
            idx = torch.tensor([max(b, 0) for b in block_ids], dtype=torch.long).to(self.device, non_blocking=True)
            rows += [t.index_select(dim, idx).reshape(-1) for t, dim, _ in parts]
        flat = torch.cat(rows)
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
            # hit tokens by tier: the grains', or (no full group) the window state's
            self.store.load(load.request_id, load.keys, load.window_key, 0 if load.keys else load.window_tokens)

    def finished(self, poll_s: float = 0.0) -> dict[str, int]:
        """Tokens each load completed since the last call filled; waits up to ``poll_s`` for one when loads are
        pending (a step with nothing to compute)."""
        done: dict[str, int] = {}
        deadline = time.monotonic() + poll_s
        while True:
            wait = max(deadline - time.monotonic(), 0.0) if self._pending and not self._landing else 0.0
            for load_id, payloads in self.store.finished_loads(wait):
                load = self._pending.pop(load_id)
                entries = self._entries(load, payloads)
                tokens = len(entries) * self.grain
                if load.window_key is not None:  # up to the state's boundary, or nothing
                    tokens = load.window_tokens if entries else 0
                event = self._scatter(entries)
                if event is None:
                    done[load_id] = tokens
                else:
                    self._landing.append((load_id, tokens, event))
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

    def _entries(self, load: KVLoad, payloads: list[torch.Tensor]) -> list[tuple[list, torch.Tensor]]:
        """(segments, payload) of the leading entries read whole; with a window state, all of them or none."""
        entries = []
        for i, payload in enumerate(payloads[:len(load.keys)]):
            if payload.numel() != self.bytes_per_grain:  # a payload of another size is a miss from there on
                break
            entries.append((self._grain_segments(load.block_ids, i), payload))
        if load.window_key is None:
            return entries
        window = payloads[len(load.keys)] if len(payloads) > len(load.keys) else None
        if len(entries) < len(load.keys) or window is None or window.numel() != self.bytes_per_window:
            return []
        return entries + [(self._window_segments(load.window_block_ids), window)]

    def _scatter(self, entries: list[tuple[list, torch.Tensor]]) -> torch.cuda.Event | None:
        if self.copy_stream is None:
            for segments, payload in entries:
                self._scatter_entry(segments, payload)
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the blocks' earlier users first
        with torch.cuda.stream(self.copy_stream):
            for segments, payload in entries:
                self._scatter_entry(segments, payload.to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record()
        return event

    def _scatter_entry(self, segments: list[tuple[list[Part], list[int]]], payload: torch.Tensor) -> None:
        offset = 0
        for parts, block_ids in segments:
            keep = [j for j, b in enumerate(block_ids) if b >= 0]
            idx = torch.tensor([block_ids[j] for j in keep], dtype=torch.long).to(payload.device, non_blocking=True)
            rows = None if len(keep) == len(block_ids) else torch.tensor(keep).to(payload.device, non_blocking=True)
            for tensor, dim, shape in parts:
                n = math.prod(shape)
                chunk = payload[offset:offset + n].view(shape)
                offset += n
                if keep:
                    tensor.index_copy_(dim, idx, chunk if rows is None else chunk.index_select(dim, rows))

    def report(self) -> tuple[list[list], dict[str, float]]:
        """(host-tier events, counters) for the step's RunnerOutput."""
        return [[k, p] for k, p in self.store.host_events()], self.store.counters.snapshot()

    def close(self) -> None:
        self.store.close()
