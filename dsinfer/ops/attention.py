"""Paged attention over a varlen batch (GQA, causal, optional sliding window).

The batch is flat: sequence b owns query rows ``query_start_loc[b]:query_start_loc[b+1]``; its context holds
``seq_lens[b]`` tokens, the last ``q_len`` of which are this step's queries (already stored in the cache), so
query i of sequence b sits at position ``seq_lens[b] - q_len + i`` and sees keys at positions ``<=`` its own
(and, with a window W, ``> position - W``). Keys and values are read from the paged cache through
``block_tables`` (``[B, max_blocks]``, row b lists sequence b's block ids; columns past its length are
ignored).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer import batch_invariant
from dsinfer.ops.dispatch import use_triton


def _gather_context(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int
) -> tuple[torch.Tensor, ...]:
    """K and V of positions [0, length) for every row of block_tables: [B, length, Hkv, D] each."""
    block_size = kv_cache.shape[2]
    pos = torch.arange(length, device=block_tables.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size
    flat = kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, Hkv, D]
    return flat[0][slots], flat[1][slots]


def _context_mask(q_pos: torch.Tensor, length: int, sliding_window: int | None) -> torch.Tensor:
    """[..., Q, length] boolean mask: key position visible from query position."""
    k_pos = torch.arange(length, device=q_pos.device)
    mask = k_pos <= q_pos.unsqueeze(-1)
    if sliding_window is not None:
        mask &= k_pos > q_pos.unsqueeze(-1) - sliding_window
    return mask


def _attend(q, k, v, mask, scale):
    # q: [B, Q, Hq, D]; k/v: [B, S, Hkv, D]; mask: [B, Q, S]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. Decode rows (one query) run as one padded batch; longer ones one by one.

    ``max_query_len`` / ``max_seq_len`` are hints for the Triton path (see ``paged_attention``); ignored here.
    """
    out = torch.empty_like(q)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    lens = seq_lens.tolist()
    starts = query_start_loc[:-1].tolist()
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    if decode:
        idx = torch.tensor(decode, device=q.device)
        length = max(lens[b] for b in decode)
        k, v = _gather_context(kv_cache, block_tables[idx], length)
        rows = query_start_loc[idx].long()
        q_pos = (seq_lens[idx] - 1).unsqueeze(1)  # [B, 1]
        mask = _context_mask(q_pos, length, sliding_window)
        out[rows] = _attend(q[rows].unsqueeze(1), k, v, mask, scale).squeeze(1).to(q.dtype)
    for b, n in enumerate(q_lens):
        if n <= 1:
            continue
        k, v = _gather_context(kv_cache, block_tables[b : b + 1], lens[b])
        q_pos = torch.arange(lens[b] - n, lens[b], device=q.device).unsqueeze(0)
        mask = _context_mask(q_pos, lens[b], sliding_window)
        rows = slice(starts[b], starts[b] + n)
        out[rows] = _attend(q[rows].unsqueeze(0), k, v, mask, scale).squeeze(0).to(q.dtype)
    return out


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """``max_query_len``: the longest query row, if the caller knows it (1 = decode-only batch: the split-KV
    decode kernel, no host sync, so the call can be captured in a CUDA graph); None: read query_start_loc.
    ``max_seq_len``: a fixed bound on seq_lens that sets the decode split count (None: block_tables' width).
    """
    if batch_invariant.is_enabled():  # deterministic mode: one fixed-order recipe for every query row
        from dsinfer.batch_invariant.attention import paged_attention_invariant

        return paged_attention_invariant(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window)
    if use_triton(q):
        from dsinfer.ops.triton.attention import paged_attention_triton

        return paged_attention_triton(
            q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
        )
    return paged_attention_ref(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window)
