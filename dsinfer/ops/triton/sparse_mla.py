"""Triton sparse MLA (DeepSeek-V3.2): absorbed attention of each query row over its selected latent rows.

Grid (head tiles, query rows). A program holds ``BLOCK_H`` heads of one row and walks the row's selected cache
slots (``ops.sparse_mla``: -1 = none) in tiles of ``BLOCK_N``: each gathered tile of latent rows is the key
(``q_absorbed . c + q_pe . k_pe``) and the value (``p @ c``) for all heads of the tile, as in the dense decode
kernel (``ops.triton.mla``). One pass, no split: a row has at most ``index_topk`` keys. A row that selects
nothing (a CUDA graph's padding row) gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops._common import FP8_DTYPES
from dsinfer.ops.triton.mla import _LOG2E, _dot, _softmax_totals, _tile


@triton.jit
def _softmax_step(s, n_valid, scale_log2, m_i, l_i):
    """``ops.triton.mla``'s online-softmax step, safe for a row with no key yet: a running max still -inf is
    taken as 0, so the tile's weights and the rescale are 0 instead of NaN (a CUDA graph's padding rows select
    nothing at all)."""
    s = tl.where(n_valid[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _sparse_mla_kernel(
    qn_ptr, qp_ptr, cache_ptr, slots_ptr, out_ptr,
    num_heads, num_keys, scale_log2,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_c_row, stride_s_t, stride_ot, stride_oh,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
):
    head_tile = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    h_valid = offs_h < num_heads
    r_valid = offs_r < RANK
    p_valid = offs_p < ROPE
    qn = tl.load(qn_ptr + row * stride_qn_t + offs_h[:, None] * stride_qn_h + offs_r[None, :],
                 mask=h_valid[:, None] & r_valid[None, :], other=0.0)
    qp = tl.load(qp_ptr + row * stride_qp_t + offs_h[:, None] * stride_qp_h + offs_p[None, :],
                 mask=h_valid[:, None] & p_valid[None, :], other=0.0)
    if not FP8:  # products in the cache's dtype; an FP8 cache's tiles go to the query's instead
        qn, qp = qn.to(cache_ptr.dtype.element_ty), qp.to(cache_ptr.dtype.element_ty)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    for n0 in range(0, num_keys, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + row * stride_s_t + offs_n, mask=offs_n < num_keys, other=-1)
        n_valid = slot >= 0
        base = cache_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_c_row
        c = tl.load(base[:, None] + offs_r[None, :], mask=n_valid[:, None] & r_valid[None, :], other=0.0)
        k_pe = tl.load(base[:, None] + RANK + offs_p[None, :], mask=n_valid[:, None] & p_valid[None, :], other=0.0)
        c, k_pe = c.to(qn.dtype), k_pe.to(qn.dtype)
        s = _dot(qn, tl.trans(c), UPCAST) + _dot(qp, tl.trans(k_pe), UPCAST)  # [BLOCK_H, BLOCK_N]
        p, alpha, m_i, l_i = _softmax_step(s, n_valid, scale_log2, m_i, l_i)
        acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, UPCAST)
    denom, _ = _softmax_totals(m_i, l_i)
    tl.store(out_ptr + row * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :],
             (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=h_valid[:, None] & r_valid[None, :])


def sparse_mla_triton(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      slots: torch.Tensor, scale: float) -> torch.Tensor:
    """See ``ops.sparse_mla.sparse_mla_ref``."""
    num_rows, num_heads, rank = q_nope_absorbed.shape
    rope = q_pe.shape[-1]
    if not kv_cache.is_contiguous():
        raise ValueError("sparse MLA addresses the latent cache by slot: it must be contiguous")
    if q_nope_absorbed.stride(-1) != 1 or q_pe.stride(-1) != 1 or slots.stride(-1) != 1:
        raise ValueError("sparse MLA reads its queries and slots with a unit last stride")
    out = q_nope_absorbed.new_empty(num_rows, num_heads, rank)
    if num_rows == 0:
        return out
    # a [BLOCK_H, R] float32 accumulator per program: 16 heads at V3's rank 512 (32 KB), more at small ranks
    block_h = 16 if rank >= 256 else min(64, max(16, triton.next_power_of_2(num_heads)))
    grid = (triton.cdiv(num_heads, block_h), num_rows)
    _sparse_mla_kernel[grid](
        q_nope_absorbed, q_pe, kv_cache, slots, out,
        num_heads, slots.shape[1], scale * _LOG2E,
        q_nope_absorbed.stride(0), q_nope_absorbed.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(1), slots.stride(0), out.stride(0), out.stride(1),
        RANK=rank, ROPE=rope, BLOCK_R=_tile(rank), BLOCK_P=_tile(rope), BLOCK_H=block_h,
        BLOCK_N=32 if q_pe.is_cuda else 16, UPCAST=not q_pe.is_cuda, FP8=kv_cache.dtype in FP8_DTYPES,
        num_warps=4 if num_heads <= 16 else 8,
    )
    return out
