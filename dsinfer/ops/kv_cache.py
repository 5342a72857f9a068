"""Write this step's keys and values into the paged KV cache.

Layout of a full-attention layer's cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(0 = K, 1 = V). ``slot_mapping[t] = block_id * block_size + offset`` for token t; a negative slot means
"do not store" (padding).

An FP8 cache (vLLM's ``kv_cache_dtype="fp8"``) holds ``k / k_scale`` and ``v / v_scale`` (per-layer scales,
``kv_scales``; 1.0 unless the checkpoint has them), saturated at the format's largest finite value; readers
multiply the scales back (``dequantize``). As in vLLM, the scales apply to FP8 caches only.
"""

from __future__ import annotations

import torch

from dsinfer.ops.dispatch import use_triton

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_last: tuple[torch.Tensor, torch.Tensor | None] | None = None


def fp8_max(dtype: torch.dtype) -> float:
    """The saturation bound of an FP8 cache dtype, 0.0 for any other dtype (no clamp)."""
    return float(torch.finfo(dtype).max) if dtype in FP8_DTYPES else 0.0


def read_scales(cache_dtype: torch.dtype, kv_scales: tuple[float, float]) -> tuple[float, float]:
    """The (key, value) scales a reader of a cache of ``cache_dtype`` applies: 1.0 unless it is FP8."""
    return (float(kv_scales[0]), float(kv_scales[1])) if cache_dtype in FP8_DTYPES else (1.0, 1.0)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache dtype; FP8: x / scale, saturated (a plain cast of an out-of-range value gives NaN on CUDA)."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = fp8_max(dtype)
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values back in ``dtype`` (FP8: times their scale)."""
    if x.dtype not in FP8_DTYPES or scale == 1.0:
        return x.to(dtype)
    return x.to(dtype) * scale


def copy_rows(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst.index_copy_(0, index, rows)`` for any cache dtype (index_copy_ has no FP8 kernel on CPU: an FP8
    cache's rows are copied as bytes)."""
    if dst.element_size() == 1:
        dst, rows = dst.view(torch.uint8), rows.view(torch.uint8)
    dst.index_copy_(0, index, rows)


def _stored_rows(slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """Rows with a real slot, or None when all have one; every layer of a step passes the same slot_mapping."""
    global _last
    if _last is None or _last[0] is not slot_mapping:
        keep = slot_mapping >= 0
        _last = (slot_mapping, None if bool(keep.all()) else keep)
    return _last[1]


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    keep = _stored_rows(slot_mapping)
    if keep is not None:
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    copy_rows(flat[0], slot_mapping, quantize(k, kv_scales[0], kv_cache.dtype))
    copy_rows(flat[1], slot_mapping, quantize(v, kv_scales[1], kv_cache.dtype))


def store_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    if use_triton(kv_cache):
        from dsinfer.ops.triton.kv_cache import store_kv_triton

        store_kv_triton(k, v, kv_cache, slot_mapping, kv_scales)
        return
    store_kv_ref(k, v, kv_cache, slot_mapping, kv_scales)
