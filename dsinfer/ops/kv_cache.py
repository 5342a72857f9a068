"""Write this step's keys and values into the paged KV cache.

Layout of a full-attention layer's cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(0 = K, 1 = V). ``slot_mapping[t] = block_id * block_size + offset`` for token t; a negative slot means
"do not store" (padding).

An FP8 cache (vLLM's ``kv_cache_dtype="fp8"``) holds ``k / k_scale`` and ``v / v_scale`` (per-layer scales,
``kv_scales``; 1.0 unless the checkpoint has them), saturated at the format's largest finite value; readers
multiply the scales back (``dequantize``). As in vLLM, the scales apply to FP8 caches only.
"""

from __future__ import annotations

import functools

import torch

from dsinfer.ops._common import FP8_DTYPES, copy_rows, dequantize, fp8_max, quantize, read_scales
from dsinfer.ops.dispatch import use_triton

__all__ = ["FP8_DTYPES", "StoredRows", "copy_rows", "dequantize", "fp8_max", "quantize", "read_scales", "store_kv",
           "store_kv_ref"]


class StoredRows:
    """Which rows of a step have a real slot (``keep``: a bool mask, or None when all have one), for the torch
    path's store. Computed on first use (one host sync) and shared by the layers of a step: a layer makes one per
    step from the batch (``batch.derive``) and passes it to every store."""

    def __init__(self, slot_mapping: torch.Tensor):
        self.slot_mapping = slot_mapping

    @functools.cached_property
    def keep(self) -> torch.Tensor | None:
        keep = self.slot_mapping >= 0
        return None if bool(keep.all()) else keep


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0), stored: StoredRows | None = None,
) -> None:
    """``stored``: the step's ``StoredRows`` of ``slot_mapping`` (None: worked out here)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    keep = (stored or StoredRows(slot_mapping)).keep
    if keep is not None:
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    copy_rows(flat[0], slot_mapping, quantize(k, kv_scales[0], kv_cache.dtype))
    copy_rows(flat[1], slot_mapping, quantize(v, kv_scales[1], kv_cache.dtype))


def store_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0), stored: StoredRows | None = None,
) -> None:
    """``stored``: the step's ``StoredRows`` (read by the torch path only; the kernel skips negative slots)."""
    if use_triton(kv_cache):
        from dsinfer.ops.triton.kv_cache import store_kv_triton

        store_kv_triton(k, v, kv_cache, slot_mapping, kv_scales, stored)
        return
    store_kv_ref(k, v, kv_cache, slot_mapping, kv_scales, stored)
