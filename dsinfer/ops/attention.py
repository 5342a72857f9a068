"""Paged attention over a varlen batch (GQA, causal, optional sliding window, optional attention sinks).

The batch is flat: sequence b owns query rows ``query_start_loc[b]:query_start_loc[b+1]``; its context holds
``seq_lens[b]`` tokens, the last ``q_len`` of which are this step's queries (already stored in the cache), so
query i of sequence b sits at position ``seq_lens[b] - q_len + i`` and sees keys at positions ``<=`` its own
(and, with a window W, ``> position - W``). Keys and values are read from the paged cache through
``block_tables`` (``[B, max_blocks]``, row b lists sequence b's block ids; columns past its length are
ignored). ``kv_scales`` are an FP8 cache's (key, value) scales (``ops.kv_cache``); other caches ignore them.
``sinks`` ([Hq] float32, GPT-OSS): one learned logit per query head that joins the softmax's denominator and
attends to nothing (``exp(sink)`` is added to the sum of ``exp(score)``; its value row is zero).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsinfer import batch_invariant
from dsinfer.ops._common import dequantize
from dsinfer.ops.dispatch import use_triton


@dataclass
class _Plan:
    """Gather indices and masks of one batch layout (``AttentionPlan.layout``)."""

    decode_rows: torch.Tensor | None  # [Bd] query rows of one-token sequences
    decode_slots: torch.Tensor | None  # [Bd, L] cache slots of their contexts (padded)
    decode_mask: torch.Tensor | None  # [Bd, 1, L]; None when every key is visible to every row
    all_decode: bool  # every query row is a one-token sequence, in order: no row gather or scatter needed
    prefills: list[tuple[slice, torch.Tensor, torch.Tensor | None]]  # (rows, slots [1, L], mask [1, Q, L] / causal)


def _slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length, device=block_tables.device)
    return block_tables[:, pos // block_size].long() * block_size + pos % block_size


def _context_mask(q_pos: torch.Tensor, length: int, sliding_window: int | None) -> torch.Tensor:
    """[..., Q, length] boolean mask: key position visible from query position."""
    k_pos = torch.arange(length, device=q_pos.device)
    mask = k_pos <= q_pos.unsqueeze(-1)
    if sliding_window is not None:
        mask &= k_pos > q_pos.unsqueeze(-1) - sliding_window
    return mask


def _build_plan(block_tables, query_start_loc, seq_lens, sliding_window, block_size) -> _Plan:
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    lens, starts = seq_lens.tolist(), query_start_loc[:-1].tolist()
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    plan = _Plan(None, None, None, len(decode) == len(q_lens), [])
    if decode:
        idx = torch.tensor(decode, device=block_tables.device)
        length = max(lens[b] for b in decode)
        plan.decode_rows = query_start_loc[idx].long()
        plan.decode_slots = _slots(block_tables[idx], length, block_size)
        uniform = all(lens[b] == length for b in decode) and (sliding_window is None or length <= sliding_window)
        if not uniform:  # with equal lengths and no window every key is visible: no mask needed
            plan.decode_mask = _context_mask((seq_lens[idx] - 1).unsqueeze(1), length, sliding_window)
    for b, n in enumerate(q_lens):
        if n > 1:
            mask = None  # a whole prompt without a window is plain causal attention
            if lens[b] != n or (sliding_window is not None and n > sliding_window):
                q_pos = torch.arange(lens[b] - n, lens[b], device=block_tables.device).unsqueeze(0)
                mask = _context_mask(q_pos, lens[b], sliding_window)
            plan.prefills.append((slice(starts[b], starts[b] + n), _slots(block_tables[b:b + 1], lens[b], block_size),
                                  mask))
    return plan


class AttentionPlan:
    """The torch path's gather plan of a batch layout (``layout``), built on first use (host syncs: this path runs
    eagerly) and shared: a layer makes one per step from the batch (``batch.derive``) and passes it to every
    attention call of the step. The Triton and deterministic paths never build it."""

    def __init__(self, block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 sliding_window: int | None, block_size: int, native_decode: bool = False):
        """``native_decode``: a float32 decode-only step takes the C++ kernel (``decode_attention_cpu``: a
        quantized CPU model's layers ask for it; float32 results differ from this path's by rounding)."""
        self.block_tables, self.query_start_loc, self.seq_lens = block_tables, query_start_loc, seq_lens
        self.sliding_window, self.block_size, self.native_decode = sliding_window, block_size, native_decode

    @functools.cached_property
    def layout(self) -> _Plan:
        return _build_plan(self.block_tables, self.query_start_loc, self.seq_lens, self.sliding_window,
                           self.block_size)


def _attend(q, k, v, mask, scale, causal: bool = False):
    # q: [B, Q, Hq, D]; k/v: [B, S, Hkv, D]; mask: [B, Q, S], or None (all visible / plain causal when Q == S)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=None if mask is None else mask.unsqueeze(1), is_causal=causal and mask is None, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _attend_sinks(q, k, v, mask, scale, sinks):
    """``_attend`` with a sink logit per query head in the denominator. q: [1, Q, Hq, D]; k/v: [1, S, Hkv, D]."""
    nq, heads, length = q.shape[1], q.shape[2], k.shape[1]
    rep = heads // k.shape[2]
    kh, vh = k[0].repeat_interleave(rep, dim=1), v[0].repeat_interleave(rep, dim=1)  # [S, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q[0], kh).float() * scale  # [Hq, Q, S]
    if mask is None:  # plain causal over the whole context
        q_pos = torch.arange(length - nq, length, device=q.device)
        mask = _context_mask(q_pos, length, None).unsqueeze(0)
    scores.masked_fill_(~mask, float("-inf"))
    probs = _softmax_with_sinks(scores, sinks.float().view(heads, 1, 1))
    return torch.einsum("hqk,khd->qhd", probs.to(v.dtype), vh).unsqueeze(0)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim with one more logit (``sinks``, broadcast to scores[..., :1]) that is dropped."""
    combined = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
    return combined.softmax(-1)[..., :-1]


def _attend_decode(q, k, v, mask, scale, sinks=None):
    """One query per sequence as two batched matmuls. q: [B, Hq, D]; k/v: [B, S, Hkv, D]; mask: [B, 1, S] or None.

    On CPU this beats ``scaled_dot_product_attention`` for a single query row (1.3x in float32, 17x in bfloat16,
    whose CPU flash kernel has no fast one-row path). The query heads of a group share their key rows, so GQA
    needs no repeat: q is viewed as [B, Hkv, group, D].
    """
    batch, num_heads, dim = q.shape
    num_kv = k.shape[2]
    qg = q.view(batch, num_kv, num_heads // num_kv, dim)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B, Hkv, group, S]
    if mask is not None:
        scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1).to(v.dtype)
    else:
        probs = _softmax_with_sinks(scores, sinks.float().view(num_kv, num_heads // num_kv, 1)).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).view(batch, num_heads, dim)  # [B, Hkv, group, D] -> [B, Hq, D]


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
    kv_scales: tuple[float, float] = (1.0, 1.0),
    plan: AttentionPlan | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. Decode rows (one query) run as one padded batch; longer ones one by one.

    ``max_query_len`` / ``max_seq_len`` are hints for the Triton path (see ``paged_attention``); ignored here.
    ``plan``: the step's ``AttentionPlan`` of these batch tensors, window and block size (None: made here).
    """
    out = torch.empty_like(q)
    if plan is None:
        plan = AttentionPlan(block_tables, query_start_loc, seq_lens, sliding_window, kv_cache.shape[2])
    elif (plan.sliding_window, plan.block_size) != (sliding_window, kv_cache.shape[2]):
        raise ValueError(f"the attention plan was made for window {plan.sliding_window} and blocks of "
                         f"{plan.block_size}, the call has {sliding_window} and {kv_cache.shape[2]}")
    plan = plan.layout
    flat = kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, Hkv, D]
    if plan.decode_rows is not None:
        kv = flat[:, plan.decode_slots]  # [2, Bd, L, Hkv, D]: keys and values in one gather
        k, v = dequantize(kv[0], kv_scales[0], q.dtype), dequantize(kv[1], kv_scales[1], q.dtype)
        if plan.all_decode:
            return _attend_decode(q, k, v, plan.decode_mask, scale, sinks).to(q.dtype)
        rows = plan.decode_rows
        out[rows] = _attend_decode(q[rows], k, v, plan.decode_mask, scale, sinks).to(q.dtype)
    for rows, slots, mask in plan.prefills:
        k, v = dequantize(flat[0][slots], kv_scales[0], q.dtype), dequantize(flat[1][slots], kv_scales[1], q.dtype)
        if sinks is None:
            res = _attend(q[rows].unsqueeze(0), k, v, mask, scale, causal=True)
        else:
            res = _attend_sinks(q[rows].unsqueeze(0), k, v, mask, scale, sinks)
        out[rows] = res.squeeze(0).to(q.dtype)
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
    kv_scales: tuple[float, float] = (1.0, 1.0),
    plan: AttentionPlan | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``plan``: the step's ``AttentionPlan``, read by the torch path only (see ``paged_attention_ref``).
    ``max_query_len``: the longest query row, if the caller knows it (1 = decode-only batch: the split-KV
    decode kernel, no host sync, so the call can be captured in a CUDA graph); None: read query_start_loc.
    ``max_seq_len``: a fixed bound on seq_lens that sets the decode split count (None: block_tables' width).
    """
    if batch_invariant.is_enabled():  # deterministic mode: one fixed-order recipe for every query row
        from dsinfer.batch_invariant.attention import paged_attention_invariant

        return paged_attention_invariant(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
                                         kv_scales, sinks)
    if use_triton(q):
        from dsinfer.ops.triton.attention import paged_attention_triton

        return paged_attention_triton(
            q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
            max_query_len=max_query_len, max_seq_len=max_seq_len, kv_scales=kv_scales, plan=plan, sinks=sinks,
        )
    if (plan is not None and plan.native_decode and sinks is None and q.dtype == kv_cache.dtype == torch.float32
            and plan.layout.all_decode):
        return decode_attention_cpu(q, kv_cache, plan.layout.decode_slots, seq_lens, scale, sliding_window)
    return paged_attention_ref(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
                               kv_scales=kv_scales, plan=plan, sinks=sinks)


def decode_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """One query row per sequence by the C++ kernel (``csrc/cpu_attention.cpp``; built with the quantized
    linears: call only where ``cpu_quant.native_available()``). q [B, Hq, D] float32, a float32 cache;
    ``slots`` [B, L]: the cache slot of each context position (the plan's ``decode_slots``)."""
    return torch.ops.dsinfer_cpu.decode_attention(q.contiguous(), kv_cache, slots, seq_lens, scale,
                                                  sliding_window or 0)
