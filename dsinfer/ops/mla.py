"""Multi-head latent attention (MLA) over a paged latent cache.

Cache layout (``MLASpec``): ``[num_blocks, block_size, R + P]``; a token's row is its normalized KV latent
``c`` (R = kv_lora_rank) followed by its roped key ``k_pe`` (P = qk_rope_head_dim), shared by all heads.
Expanded per-head keys/values are never stored.

An FP8 cache (``kv_cache_dtype="fp8"`` / ``"fp8_e5m2"``) holds the rows as they are, saturated at the format's
largest finite value (scale 1.0, vLLM's default for MLA; DeepSeek checkpoints carry no KV scales); readers
convert them to the query's dtype.

Two ways to attend, both exact:
- ``mla_decode`` (absorbed): the caller folds W_UK into the query
  (``q_nope_absorbed[h] = q_nope[h] @ W_UK[h]``, [T, H, R]); scores are
  ``(q_nope_absorbed . c + q_pe . k_pe) * scale``, so the cache rows serve as keys as they are, and the
  output is the attention-weighted latent [T, H, R] (the caller applies W_UV). Reads only R + P values per
  context token. Used for decode rows.
- ``mla_prefill`` (expanded): for rows of sequences with several new tokens, the context latent (cached prefix
  and this step's tokens alike) is gathered and expanded through ``kv_b_proj`` into per-head K/V; cheaper in
  FLOPs when many queries share the context.

Batch conventions as in ``ops.attention``: sequence b owns rows ``query_start_loc[b]:query_start_loc[b+1]``,
its context has ``seq_lens[b]`` tokens (this step's already stored), queries are the last ones, causal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops._common import FP8_DTYPES, PackedContexts, cache_rows, copy_rows, latent_values, quantize
from dsinfer.ops.dispatch import use_triton
from dsinfer.ops.norm import rms_norm
from dsinfer.ops.rotary import RotaryAngles, apply_rotary


def store_mla_kv(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_c [T, R], k_pe [T, P] -> cache rows ``slot_mapping`` (negative slots are padding, skipped)."""
    if use_triton(kv_c):
        from dsinfer.ops.triton.mla_cache import store_mla_kv_triton

        return store_mla_kv_triton(kv_c, k_pe, kv_cache, slot_mapping)
    store_mla_kv_ref(kv_c, k_pe, kv_cache, slot_mapping)


def store_mla_kv_ref(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch path of ``store_mla_kv``."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    rows = quantize(torch.cat((kv_c, k_pe), dim=-1), 1.0, kv_cache.dtype)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        rows, slot_mapping = rows[keep], slot_mapping[keep]
    copy_rows(flat, slot_mapping, rows)


def rope_norm_store_mla(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    absorb: tuple[torch.Tensor, torch.Tensor] | None = None,
    angles: RotaryAngles | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """An MLA layer's per-token preamble, fused: rope on q_pe [T, H, P] (returned, new) and on the shared key
    k_pe [T, P], RMSNorm of the latent kv_c [T, R] (``norm_weight``, ``eps``), both stored to the cache rows
    ``slot_mapping`` (negative: padding, not stored). Equals ``apply_rotary`` + ``rms_norm`` + ``store_mla_kv``
    (the rope covers the whole P: ``cos_sin_cache`` is [positions, P]).

    ``absorb`` = (q_nope [T, H, N], W_UK [H, N, R]): also the absorbed query ``absorb_query(q_nope, W_UK)``
    [T, H, R], returned first (``(q_absorbed, q_pe)``); on the Triton path in the same launch. ``angles``: the
    step's ``RotaryAngles``, for the unfused path (as ``apply_rotary`` takes them)."""
    fusable = (cos_sin_cache.shape[-1] == q_pe.shape[-1] == k_pe.shape[-1]
               and torch.promote_types(norm_weight.dtype, kv_c.dtype) == kv_c.dtype)
    if use_triton(q_pe) and fusable:
        from dsinfer.ops.triton.mla_cache import rope_norm_store_mla_triton

        return rope_norm_store_mla_triton(positions, q_pe, k_pe, kv_c, norm_weight, eps, cos_sin_cache, is_neox,
                                          kv_cache, slot_mapping, absorb=absorb, angles=angles)
    q_pe, k_pe = apply_rotary(positions, q_pe, k_pe.unsqueeze(1), cos_sin_cache, is_neox, angles)
    store_mla_kv(rms_norm(kv_c, norm_weight, eps), k_pe.squeeze(1), kv_cache, slot_mapping)
    return q_pe if absorb is None else (absorb_query(*absorb), q_pe)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, N] -> [T, H, R]: per head [H, T, N] @ W_UK [H, N, R] (one batched GEMM), read as [T, H, R]
    through strides (no copy)."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def gather_mla_context(kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Cache rows of positions [0, length) of every sequence in block_tables: [B, length, R + P]."""
    block_size = kv_cache.shape[1]
    pos = torch.arange(length, device=block_tables.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size
    return cache_rows(kv_cache, slots)


def _causal_mask(q_pos: torch.Tensor, length: int) -> torch.Tensor:
    """[B, Q] query positions -> [B, 1, Q, length] bool (key visible)."""
    return (torch.arange(length, device=q_pos.device) <= q_pos.unsqueeze(-1)).unsqueeze(1)


def _sequences(query_start_loc: torch.Tensor, seq_lens: torch.Tensor):
    """(b, first row, q_len, seq_len) per sequence (host lists)."""
    starts = query_start_loc.tolist()
    return [(b, starts[b], starts[b + 1] - starts[b], n) for b, n in enumerate(seq_lens.tolist())]


def mla_decode_ref(
    q_nope_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA: q_nope_absorbed [T, H, R], q_pe [T, H, P] -> attention-weighted latent [T, H, R].

    Rows of one-token sequences run as one padded batch; sequences with several rows (draft verification)
    one by one.
    """
    rank = q_nope_absorbed.shape[-1]
    # the cache's dtype (a test's float64 reference), except an FP8 cache, read in the query's
    dtype = q_nope_absorbed.dtype if kv_cache.dtype in FP8_DTYPES else kv_cache.dtype
    q = torch.cat((q_nope_absorbed, q_pe), dim=-1).to(dtype)
    out = q_nope_absorbed.new_empty(q_nope_absorbed.shape)
    seqs = _sequences(query_start_loc, seq_lens)
    single = [s for s in seqs if s[2] == 1]
    if single:
        idx = torch.tensor([s[0] for s in single], device=q.device)
        rows = query_start_loc[idx].long()
        length = max(s[3] for s in single)
        ctx = gather_mla_context(kv_cache, block_tables[idx], length).to(dtype).unsqueeze(1)  # [B, 1, L, R + P]
        mask = _causal_mask((seq_lens[idx] - 1).unsqueeze(1), length)
        att = F.scaled_dot_product_attention(
            q[rows].unsqueeze(2), ctx, ctx[..., :rank], attn_mask=mask, scale=scale, enable_gqa=True
        )  # [B, H, 1, R]
        out[rows] = att.squeeze(2).to(out.dtype)
    for b, first, n, length in (s for s in seqs if s[2] > 1):
        ctx = gather_mla_context(kv_cache, block_tables[b : b + 1], length).to(dtype).unsqueeze(1)
        q_pos = torch.arange(length - n, length, device=q.device).unsqueeze(0)
        att = F.scaled_dot_product_attention(
            q[first : first + n].transpose(0, 1).unsqueeze(0),
            ctx,
            ctx[..., :rank],
            attn_mask=_causal_mask(q_pos, length),
            scale=scale,
            enable_gqa=True,
        )  # [1, H, n, R]
        out[first : first + n] = att[0].transpose(0, 1).to(out.dtype)
    return out


def mla_prefill_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    w_kv_b: torch.Tensor,
    scale: float,
    contexts: PackedContexts | None = None,
) -> torch.Tensor:
    """Expanded MLA: q_nope [T, H, N], q_pe [T, H, P], w_kv_b [H, N + V, R] (kv_b_proj's weight, per head)
    -> [T, H, V]. Each sequence's whole context (cached prefix included) is expanded from the latent cache.
    ``contexts``: the step's ``PackedContexts`` of (block_tables, seq_lens), which the Triton path gathers
    through (None: made per call); this path walks the sequences one by one and does not read it."""
    num_heads, nope_v, rank = w_kv_b.shape
    nope = q_nope.shape[-1]
    out = q_nope.new_empty(q_nope.shape[0], num_heads, nope_v - nope)
    q = torch.cat((q_nope, q_pe), dim=-1)
    for b, first, n, length in _sequences(query_start_loc, seq_lens):
        ctx = gather_mla_context(kv_cache, block_tables[b : b + 1], length)[0].to(q.dtype)  # [L, R + P]
        kv = F.linear(ctx[:, :rank], w_kv_b.reshape(-1, rank)).view(length, num_heads, nope_v)
        k_pe = ctx[:, rank:].unsqueeze(1).expand(length, num_heads, ctx.shape[1] - rank)
        k = torch.cat((kv[..., :nope], k_pe), dim=-1)
        q_pos = torch.arange(length - n, length, device=q.device).unsqueeze(0)
        att = F.scaled_dot_product_attention(
            q[first : first + n].transpose(0, 1),
            k.transpose(0, 1),
            kv[..., nope:].transpose(0, 1),
            attn_mask=_causal_mask(q_pos, length)[0],
            scale=scale,
        )
        out[first : first + n] = att.transpose(0, 1)
    return out


def mla_decode(
    q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, scale, *, max_seq_len=None
) -> torch.Tensor:
    """See ``mla_decode_ref``. On the Triton path no tensor is read on the host (CUDA-graph safe);
    ``max_seq_len`` (host int, optional) only sizes the split-KV grid."""
    if use_triton(q_nope_absorbed):
        from dsinfer.ops.triton.mla import mla_decode_triton

        return mla_decode_triton(q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens,
                                 scale, max_seq_len=max_seq_len)
    return mla_decode_ref(q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, scale)


def mla_decode_uv_ref(
    q_nope_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    w_uv: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mla_decode_ref`` then W_UV: w_uv [H, V, R] (kv_b_proj's value rows, per head) -> [T, H, V], into
    ``out`` when given."""
    latent = mla_decode_ref(q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, scale)
    if out is None:
        out = latent.new_empty(latent.shape[0], w_uv.shape[0], w_uv.shape[1])
    return latent_values(latent, w_uv, out)


def mla_decode_uv(
    q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, scale, w_uv, *, out=None,
    max_seq_len=None,
) -> torch.Tensor:
    """See ``mla_decode_uv_ref``; on the Triton path the split combine and W_UV run as one kernel at few rows
    (``ops.triton.mla_uv``)."""
    if use_triton(q_nope_absorbed):
        from dsinfer.ops.triton.mla_uv import mla_decode_uv_triton

        return mla_decode_uv_triton(q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens,
                                    scale, w_uv, out=out, max_seq_len=max_seq_len)
    return mla_decode_uv_ref(q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                             w_uv, out=out)


def mla_prefill(
    q_nope, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, w_kv_b, scale, contexts=None
) -> torch.Tensor:
    """See ``mla_prefill_ref``."""
    if use_triton(q_nope):
        from dsinfer.ops.triton.mla import mla_prefill_triton

        return mla_prefill_triton(q_nope, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, w_kv_b,
                                  scale, contexts)
    return mla_prefill_ref(q_nope, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, w_kv_b, scale,
                           contexts)
