"""Triton ``store_kv``: one program per token copies its K and V rows to their cache slot (negative: skip),
divided by the layer's scales and saturated when the cache is FP8 (see ``ops.kv_cache``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops._common import fp8_max
from dsinfer.ops.triton.pdl import enter, launch_args


@triton.jit
def to_cache(x, scale, cache_ptr, FP8_MAX: tl.constexpr):
    """x as stored in the cache: x / scale, saturated at FP8_MAX (0: not an FP8 cache, plain cast)."""
    if FP8_MAX > 0:
        x = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h,
    block_size, k_scale, v_scale,
    FP8_MAX: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + block * stride_c_blk + offset * stride_c_off + h * stride_c_h + d
    tl.store(dst, to_cache(k, k_scale, cache_ptr, FP8_MAX), mask=mask)
    tl.store(dst + stride_c_kv, to_cache(v, v_scale, cache_ptr, FP8_MAX), mask=mask)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0), stored=None,
) -> None:
    """See ``ops.kv_cache.store_kv`` (``stored`` is the torch path's; the kernel skips negative slots)."""
    num_tokens = slot_mapping.shape[0]
    _, _, block_size, num_heads, head_dim = kv_cache.shape
    if num_tokens == 0:
        return
    k = k.reshape(num_tokens, num_heads, head_dim)
    v = v.reshape(num_tokens, num_heads, head_dim)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must have a contiguous head dim, got strides {kv_cache.stride()}")
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_size, float(kv_scales[0]), float(kv_scales[1]),
        FP8_MAX=fp8_max(kv_cache.dtype), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4, **launch_args(k.device),
    )
