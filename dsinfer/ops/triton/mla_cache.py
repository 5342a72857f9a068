"""Triton writes of the MLA latent cache (rows ``[c | k_pe]``, see ``ops.mla``): the plain store, and the
per-step preamble that ropes, normalizes and stores in one kernel.

Preamble (``rope_norm_store_mla_triton``): one program per token ropes the query's rope part and the shared rope
key, RMS-normalizes the latent and stores ``[c | k_pe]``: one kernel where rotary, norm and store were three.
At a few decode tokens the same launch also absorbs W_UK into the query (``absorb``: more programs per token,
each a 128-column chunk of one head's ``q_nope @ W_UK``), where a batched GEMM on a side stream ran beside it.

An FP8 cache gets the rows saturated at the format's largest finite value (``to_cache`` with scale 1.0, see
``ops.mla``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops._common import fp8_max
from dsinfer.ops.triton.kv_cache import to_cache
from dsinfer.ops.triton.pdl import ROPE, enter, launch_args
from dsinfer.ops.triton.rotary import _cos_sin_at, _pair_offsets, _rotate_heads


@triton.jit
def _store_kernel(kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, stride_c, stride_p, stride_slot,
                  RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                  FP8_MAX: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    c = tl.load(kv_c_ptr + t.to(tl.int64) * stride_c + offs_r, mask=offs_r < RANK)
    p = tl.load(k_pe_ptr + t.to(tl.int64) * stride_p + offs_p, mask=offs_p < ROPE)
    row = cache_ptr + slot * stride_slot
    tl.store(row + offs_r, to_cache(c, 1.0, cache_ptr, FP8_MAX), mask=offs_r < RANK)
    tl.store(row + RANK + offs_p, to_cache(p, 1.0, cache_ptr, FP8_MAX), mask=offs_p < ROPE)


def store_mla_kv_triton(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """kv_c [T, R], k_pe [T, P] -> cache rows ``slot_mapping`` (negative slots skipped); no host sync."""
    num_tokens, rank = kv_c.shape
    rope = k_pe.shape[-1]
    if num_tokens == 0:
        return
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1:
        kv_c, k_pe = kv_c.contiguous(), k_pe.contiguous()
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    _store_kernel[(num_tokens,)](
        kv_c, k_pe, flat, slot_mapping, kv_c.stride(0), k_pe.stride(0), flat.stride(0),
        RANK=rank, ROPE=rope, BLOCK_R=triton.next_power_of_2(rank), BLOCK_P=triton.next_power_of_2(rope),
        FP8_MAX=fp8_max(kv_cache.dtype), num_warps=4, **launch_args(kv_c.device, ROPE),
    )


# ---- rope + latent norm + store (one kernel per step and layer), optionally with the query absorption ----

@triton.jit
def _rope_norm_store_token(
    t, cos, sin, slot, qp_ptr, qp_out_ptr, kv_c_ptr, k_pe_ptr, norm_w_ptr, cache_ptr,
    stride_qp_t, stride_qp_h, stride_qo_t, stride_qo_h, stride_c, stride_p, stride_slot, eps,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    j = tl.arange(0, BLOCK_HALF)[None, :]
    j_valid = j < HALF
    # the query's rope part, every head (padding rows too: harmless, and the output is fully written)
    _rotate_heads(qp_ptr, qp_out_ptr, stride_qp_t, stride_qp_h, stride_qo_t, stride_qo_h, t, cos, sin, 1.0, 0.0,
                  NUM_HEADS, 2 * HALF, HALF, BLOCK_H, BLOCK_HALF, 1, IS_NEOX)
    if slot >= 0:
        row = cache_ptr + slot * stride_slot
        # the latent: RMSNorm as ops.rms_norm (float32 statistics, rounded to x's dtype, times the weight)
        offs_r = tl.arange(0, BLOCK_R)
        r_valid = offs_r < RANK
        x = tl.load(kv_c_ptr + t * stride_c + offs_r, mask=r_valid, other=0.0)
        xf = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / RANK + eps)
        normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
        w = tl.load(norm_w_ptr + offs_r, mask=r_valid, other=0.0).to(tl.float32)
        tl.store(row + offs_r, to_cache((w * normed).to(x.dtype), 1.0, cache_ptr, FP8_MAX), mask=r_valid)
        # the shared rope key, rounded to its own dtype first (as rotary, then the store, would)
        i1, i2 = _pair_offsets(j, HALF, IS_NEOX)
        k_row = k_pe_ptr + t * stride_p
        k1 = tl.load(k_row + i1, mask=j_valid, other=0.0)
        k2 = tl.load(k_row + i2, mask=j_valid, other=0.0)
        k_ty = k1.dtype
        k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
        k1_out, k2_out = (k1f * cos - k2f * sin).to(k_ty), (k2f * cos + k1f * sin).to(k_ty)
        tl.store(row + RANK + i1, to_cache(k1_out, 1.0, cache_ptr, FP8_MAX), mask=j_valid)
        tl.store(row + RANK + i2, to_cache(k2_out, 1.0, cache_ptr, FP8_MAX), mask=j_valid)


@triton.jit
def _w_uk_tile(w_uk_ptr, h, c, stride_w_h, stride_w_n, p, NOPE: tl.constexpr, RANK: tl.constexpr,
               BLOCK_NOPE: tl.constexpr, BLOCK_C: tl.constexpr):
    """W_UK[h, :, c * BLOCK_C:][:BLOCK_C] as [BLOCK_NOPE, BLOCK_C] (zeros past the ends, and for program p = 0,
    the token's rope program: no memory read). A weight: no kernel writes it, so it may be read before the PDL
    wait."""
    offs_n = tl.arange(0, BLOCK_NOPE)[:, None]
    offs_c = c * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (offs_n < NOPE) & (offs_c < tl.where(p > 0, RANK, 0))
    return tl.load(w_uk_ptr + h.to(tl.int64) * stride_w_h + offs_n * stride_w_n + offs_c, mask=mask, other=0.0)


@triton.jit
def _rope_norm_store_kernel(
    pos_ptr, qp_ptr, qp_out_ptr, kv_c_ptr, k_pe_ptr, norm_w_ptr, cos_sin_ptr, cache_ptr, slot_ptr,
    qn_ptr, w_uk_ptr, qa_ptr,
    stride_qp_t, stride_qp_h, stride_qo_t, stride_qo_h, stride_c, stride_p, stride_cs, stride_slot, eps,
    stride_qn_t, stride_qn_h, stride_w_h, stride_w_n, stride_qa_t, stride_qa_h,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    FP8_MAX: tl.constexpr, ABSORB: tl.constexpr = False, NOPE: tl.constexpr = 1, BLOCK_NOPE: tl.constexpr = 1,
    BLOCK_C: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    """Program (t, 0): token t's rope, latent norm and cache store. With ABSORB, program (t, 1 + h * chunks + c)
    also writes chunk c of head h of the absorbed query: q_nope[t, h] @ W_UK[h] (float32 sums, rounded once)."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    if ABSORB:
        chunks: tl.constexpr = (RANK + BLOCK_C - 1) // BLOCK_C
        h = (tl.maximum(p, 1) - 1) // chunks
        c = (tl.maximum(p, 1) - 1) % chunks
        w = _w_uk_tile(w_uk_ptr, h, c, stride_w_h, stride_w_n, p, NOPE, RANK, BLOCK_NOPE, BLOCK_C)
    # the step's metadata and the rope table, read before the wait (``pdl``: no kernel of a forward writes them)
    cos, sin = _cos_sin_at(pos_ptr, cos_sin_ptr, stride_cs, t, HALF, BLOCK_HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    enter(PDL)
    if ABSORB:
        if p > 0:
            offs_n = tl.arange(0, BLOCK_NOPE)
            q = tl.load(qn_ptr + t * stride_qn_t + h * stride_qn_h + offs_n, mask=offs_n < NOPE, other=0.0)
            acc = tl.sum(q.to(tl.float32)[:, None] * w.to(tl.float32), axis=0)
            offs_c = c * BLOCK_C + tl.arange(0, BLOCK_C)
            tl.store(qa_ptr + t * stride_qa_t + h * stride_qa_h + offs_c, acc.to(qa_ptr.dtype.element_ty),
                     mask=offs_c < RANK)
            return
    _rope_norm_store_token(
        t, cos, sin, slot, qp_ptr, qp_out_ptr, kv_c_ptr, k_pe_ptr, norm_w_ptr, cache_ptr,
        stride_qp_t, stride_qp_h, stride_qo_t, stride_qo_h, stride_c, stride_p, stride_slot, eps,
        NUM_HEADS, RANK, HALF, BLOCK_H, BLOCK_R, BLOCK_HALF, IS_NEOX, FP8_MAX)


ABSORB_CHUNK = 128  # W_UK columns per absorbing program: a 128 x 128 bf16 tile (32 KiB)


def rope_norm_store_mla_triton(
    positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, cos_sin_cache: torch.Tensor, is_neox: bool, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    absorb: tuple[torch.Tensor, torch.Tensor] | None = None, angles=None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See ``ops.mla.rope_norm_store_mla`` (``angles`` is the torch path's): one program per token; with
    ``absorb`` = (q_nope [T, H, N], W_UK [H, N, R]) also ``H * R / ABSORB_CHUNK`` programs per token for the
    absorbed query, returned first. No host sync."""
    num_tokens, num_heads, rope = q_pe.shape
    rank = kv_c.shape[-1]
    q_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
    if absorb is not None:
        q_nope, w_uk = absorb
        nope = q_nope.shape[-1]
        if w_uk.shape != (num_heads, nope, rank) or w_uk.stride(-1) != 1 or q_nope.stride(-1) != 1:
            raise ValueError(f"absorb: W_UK must be [{num_heads}, {nope}, {rank}] and both it and q_nope must have "
                             f"unit stride in their last dim, got W_UK {tuple(w_uk.shape)} strides {w_uk.stride()}")
        q_abs = torch.empty(num_tokens, num_heads, rank, dtype=q_nope.dtype, device=q_nope.device)
        block_c = min(ABSORB_CHUNK, triton.next_power_of_2(rank))
        absorb_args = dict(ABSORB=True, NOPE=nope, BLOCK_NOPE=triton.next_power_of_2(nope), BLOCK_C=block_c)
        programs = 1 + num_heads * triton.cdiv(rank, block_c)
        strides = (q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1), q_abs.stride(0),
                   q_abs.stride(1))
    else:
        q_nope = w_uk = q_abs = q_out  # unused
        absorb_args, programs, strides = {}, 1, (0,) * 6
    result = q_out if absorb is None else (q_abs, q_out)
    if num_tokens == 0:
        return result
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1:
        kv_c, k_pe = kv_c.contiguous(), k_pe.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    half = rope // 2
    _rope_norm_store_kernel[(num_tokens, programs)](
        positions, q_pe, q_out, kv_c, k_pe, norm_weight, cache, flat, slot_mapping, q_nope, w_uk, q_abs,
        q_pe.stride(0), q_pe.stride(1), q_out.stride(0), q_out.stride(1), kv_c.stride(0), k_pe.stride(0),
        cache.stride(0), flat.stride(0), eps, *strides,
        NUM_HEADS=num_heads, RANK=rank, HALF=half, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_R=triton.next_power_of_2(rank), BLOCK_HALF=triton.next_power_of_2(half), IS_NEOX=is_neox,
        FP8_MAX=fp8_max(kv_cache.dtype), num_warps=4, **absorb_args, **launch_args(positions.device, ROPE),
    )
    return result
