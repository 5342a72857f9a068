"""Write this step's keys and values into the paged KV cache.

Layout of a full-attention layer's cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(0 = K, 1 = V). ``slot_mapping[t] = block_id * block_size + offset`` for token t; a negative slot means
"do not store" (padding).
"""

from __future__ import annotations

import torch

from dsinfer.ops.dispatch import use_triton

_last: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _stored_rows(slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """Rows with a real slot, or None when all have one; every layer of a step passes the same slot_mapping."""
    global _last
    if _last is None or _last[0] is not slot_mapping:
        keep = slot_mapping >= 0
        _last = (slot_mapping, None if bool(keep.all()) else keep)
    return _last[1]


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    keep = _stored_rows(slot_mapping)
    if keep is not None:
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def store_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if use_triton(kv_cache):
        from dsinfer.ops.triton.kv_cache import store_kv_triton

        store_kv_triton(k, v, kv_cache, slot_mapping)
        return
    store_kv_ref(k, v, kv_cache, slot_mapping)
