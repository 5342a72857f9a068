"""Batch-invariant MLA: every query row attends by one recipe, whatever kind of step computes it.

The default path attends decode rows in the absorbed form and rows of multi-token sequences (prefill, chunked
prefill, prefill after a prefix hit, tokens recomputed after a preemption) in the expanded form, so a token's
bits would depend on how it was scheduled. Here every row takes the absorbed form over the paged latent cache:

1. ``q_absorbed[t, h] = q_nope[t, h] @ W_UK[h]`` and, after attention, ``out[t, h] = latent[t, h] @ W_UV[h]^T``:
   batched per head with ``matmul.bmm_invariant`` (a row's bits do not depend on how many rows share the call);
2. attention of ``[q_absorbed | q_pe]`` against the cache rows ``[c | k_pe]`` (keys) and ``c`` (values), all
   heads of a row sharing the one latent "KV head":
   - CPU: the recipe of ``attention.py``: exact max, ``exp``, the weighted sum per fixed ``CHUNK``-key chunk
     (query rows x heads flattened into the M dimension of ``bmm_invariant``) accumulated over chunks in order
     with a sequential ``cumsum``; keys past a row's position are zeros and masked, so a row's result does not
     depend on the longest sequence of its group or on the rows it is grouped with;
   - CUDA: ``ops.triton.mla.mla_decode_triton`` (one program per query row and head tile, causal limit per
     row, cache rows visited in order in ``BLOCK_N`` tiles with an online softmax) with a fixed tile
     configuration and a fixed number of KV splits, ``TRITON_SPLITS`` = 1: never the split heuristic, which
     follows the batch size. (A larger constant would also be invariant, split bounds following from the row's
     own context length, but its float32 partials, [T, H, splits, R], get large on long prefill steps.)
"""

from __future__ import annotations

import torch

from dsinfer.batch_invariant.attention import host_layout, padded_slots
from dsinfer.batch_invariant.matmul import bmm_invariant
from dsinfer.ops import dispatch
from dsinfer.ops._common import cache_rows

CHUNK = 64
MAX_SCORE_ROWS = 4096  # query rows x heads per CPU group (bounds memory only: rows never interact)
TRITON_SPLITS = 1


def triton_config(num_heads: int, is_cuda: bool) -> dict:
    """The one tile configuration of the deterministic MLA kernel (a function of the head count only)."""
    if not is_cuda:
        return dict(block_h=16, block_n=16, num_warps=4, num_stages=1)
    return dict(block_h=min(64, max(16, 1 << (num_heads - 1).bit_length())), block_n=32,
                num_warps=4 if num_heads <= 16 else 8, num_stages=2)


def mla_attention_invariant(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, w_kv_b: torch.Tensor, scale: float,
    *, use_triton: bool | None = None,
) -> torch.Tensor:
    """q_nope [T, H, N], q_pe [T, H, P] (roped), w_kv_b [H, N + V, R] (kv_b_proj's weight per head) -> [T, H, V];
    batch conventions as in ``ops.mla``. ``use_triton`` (default: ``ops.dispatch.use_triton``, i.e. on CUDA) picks
    the kernel of step 2."""
    nope = q_nope.shape[-1]
    w_kv_b = w_kv_b.to(q_nope.dtype)
    q_absorbed = bmm_invariant(q_nope.transpose(0, 1), w_kv_b[:, :nope]).transpose(0, 1)  # [T, H, R]
    if dispatch.use_triton(q_nope) if use_triton is None else use_triton:
        from dsinfer.ops.triton.mla import mla_decode_triton

        latent = mla_decode_triton(
            q_absorbed.contiguous(), q_pe.contiguous(), kv_cache, block_tables, query_start_loc, seq_lens,
            scale, num_splits=TRITON_SPLITS, config=triton_config(q_nope.shape[1], q_nope.is_cuda),
        )
    else:
        latent = latent_attention(q_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, scale)
    w_uv_t = w_kv_b[:, nope:].transpose(1, 2)  # [H, R, V]
    return bmm_invariant(latent.to(q_nope.dtype).transpose(0, 1), w_uv_t).transpose(0, 1)


def _gather(kv_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, length: int) -> torch.Tensor:
    """Cache rows of positions [0, length) per row of block_tables: [G, length, R + P]; positions >= lens are 0."""
    slots, valid = padded_slots(block_tables, lens, length, kv_cache.shape[1])
    rows = cache_rows(kv_cache, slots).float()
    return rows.masked_fill(~valid.unsqueeze(-1), 0.0)


def _attend(q: torch.Tensor, ctx: torch.Tensor, q_pos: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """q [G, Q, H, R + P] (float32), ctx [G, L, R + P] (L a multiple of CHUNK), q_pos [G, Q] -> [G, Q, H, R]."""
    g, nq, h, d = q.shape
    length = ctx.shape[1]
    rows = nq * h
    scores = bmm_invariant(q.reshape(g, rows, d), ctx.transpose(1, 2).contiguous()).view(g, nq, h, length)
    scores = scores * scale
    visible = torch.arange(length, device=q.device) <= q_pos.unsqueeze(-1)  # [G, Q, L]
    scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
    peak = scores.amax(-1, keepdim=True)
    probs = torch.exp(scores - peak).view(g, rows, length)
    denom = probs.cumsum(-1)[..., -1:]  # sequential: trailing masked keys add exact zeros
    nc = length // CHUNK
    p_chunks = probs.view(g, rows, nc, CHUNK).transpose(1, 2).reshape(g * nc, rows, CHUNK)
    v_chunks = ctx[..., :rank].contiguous().view(g * nc, CHUNK, rank)
    partial = bmm_invariant(p_chunks, v_chunks).view(g, nc, rows, rank)
    out = partial.cumsum(1)[:, -1] / denom  # chunks summed in order
    return out.view(g, nq, h, rank)


def latent_attention(
    q_absorbed: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The CPU recipe of step 2: q_absorbed [T, H, R], q_pe [T, H, P] -> latent [T, H, R] (float32).

    One-token sequences (decode) run as one group; longer ones per sequence in groups of query rows."""
    num_rows, h, rank = q_absorbed.shape
    q = torch.cat((q_absorbed, q_pe), dim=-1).float()
    out = q.new_empty(num_rows, h, rank)
    starts, q_lens, lens, decode = host_layout(query_start_loc, seq_lens)
    if decode:
        idx = torch.tensor(decode, device=q.device)
        rows = query_start_loc[idx].long()
        length = -(-max(lens[b] for b in decode) // CHUNK) * CHUNK
        ctx = _gather(kv_cache, block_tables[idx], seq_lens[idx], length)
        q_pos = (seq_lens[idx] - 1).long().unsqueeze(1)
        out[rows] = _attend(q[rows].unsqueeze(1), ctx, q_pos, rank, scale)[:, 0]
    group = max(1, MAX_SCORE_ROWS // h)
    for b, n in enumerate(q_lens):
        if n <= 1:
            continue
        for first in range(0, n, group):
            count = min(group, n - first)
            end_pos = lens[b] - n + first + count  # keys needed: positions < end_pos
            ctx = _gather(kv_cache, block_tables[b:b + 1], seq_lens[b:b + 1], -(-end_pos // CHUNK) * CHUNK)
            q_pos = torch.arange(end_pos - count, end_pos, device=q.device).unsqueeze(0)
            rows = slice(starts[b] + first, starts[b] + first + count)
            out[rows] = _attend(q[rows].unsqueeze(0), ctx, q_pos, rank, scale)[0]
    return out
