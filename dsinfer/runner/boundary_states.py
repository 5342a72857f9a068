"""The runner's side of ``BoundaryStateSpec``: state slots restored from, and kept into, their blocks' ends.

A model with per-sequence state (DeepSeek-V4's window rings and compressor rows) keeps, with prefix caching or the
KV store, in each block the slot's rows at that block's end. Two copies happen outside the layers' forward:
- ``restore``: a request that starts past 0 (a prefix-cache hit, a KV store load, a preempted request's own
  cached prefix) gets its slot's rings filled from the last block of its prefix before its first step, so the
  step reads what it would have read had it computed the prefix itself;
- ``save``: after a step, every block end the step reached whose rows its rings still hold
  (``ring_keeps_boundary``: decode steps, and the last block end of a prompt chunk) is copied from the rings,
  which also serves steps run as a CUDA graph; the layers capture the other block ends during the forward.
Rows of negative positions (a block end before the window's first position) are never restored.
"""

from __future__ import annotations

import numpy as np
import torch

from dsinfer.core.kv_cache_spec import ring_keeps_boundary
from dsinfer.runner.input_batch import to_device_packed


def boundaries_after_step(num_computed: int, num_new: int, block_size: int, max_draft_tokens: int) -> list[int]:
    """The block ends a step of ``num_new`` tokens after ``num_computed`` reaches whose rows its rings hold."""
    end = num_computed + num_new
    return [b for b in range((num_computed // block_size + 1) * block_size, end + 1, block_size)
            if ring_keeps_boundary(end, b, max_draft_tokens)]


def save(layers: list, items: list[tuple[int, int, int]]) -> None:
    """Copy each (state slot, block end B, block id) from the slot's rings into the block, in every layer."""
    if not items:
        return
    device = layers[0].state["window"].device
    slots, ends, blocks = to_device_packed([np.asarray(col, np.int64) for col in zip(*items)], device)
    for layer in layers:
        for name, out in layer.boundary.rings.items():
            ring, rows = layer.state[name], out.shape[1]
            if not rows:
                continue
            pos = ends.unsqueeze(-1) - rows + torch.arange(rows, device=device)  # [n, rows]
            values = ring[slots.unsqueeze(-1), pos % ring.shape[1]]
            out[blocks] = values.to(out.dtype)


def restore(layers: list, slot: int, end: int, block_id: int) -> None:
    """Fill state slot ``slot``'s rings with block ``block_id``'s rows: the state at position ``end``."""
    for layer in layers:
        for name, saved in layer.boundary.rings.items():
            ring, rows = layer.state[name], saved.shape[1]
            first = max(rows - end, 0)  # rows of negative positions hold nothing
            if first >= rows:
                continue
            pos = torch.arange(end - rows + first, end, device=ring.device)
            ring[slot, pos % ring.shape[1]] = saved[block_id, first:].to(ring.dtype)
