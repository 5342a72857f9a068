"""Batch-invariant paged attention: a query row gets the same bits in a prefill chunk, in a decode batch, alone.

Every query row is computed by one recipe that sees only its own sequence's keys: scores against the keys
padded (with zeros, masked) to a multiple of ``CHUNK`` keys, the max over them (exact), ``exp``, and the
weighted sum of values done per fixed ``CHUNK``-key chunk and then accumulated over the chunks in order with a
sequential ``cumsum`` (masked keys and padded chunks add exact zeros, so extra padding never changes a bit).
Matmuls go through ``matmul.bmm_invariant`` (16-row blocks). Decode rows of a step are batched together (one
padded query row per sequence); longer query chunks run per sequence in groups of up to 256 rows. On CUDA the
Triton kernel in ``triton_kernels`` (one program per query row and head, fixed 64-key blocks in order).
"""

from __future__ import annotations

import torch

from dsinfer.batch_invariant.matmul import bmm_invariant
from dsinfer.ops._common import read_scales

CHUNK = 64
MAX_QUERY_ROWS = 256


def host_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor):
    """The batch on the host: (first row, query length, context length) per sequence, and the sequences with
    one query row (decode), which run as one group."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    return starts, q_lens, lens, [b for b, n in enumerate(q_lens) if n == 1]


def padded_slots(block_tables: torch.Tensor, lens: torch.Tensor, length: int, block_size: int):
    """(cache slots [G, length] of positions [0, length) per row of block_tables, valid [G, length]: position <
    lens); positions past a row's table read its last block (masked by ``valid``)."""
    pos = torch.arange(length, device=block_tables.device)
    col = (pos // block_size).clamp_max(block_tables.shape[1] - 1)
    slots = block_tables[:, col].long() * block_size + pos % block_size
    return slots, pos.unsqueeze(0) < lens.unsqueeze(1)


def _gather(kv_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, length: int):
    """K, V of positions [0, length) per row of block_tables ([G, length, Hkv, D]); positions >= lens are 0."""
    slots, valid = padded_slots(block_tables, lens, length, kv_cache.shape[2])
    flat = kv_cache.flatten(1, 2)
    k = flat[0][slots].float().masked_fill_(~valid[..., None, None], 0.0)  # float: an FP8 cache has no masked_fill
    v = flat[1][slots].float().masked_fill_(~valid[..., None, None], 0.0)
    return k, v


def _attend(q, k, v, q_pos, lens, scale, sliding_window, sinks=None):
    """q [G, Q, Hq, D], k/v [G, L, Hkv, D] (L a multiple of CHUNK), q_pos [G, Q] -> [G, Q, Hq, D] (float32)."""
    g, nq, hq, d = q.shape
    length, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    qh = q.float().permute(0, 2, 1, 3).reshape(g * hq, nq, d)
    kh = k.float().repeat_interleave(rep, dim=2).permute(0, 2, 3, 1).reshape(g * hq, d, length)
    vh = v.float().repeat_interleave(rep, dim=2).permute(0, 2, 1, 3)  # [G, Hq, L, D]
    scores = bmm_invariant(qh, kh).view(g, hq, nq, length) * scale
    k_pos = torch.arange(length, device=q.device)
    visible = (k_pos <= q_pos.unsqueeze(-1)) & (k_pos < lens.view(g, 1, 1))
    if sliding_window is not None:
        visible &= k_pos > q_pos.unsqueeze(-1) - sliding_window
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    peak = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    if sinks is not None:  # the head's sink logit: in the max and, after the keys, in the denominator
        sink = sinks.float().view(1, hq, 1, 1)
        peak = torch.maximum(peak, sink)
    probs = torch.exp(scores - peak)  # [G, Hq, Q, L]
    denom = probs.cumsum(-1)[..., -1:]
    if sinks is not None:
        denom = denom + torch.exp(sink - peak)
    nc = length // CHUNK
    p_chunks = probs.view(g, hq, nq, nc, CHUNK).permute(0, 1, 3, 2, 4).reshape(g * hq * nc, nq, CHUNK)
    v_chunks = vh.reshape(g * hq * nc, CHUNK, d)
    partial = bmm_invariant(p_chunks, v_chunks).view(g, hq, nc, nq, d)
    out = partial.cumsum(2)[:, :, -1] / denom  # [G, Hq, Q, D]
    return out.permute(0, 2, 1, 3)


def paged_attention_invariant(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0), sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``ops.paged_attention``. An FP8 cache's key scale joins the softmax scale and its value
    scale multiplies the output: the same two constants for every row, so rows stay batch-invariant."""
    k_scale, v_scale = read_scales(kv_cache.dtype, kv_scales)
    scale = scale * k_scale
    if q.is_cuda:
        from dsinfer.batch_invariant.triton_kernels import paged_attention_invariant_triton

        return paged_attention_invariant_triton(q, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                                sliding_window, v_scale, sinks)
    out = torch.empty_like(q)
    starts, q_lens, lens, decode = host_layout(query_start_loc, seq_lens)
    if decode:
        idx = torch.tensor(decode, device=q.device)
        rows = query_start_loc[idx].long()
        qd = q[rows].unsqueeze(1)  # [G, 1, Hq, D]
        length = -(-max(lens[b] for b in decode) // CHUNK) * CHUNK
        k, v = _gather(kv_cache, block_tables[idx], seq_lens[idx], length)
        q_pos = (seq_lens[idx] - 1).long().unsqueeze(1)
        res = _attend(qd, k, v, q_pos, seq_lens[idx], scale, sliding_window, sinks)
        out[rows] = (res[:, 0] * v_scale).to(q.dtype)
    for b, n in enumerate(q_lens):
        if n <= 1:
            continue
        for first in range(0, n, MAX_QUERY_ROWS):
            rows = min(MAX_QUERY_ROWS, n - first)
            last_pos = lens[b] - n + first + rows  # keys needed: positions < last_pos
            length = -(-last_pos // CHUNK) * CHUNK
            k, v = _gather(kv_cache, block_tables[b:b + 1], seq_lens[b:b + 1], length)
            q_pos = torch.arange(lens[b] - n + first, last_pos, device=q.device).unsqueeze(0)
            qs = q[starts[b] + first:starts[b] + first + rows].unsqueeze(0)
            res = _attend(qs, k, v, q_pos, seq_lens[b:b + 1], scale, sliding_window, sinks)
            out[starts[b] + first:starts[b] + first + rows] = (res[0] * v_scale).to(q.dtype)
    return out
