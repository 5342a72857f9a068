"""Sparse MLA (DeepSeek-V3.2): each query row attends only to the cache rows the indexer selected for it.

Absorbed form, as ``ops.mla.mla_decode`` (for every row, prefill included: with at most ``index_topk`` keys per
row, expanding per-head K/V for the whole context buys nothing): the caller folds W_UK into the query
(``q_nope_absorbed [T, H, R]``), scores are ``(q_nope_absorbed . c + q_pe . k_pe) * scale`` over the row's
selected latent rows, and the output is the attention-weighted latent [T, H, R] (the caller applies W_UV).

The selection is given as cache slots per row (``selected_slots``: ``block * block_size + offset``, -1 = none),
so the op needs no block table. A row's own token always qualifies; a row that selects nothing (padding)
gets zeros.
"""

from __future__ import annotations

import torch

from dsinfer.ops._common import FP8_DTYPES, cache_rows
from dsinfer.ops.dispatch import use_triton

ROWS_PER_CHUNK = 64  # the torch path gathers [rows, K, R + P] per chunk of query rows (bounded memory)


def selected_slots(positions: torch.Tensor, row_seq: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int) -> torch.Tensor:
    """positions [T, K] (key positions within each row's sequence, -1 = none), row_seq [T] -> cache slots
    [T, K] int64 (-1 = none)."""
    valid = positions >= 0
    pos = positions.long().clamp_min(0)
    blocks = block_tables[row_seq.unsqueeze(1), pos // block_size].long()
    return torch.where(valid, blocks * block_size + pos % block_size, -1)


def sparse_mla_ref(
    q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """q_nope_absorbed [T, H, R], q_pe [T, H, P], kv_cache [blocks, block_size, R + P], slots [T, K]
    -> attention-weighted latent [T, H, R] over each row's selected rows."""
    rank = q_nope_absorbed.shape[-1]
    # the cache's dtype (a test's float64 reference), except an FP8 cache, read in the query's
    dtype = q_nope_absorbed.dtype if kv_cache.dtype in FP8_DTYPES else kv_cache.dtype
    q = torch.cat((q_nope_absorbed, q_pe), dim=-1).to(dtype)
    out = q_nope_absorbed.new_empty(q_nope_absorbed.shape)
    for lo in range(0, q.shape[0], ROWS_PER_CHUNK):
        rows = slice(lo, lo + ROWS_PER_CHUNK)
        s = slots[rows]
        ctx = cache_rows(kv_cache, s.clamp_min(0)).to(dtype)  # [n, K, R + P]
        scores = torch.einsum("nhc,nkc->nhk", q[rows], ctx) * scale
        scores = scores.masked_fill((s < 0).unsqueeze(1), float("-inf"))
        weights = scores.softmax(-1).nan_to_num_(0.0)  # a row that selects nothing (padding): zeros
        out[rows] = torch.einsum("nhk,nkr->nhr", weights, ctx[..., :rank]).to(out.dtype)
    return out


def sparse_mla(q_nope_absorbed, q_pe, kv_cache, slots, scale) -> torch.Tensor:
    """See ``sparse_mla_ref``."""
    if use_triton(q_nope_absorbed):
        from dsinfer.ops.triton.sparse_mla import sparse_mla_triton

        return sparse_mla_triton(q_nope_absorbed, q_pe, kv_cache, slots, scale)
    return sparse_mla_ref(q_nope_absorbed, q_pe, kv_cache, slots, scale)
