"""Triton ``apply_rotary``: one program per token rotates all heads of q and k (neox or interleaved pairs);
``rotary_store_kv_triton`` does the same but writes the rotated k, and v, straight into their KV-cache slot
(one launch instead of a rotary and a store kernel per layer, and no rotated-k tensor; an FP8 cache gets k / k_scale
and v / v_scale, saturated, as ``ops.kv_cache.quantize``).

The first ``rotary_dim`` features of each head are rotated in float32 with cos/sin read from
``cos_sin_cache[position]`` ([cos | sin], each rotary_dim / 2 wide); the rest of the head is copied through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops._common import fp8_max
from dsinfer.ops.triton.kv_cache import to_cache
from dsinfer.ops.triton.pdl import ROPE, enter, launch_args


@triton.jit
def _pair_offsets(j, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """The two offsets rotated together for pair j: (j, j + HALF) in neox style, (2j, 2j + 1) interleaved."""
    if IS_NEOX:
        return j, j + HALF
    return 2 * j, 2 * j + 1


@triton.jit
def _cos_sin_at(pos_ptr, cos_sin_ptr, stride_cos_sin, t, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """cos and sin ([1, BLOCK_HALF] float32, zero past HALF) at token t's position."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + j, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, t, cos, sin, scale, FP8_MAX: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, IS_NEOX: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (j < HALF)
    i1, i2 = _pair_offsets(j, HALF, IS_NEOX)
    src = x_ptr + t * stride_xt + h * stride_xh
    dst = out_ptr + t * stride_ot + h * stride_oh
    x1 = tl.load(src + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + i1, to_cache(x1 * cos - x2 * sin, scale, out_ptr, FP8_MAX), mask=mask)
    tl.store(dst + i2, to_cache(x2 * cos + x1 * sin, scale, out_ptr, FP8_MAX), mask=mask)
    if HEAD_DIM > 2 * HALF:  # features past rotary_dim pass through unchanged
        d = 2 * HALF + tl.arange(0, BLOCK_D)[None, :]
        keep = (h < NUM_HEADS) & (d < HEAD_DIM)
        tl.store(dst + d, to_cache(tl.load(src + d, mask=keep), scale, out_ptr, FP8_MAX), mask=keep)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_DIM: tl.constexpr, K_DIM: tl.constexpr,
    HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_QD: tl.constexpr, BLOCK_KD: tl.constexpr, IS_NEOX: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin_at(pos_ptr, cache_ptr, stride_cache, t, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, cos, sin, 1.0, 0.0,
                  NUM_Q_HEADS, Q_DIM, HALF, BLOCK_QH, BLOCK_HALF, BLOCK_QD, IS_NEOX)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, cos, sin, 1.0, 0.0,
                  NUM_K_HEADS, K_DIM, HALF, BLOCK_KH, BLOCK_HALF, BLOCK_KD, IS_NEOX)


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def apply_rotary_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool,
    angles=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``ops.rotary.apply_rotary`` (``angles`` is the torch path's: the kernel reads the cos/sin cache)."""
    q, k = _heads(q), _heads(k)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    rotary_dim = cache.shape[-1]
    half = rotary_dim // 2
    (num_tokens, q_heads, q_dim), (_, k_heads, k_dim) = q.shape, k.shape
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(
        k.shape, dtype=k.dtype, device=k.device
    )
    if num_tokens == 0:
        return q_out, k_out
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cache.stride(0),
        NUM_Q_HEADS=q_heads, NUM_K_HEADS=k_heads, Q_DIM=q_dim, K_DIM=k_dim, HALF=half,
        BLOCK_QH=triton.next_power_of_2(q_heads), BLOCK_KH=triton.next_power_of_2(k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QD=triton.next_power_of_2(max(q_dim - rotary_dim, 1)),
        BLOCK_KD=triton.next_power_of_2(max(k_dim - rotary_dim, 1)),
        IS_NEOX=is_neox, num_warps=4, **launch_args(positions.device, ROPE),
    )
    return q_out, k_out


@triton.jit
def _rotary_store_kv_kernel(
    pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_out_ptr, kv_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh, stride_cos_sin,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, block_size, k_scale, v_scale, FP8_MAX: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_REST: tl.constexpr, IS_NEOX: tl.constexpr, PDL: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    # the step's metadata and the rope table, read before the wait (``pdl``: no kernel of a forward writes them)
    cos, sin = _cos_sin_at(pos_ptr, cos_sin_ptr, stride_cos_sin, t, HALF, BLOCK_HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    enter(PDL)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, cos, sin, 1.0, 0.0,
                  NUM_Q_HEADS, HEAD_DIM, HALF, BLOCK_QH, BLOCK_HALF, BLOCK_REST, IS_NEOX)
    if slot >= 0:  # a negative slot (padding, or a token whose KV is not kept) stores nothing
        row = kv_cache_ptr + (slot // block_size) * stride_c_blk + (slot % block_size) * stride_c_off
        _rotate_heads(k_ptr, row, stride_kt, stride_kh, 0, stride_c_h, t, cos, sin, k_scale, FP8_MAX,
                      NUM_KV_HEADS, HEAD_DIM, HALF, BLOCK_KH, BLOCK_HALF, BLOCK_REST, IS_NEOX)
        h = tl.arange(0, BLOCK_KH)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(row + stride_c_kv + h * stride_c_h + d, to_cache(v, v_scale, kv_cache_ptr, FP8_MAX), mask=mask)


def rotary_store_kv_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    is_neox: bool, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0),
    angles=None, stored=None,
) -> torch.Tensor:
    """See ``ops.rotary.rotary_store_kv`` (``angles`` and ``stored`` are the torch path's)."""
    q, k, v = _heads(q), _heads(k), _heads(v)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must have a contiguous head dim, got strides {kv_cache.stride()}")
    rotary_dim = cache.shape[-1]
    (num_tokens, q_heads, head_dim), kv_heads = q.shape, k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    _rotary_store_kv_kernel[(num_tokens,)](
        positions, slot_mapping, q, k, v, cache, q_out, kv_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.shape[2],
        float(kv_scales[0]), float(kv_scales[1]), FP8_MAX=fp8_max(kv_cache.dtype),
        NUM_Q_HEADS=q_heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=rotary_dim // 2,
        BLOCK_QH=triton.next_power_of_2(q_heads), BLOCK_KH=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_REST=triton.next_power_of_2(max(head_dim - rotary_dim, 1)), IS_NEOX=is_neox, num_warps=4,
        **launch_args(positions.device, ROPE),
    )
    return q_out
