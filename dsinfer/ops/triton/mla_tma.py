"""MLA absorbed decode with the latent read by TMA (Hopper tensor-memory copies): ``ops.triton.mla``'s decode
kernel for the shapes where the copy engine can fetch whole key tiles.

Same grid, splits, partials and reduce as ``ops.triton.mla._mla_decode_kernel``; what differs is how a tile of
cache rows reaches shared memory. There, every thread computes the addresses of its part of the tile from the
block table and loads them (masked): address arithmetic and predicates per element, and a tile that cannot be
fetched until its block-table entry has come back. Here each *full* tile (every row valid, one cache block) is one
TMA copy per latent chunk plus one for the rope key, issued from a single block-table read; the last, partial tile
of a split takes the masked pointer loads (rows past the context may hold anything, NaN included, and a
0-weight times NaN row would poison the output).

The latent rank is split in ``NUM_C`` chunks of ``BLOCK_C`` columns (a TMA box is at most 256 wide): two score
dots and two value accumulators at rank 512. On the H200 at H=16 (V2-Lite), B=128, 4k context, tuned and
CUDA-graph timed: 0.162 ms (89% of the copy rate) with 6 pipeline stages, which give the copies two shared buffers
(4 stages: one buffer, 0.186 ms); the pointer-load kernel took 0.230 ms in session 5 (docs/benchmarks.md).

An FP8 cache (``ops.mla``) is fetched as FP8 and widened to fp16 (a bf16 query, multiplied in fp16) or to the
query's dtype before the products: 0.216 ms at the same shape, slower than a bf16 cache, since the latent tile is
wgmma's shared-memory operand of both products and each widened tile goes back through shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops.triton.attention import widen_fp8
from dsinfer.ops.triton.mla import _dot, _row_split, _softmax_step, _softmax_totals
from dsinfer.ops.triton.pdl import enter, launch_args

_MAX_BOX = 256  # widest TMA box dimension (elements)


def tma_chunks(rank: int, rope_tile: int, cache: torch.Tensor, block_n: int) -> int | None:
    """Latent chunks (1 or 2) when the TMA kernel can serve this cache, else None: a power-of-two rank of at
    most two boxes, a contiguous cache with 16-byte aligned rows, blocks a whole number of key tiles."""
    row_bytes = cache.shape[-1] * cache.element_size()
    if (rank & (rank - 1) or not 16 <= rank <= 2 * _MAX_BOX or rope_tile > _MAX_BOX or not cache.is_contiguous()
            or row_bytes % 16 or cache.data_ptr() % 16 or cache.shape[1] % block_n):
        return None
    return max(1, rank // _MAX_BOX)


@triton.jit
def _widen(c0, c1, k_pe, qn_ptr, NUM_C: tl.constexpr, F16: tl.constexpr, FP8_CVT: tl.constexpr):
    """An FP8 cache tile (latent chunks, rope key) in the products' dtype: fp16 (``F16``, a bf16 query on the GPU,
    which ``_attend`` then casts to fp16 too) or the query's dtype."""
    if F16:
        ty: tl.constexpr = tl.float16
    else:
        ty: tl.constexpr = qn_ptr.dtype.element_ty
    c0 = widen_fp8(c0, ty, FP8_CVT)
    if NUM_C == 2:
        c1 = widen_fp8(c1, ty, FP8_CVT)
    else:
        c1 = c0
    return c0, c1, widen_fp8(k_pe, ty, FP8_CVT)


@triton.jit
def _attend(qn_ptrs, qp_ptrs, q_mask, qp_mask, c0, c1, k_pe, n_valid, m_i, l_i, acc0, acc1, scale_log2,
            BLOCK_C: tl.constexpr, NUM_C: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile for all heads of the program: scores over the latent chunks and the rope key, online
    softmax, values from the same latent chunks. The query is re-read (L1) rather than held in registers."""
    qn0 = tl.load(qn_ptrs, mask=q_mask, other=0.0).to(c0.dtype)
    s = _dot(qn0, tl.trans(c0), UPCAST)
    if NUM_C == 2:
        qn1 = tl.load(qn_ptrs + BLOCK_C, mask=q_mask, other=0.0).to(c0.dtype)
        s += _dot(qn1, tl.trans(c1), UPCAST)
    qp = tl.load(qp_ptrs, mask=qp_mask, other=0.0).to(c0.dtype)
    s += _dot(qp, tl.trans(k_pe), UPCAST)
    p, alpha, m_i, l_i = _softmax_step(s, n_valid, scale_log2, m_i, l_i)
    pc = p.to(c0.dtype)
    acc0 = acc0 * alpha[:, None] + _dot(pc, c0, UPCAST)
    if NUM_C == 2:
        acc1 = acc1 * alpha[:, None] + _dot(pc, c1, UPCAST)
    return m_i, l_i, acc0, acc1


@triton.jit
def _store(acc, col0, denom, row64, offs_h, h_valid, split, num_heads, num_splits, out_ptr, part_out_ptr,
           stride_ot, stride_oh, RANK: tl.constexpr, BLOCK_C: tl.constexpr, SINGLE: tl.constexpr):
    offs_c = col0 + tl.arange(0, BLOCK_C)
    out = acc / denom[:, None]
    if SINGLE:
        tl.store(out_ptr + row64 * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_valid[:, None])
    else:
        part = (row64 * num_heads + offs_h) * num_splits + split  # part_* [T, H, S(, R)]
        tl.store(part_out_ptr + part[:, None] * RANK + offs_c[None, :], out, mask=h_valid[:, None])


@triton.jit
def _mla_decode_tma_kernel(
    qn_ptr, qp_ptr, cache_ptr, c_desc, p_desc, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    num_seqs, num_heads, scale_log2, num_splits,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    stride_c_blk, stride_c_off, stride_bt, block_size, stride_ot, stride_oh,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, NUM_C: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, UPCAST: tl.constexpr,
    FP8: tl.constexpr, F16: tl.constexpr, FP8_CVT: tl.constexpr, PDL: tl.constexpr = False,
):
    head_tile = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    # the step's metadata, read before the wait (``pdl``: no kernel of a forward writes it)
    num_rows = tl.load(query_start_loc_ptr + num_seqs)
    seq, start, end = _row_split(query_start_loc_ptr, seq_lens_ptr, num_seqs, row, split, num_splits, BLOCK_N)
    enter(PDL)
    if row >= num_rows:
        return  # padding row
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N

    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_p = tl.arange(0, BLOCK_P)
    h_valid = offs_h < num_heads
    p_valid = offs_p < ROPE
    row64 = row.to(tl.int64)
    qn_ptrs = qn_ptr + row64 * stride_qn_t + offs_h[:, None] * stride_qn_h + offs_c[None, :]
    qp_ptrs = qp_ptr + row64 * stride_qp_t + offs_h[:, None] * stride_qp_h + offs_p[None, :]
    q_mask = h_valid[:, None]
    qp_mask = h_valid[:, None] & p_valid[None, :]
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc0 = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
    acc1 = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
    block_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    all_valid = tl.full((BLOCK_N,), 1, tl.int1)
    for n0 in range(start, full_end, BLOCK_N):  # whole tiles inside one block: TMA
        r0 = tl.load(block_row_ptr + n0 // block_size) * block_size + n0 % block_size
        c0 = c_desc.load([r0, 0])
        if NUM_C == 2:
            c1 = c_desc.load([r0, BLOCK_C])
        else:
            c1 = c0
        k_pe = p_desc.load([r0, RANK])  # columns past R + P come back as zeros
        if FP8:  # an FP8 cache's tiles are multiplied in the query's dtype
            c0, c1, k_pe = _widen(c0, c1, k_pe, qn_ptr, NUM_C, F16, FP8_CVT)
        m_i, l_i, acc0, acc1 = _attend(qn_ptrs, qp_ptrs, q_mask, qp_mask, c0, c1, k_pe, all_valid, m_i, l_i,
                                       acc0, acc1, scale_log2, BLOCK_C, NUM_C, UPCAST)
    if full_end < end:  # the partial last tile: masked loads, rows past the context read as zeros
        offs_n = full_end + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        block = tl.load(block_row_ptr + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
        base = cache_ptr + block * stride_c_blk + (offs_n % block_size) * stride_c_off
        c0 = tl.load(base[:, None] + offs_c[None, :], mask=n_valid[:, None], other=0.0)
        if NUM_C == 2:
            c1 = tl.load(base[:, None] + BLOCK_C + offs_c[None, :], mask=n_valid[:, None], other=0.0)
        else:
            c1 = c0
        k_pe = tl.load(base[:, None] + RANK + offs_p[None, :], mask=n_valid[:, None] & p_valid[None, :],
                       other=0.0)
        if FP8:
            c0, c1, k_pe = _widen(c0, c1, k_pe, qn_ptr, NUM_C, F16, FP8_CVT)
        m_i, l_i, acc0, acc1 = _attend(qn_ptrs, qp_ptrs, q_mask, qp_mask, c0, c1, k_pe, n_valid, m_i, l_i,
                                       acc0, acc1, scale_log2, BLOCK_C, NUM_C, UPCAST)
    denom, lse = _softmax_totals(m_i, l_i)
    _store(acc0, 0, denom, row64, offs_h, h_valid, split, num_heads, num_splits, out_ptr, part_out_ptr,
           stride_ot, stride_oh, RANK, BLOCK_C, SINGLE)
    if NUM_C == 2:
        _store(acc1, BLOCK_C, denom, row64, offs_h, h_valid, split, num_heads, num_splits, out_ptr, part_out_ptr,
               stride_ot, stride_oh, RANK, BLOCK_C, SINGLE)
    if not SINGLE:
        tl.store(part_lse_ptr + (row64 * num_heads + offs_h) * num_splits + split, lse, mask=h_valid)


def launch_tma_decode(grid, q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, out,
                      part_out, part_lse, scale_log2: float, num_splits: int, num_chunks: int, block_p: int,
                      block_h: int, cfg: dict, fp8: dict) -> None:
    """Launch the TMA kernel (``ops.triton.mla.mla_decode_triton`` decides when and sizes everything)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_rows, num_heads, rank = q_nope_absorbed.shape
    block_n, block_c = cfg["block_n"], rank // num_chunks
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    c_desc = TensorDescriptor.from_tensor(rows, [block_n, block_c])
    p_desc = TensorDescriptor.from_tensor(rows, [block_n, block_p])
    _mla_decode_tma_kernel[grid](
        q_nope_absorbed, q_pe, kv_cache, c_desc, p_desc, block_tables, query_start_loc, seq_lens,
        out, part_out, part_lse,
        query_start_loc.shape[0] - 1, num_heads, scale_log2, num_splits,
        q_nope_absorbed.stride(0), q_nope_absorbed.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0), kv_cache.shape[1],
        out.stride(0), out.stride(1),
        RANK=rank, ROPE=q_pe.shape[-1], BLOCK_C=block_c, NUM_C=num_chunks, BLOCK_P=block_p, BLOCK_H=block_h,
        BLOCK_N=block_n, SINGLE=num_splits == 1, UPCAST=not q_nope_absorbed.is_cuda,
        **fp8, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_args(q_nope_absorbed.device),
    )
