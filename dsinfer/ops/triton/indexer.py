"""Triton lightning-indexer ops (DeepSeek-V3.2) over the paged indexer-key cache: the key store and the scores.

The store is a program per token that copies its key to its slot (negative: padding, skipped) with no host
read, so decode steps can be captured in a CUDA graph (the torch path's filter of padding rows syncs).

Scores: grid (key tiles, query rows). A program scores ``BLOCK_N`` key positions of one row's sequence: it
gathers the keys through the block table, multiplies them by all of the row's indexer heads at once (one
``[H, D] x [D, N]`` product), applies ReLU and the scale, and sums the heads weighted by the row's head weights,
in float32. Keys after the row's position (causal) and past the sequence score -inf, as does every key for a
padding row. The top-k over the scores is torch's (``ops.indexer.select_topk``; on CUDA a radix select).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops.triton.mla import _dot, _find_row_seq, _tile


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    num_seqs, num_heads, width, scale, first_row,
    stride_qt, stride_qh, stride_wt, stride_c_blk, stride_c_off, stride_bt, block_size, stride_ot,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    out_row = tl.program_id(1).to(tl.int64)
    row = tl.program_id(1) + first_row
    seq = _find_row_seq(query_start_loc_ptr, num_seqs, row)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    visible = tl.load(seq_lens_ptr + seq) - (q_end - 1 - row)  # causal: keys up to this row's position
    # a CUDA graph's padding row (past the last query) sees nothing: all -inf, so it selects no slot
    visible = tl.where(row < tl.load(query_start_loc_ptr + num_seqs), visible, 0)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < visible
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_valid = offs_h < num_heads
    d_valid = offs_d < HEAD_DIM
    row64 = row.to(tl.int64)
    q = tl.load(q_ptr + row64 * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_valid[:, None] & d_valid[None, :], other=0.0).to(cache_ptr.dtype.element_ty)
    w = tl.load(w_ptr + row64 * stride_wt + offs_h, mask=h_valid, other=0.0).to(tl.float32)
    block = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + offs_n // block_size, mask=n_valid,
                    other=0).to(tl.int64)
    k = tl.load(cache_ptr + block[:, None] * stride_c_blk + (offs_n % block_size)[:, None] * stride_c_off
                + offs_d[None, :], mask=n_valid[:, None] & d_valid[None, :], other=0.0)
    s = tl.maximum(_dot(q, tl.trans(k), UPCAST) * scale, 0.0)  # [BLOCK_H, BLOCK_N]
    score = tl.sum(s * w[:, None], axis=0)
    tl.store(out_ptr + out_row * stride_ot + offs_n, tl.where(n_valid, score, float("-inf")), mask=offs_n < width)


@triton.jit
def _store_keys_kernel(k_ptr, cache_ptr, slots_ptr, stride_kt, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK_D)
        key = tl.load(k_ptr + token.to(tl.int64) * stride_kt + offs, mask=offs < HEAD_DIM)
        tl.store(cache_ptr + slot * HEAD_DIM + offs, key.to(cache_ptr.dtype.element_ty), mask=offs < HEAD_DIM)


def store_index_keys_triton(k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """See ``ops.indexer.store_index_keys``."""
    if not index_cache.is_contiguous() or k.stride(-1) != 1:
        raise ValueError("the indexer-key store needs a contiguous cache and keys with a unit last stride")
    if k.shape[0]:
        head_dim = k.shape[-1]
        _store_keys_kernel[(k.shape[0],)](k, index_cache, slot_mapping, k.stride(0), HEAD_DIM=head_dim,
                                          BLOCK_D=triton.next_power_of_2(head_dim))


def indexer_scores_triton(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          scale: float, max_seq_len: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """See ``ops.indexer.indexer_scores_ref``."""
    _, num_heads, head_dim = q.shape
    first_row, end = rows or (0, q.shape[0])
    num_rows = end - first_row
    if q.stride(-1) != 1 or index_cache.stride(-1) != 1:
        raise ValueError("the indexer reads its queries and keys with a unit last stride")
    out = torch.empty(num_rows, max_seq_len, dtype=torch.float32, device=q.device)
    if num_rows == 0 or max_seq_len == 0:
        return out
    block_n = 64 if q.is_cuda else 16
    grid = (triton.cdiv(max_seq_len, block_n), num_rows)
    _index_scores_kernel[grid](
        q, weights, index_cache, block_tables, query_start_loc, seq_lens, out,
        query_start_loc.shape[0] - 1, num_heads, max_seq_len, scale, first_row,
        q.stride(0), q.stride(1), weights.stride(0), index_cache.stride(0), index_cache.stride(1),
        block_tables.stride(0), index_cache.shape[1], out.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=_tile(head_dim), BLOCK_H=_tile(num_heads), BLOCK_N=block_n,
        UPCAST=not q.is_cuda, num_warps=4,
    )
    return out
