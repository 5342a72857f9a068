"""Triton MLA attention over the paged latent cache: absorbed split-KV decode, expanded prefill (the cache
writes are in ``ops.triton.mla_cache``).

Cache rows are ``[c | k_pe]`` (R + P values, shared by every head); see ``ops.mla``.

Decode (absorbed): grid (head tiles, splits, query rows), head tiles fastest so the programs that share one
split of one sequence's latent run side by side (the second head tile of V3's 128 heads reads it from L2).
A program holds ``BLOCK_H`` heads of one query row and walks its split in tiles of ``BLOCK_N`` cache rows:
each tile of the latent is loaded once and serves as the key (``q_absorbed . c + q_pe . k_pe``) and as the
value (``p @ c``) for all heads of the tile. With one split the program writes the output; with several it
writes a float32 partial and its log-sum-exp and ``_mla_reduce_kernel`` combines them. A row's sequence is
found by binary search over ``query_start_loc``, so several query rows per sequence (draft verification) work,
each with its causal limit. The split count comes from shapes and the ``max_seq_len`` hint only: no host read
(CUDA-graph safe).

Prefill (expanded): the context latent of each prefill sequence (cached prefix included) is gathered and
expanded through ``kv_b_proj`` by one matmul; a flash-attention kernel then attends with the score split as
``q_nope . k_nope + q_pe . k_pe`` (k_pe read once per token, not per head) and a value width of its own.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsinfer.ops._common import FP8_DTYPES, PackedContexts, cache_rows
from dsinfer.ops.triton import attention as gqa
from dsinfer.ops.triton.attention import find_tile_seq, widen_fp8
from dsinfer.ops.triton.pdl import MLA_COMBINE, enter, launch_args
from dsinfer.ops.triton.utils import has_fp8_convert, num_sms

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs every tile dimension >= 16 on the GPU; smaller head dims are padded and masked
_MIN_SPLIT_KEYS = 64  # fewest cache rows a decode split is worth (small batches: each program walks its split
# serially, a block-table load then the rows it names, so short splits are what keeps batch 1 fast)
_CONFIGS = Path(__file__).parent / "configs" / "mla_decode.json"


@functools.cache
def _decode_configs() -> dict:
    return json.loads(_CONFIGS.read_text()) if _CONFIGS.exists() else {}


def _tile(dim: int) -> int:
    """A feature tile covering ``dim``: a power of two, at least ``_MIN_DOT`` (tiny test models have rope dim 8)."""
    return max(_MIN_DOT, triton.next_power_of_2(dim))


def decode_config(num_heads: int, is_cuda: bool, fp8_cache: bool = False) -> dict:
    """BLOCK_H / BLOCK_N / num_warps / num_stages (and optionally programs_per_sm, the split heuristic's target
    grid fill) for a head count: the tuned table, else a default. An FP8 cache takes its own entry
    (``"<heads>,fp8"``) where the table has one, else the head count's: at 128 heads the bf16 tile's TMA copies
    are twice as slow over FP8 tiles as pointer loads (H200: 2.07 against 1.02 ms, B=128 at 4k)."""
    if not is_cuda:
        return dict(block_h=16, block_n=16, num_warps=4, num_stages=1)
    table = _decode_configs()
    for key in ((f"{num_heads},fp8",) if fp8_cache else ()) + (str(num_heads),):
        if key in table:
            return dict(table[key])
    return dict(block_h=min(64, max(16, triton.next_power_of_2(num_heads))), block_n=32,
                num_warps=4 if num_heads <= 16 else 8, num_stages=2)


# ---- decode ----

@triton.jit
def _find_row_seq(query_start_loc_ptr, num_seqs, row):
    """Largest b with query_start_loc[b] <= row: the sequence that owns query row ``row``."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= row:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _row_split(query_start_loc_ptr, seq_lens_ptr, num_seqs, row, split, num_splits, BLOCK_N: tl.constexpr):
    """(sequence of query row ``row``, first and end cache row of its split ``split``): the context is cut in
    ``num_splits`` runs of whole key tiles, up to the row's own position (causal, for draft rows)."""
    seq = _find_row_seq(query_start_loc_ptr, num_seqs, row)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    ctx_len = tl.load(seq_lens_ptr + seq) - (q_end - 1 - row)  # causal: keys up to this row's position
    split_len = tl.cdiv(tl.cdiv(ctx_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    return seq, start, tl.minimum(start + split_len, ctx_len)


@triton.jit
def _softmax_step(s, n_valid, scale_log2, m_i, l_i):
    """One key tile of the online softmax (log2 domain): (p [H, N], alpha [H] that rescales what was summed so
    far, the new running max, the new running sum); keys outside ``n_valid`` get weight 0."""
    s = tl.where(n_valid[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _softmax_totals(m_i, l_i):
    """(divisor, log2-sum-exp) per head after the last tile; a head that saw no key (a split past its context):
    divisor 1 (its output stays 0) and log-sum-exp -inf (the reduce gives it no weight)."""
    empty = l_i == 0.0
    denom = tl.where(empty, 1.0, l_i)
    return denom, tl.where(empty, float("-inf"), m_i + tl.log2(denom))


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """tl.dot; UPCAST (the CPU interpreter, whose dot mishandles bf16) multiplies in float32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        if a.dtype == tl.float32:  # float32 models stay exact (no TF32) so they match the CPU path
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)


@triton.jit
def _mla_decode_kernel(
    qn_ptr, qp_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    num_seqs, num_heads, scale_log2, num_splits,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    stride_c_blk, stride_c_off, stride_bt, block_size, stride_ot, stride_oh,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, RELOAD_Q: tl.constexpr,
    UPCAST: tl.constexpr, FP8: tl.constexpr, F16: tl.constexpr, FP8_CVT: tl.constexpr, PDL: tl.constexpr = False,
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

    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    h_valid = offs_h < num_heads
    r_valid = offs_r < RANK
    p_valid = offs_p < ROPE
    row64 = row.to(tl.int64)
    qn_ptrs = qn_ptr + row64 * stride_qn_t + offs_h[:, None] * stride_qn_h + offs_r[None, :]
    qp_ptrs = qp_ptr + row64 * stride_qp_t + offs_h[:, None] * stride_qp_h + offs_p[None, :]
    # products in the cache's dtype; an FP8 cache's tiles go to the query's dtype instead, or to fp16 (F16)
    qn = tl.load(qn_ptrs, mask=h_valid[:, None] & r_valid[None, :], other=0.0)
    qp = tl.load(qp_ptrs, mask=h_valid[:, None] & p_valid[None, :], other=0.0)
    if not FP8:
        qn, qp = qn.to(cache_ptr.dtype.element_ty), qp.to(cache_ptr.dtype.element_ty)
    elif F16:
        qn, qp = qn.to(tl.float16), qp.to(tl.float16)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    block_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        block = tl.load(block_row_ptr + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
        base = cache_ptr + block * stride_c_blk + (offs_n % block_size) * stride_c_off
        k_pe = widen_fp8(tl.load(base[:, None] + RANK + offs_p[None, :], mask=n_valid[:, None] & p_valid[None, :],
                                 other=0.0), qn.dtype, FP8_CVT)
        c = widen_fp8(tl.load(base[:, None] + offs_r[None, :], mask=n_valid[:, None] & r_valid[None, :], other=0.0),
                      qn.dtype, FP8_CVT)
        if RELOAD_Q:  # the query re-read (from L1) each step: not held in registers across the loop
            qn = tl.load(qn_ptrs, mask=h_valid[:, None] & r_valid[None, :], other=0.0).to(c.dtype)
            qp = tl.load(qp_ptrs, mask=h_valid[:, None] & p_valid[None, :], other=0.0).to(c.dtype)
        s = _dot(qn, tl.trans(c), UPCAST) + _dot(qp, tl.trans(k_pe), UPCAST)  # [BLOCK_H, BLOCK_N]
        p, alpha, m_i, l_i = _softmax_step(s, n_valid, scale_log2, m_i, l_i)
        acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, UPCAST)
    denom, lse = _softmax_totals(m_i, l_i)
    out = acc / denom[:, None]
    io_mask = h_valid[:, None] & r_valid[None, :]
    if SINGLE:
        tl.store(out_ptr + row64 * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (row64 * num_heads + offs_h) * num_splits + split  # part_* [T, H, S(, R)]
        tl.store(part_out_ptr + part[:, None] * RANK + offs_r[None, :], out, mask=io_mask)
        tl.store(part_lse_ptr + part, lse, mask=h_valid)


@triton.jit
def _mla_reduce_kernel(
    part_out_ptr, part_lse_ptr, query_start_loc_ptr, out_ptr, num_seqs, num_heads, num_splits,
    stride_ot, stride_oh,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    if row >= tl.load(query_start_loc_ptr + num_seqs):
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    part = (row.to(tl.int64) * num_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=offs_s < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    mask = (offs_s[:, None] < num_splits) & (offs_r[None, :] < RANK)
    parts = tl.load(part_out_ptr + part[:, None] * RANK + offs_r[None, :], mask=mask, other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + offs_r,
             out.to(out_ptr.dtype.element_ty), mask=offs_r < RANK)


def decode_num_splits(num_rows: int, head_tiles: int, max_seq_len: int, device: torch.device,
                      programs_per_sm: float = 4) -> int:
    """Splits so that the grid has ~programs_per_sm programs per multiprocessor, each split >= _MIN_SPLIT_KEYS
    rows."""
    want = max(1, int(programs_per_sm * num_sms(device)) // max(num_rows * head_tiles, 1))
    return max(1, min(want, triton.cdiv(max_seq_len, _MIN_SPLIT_KEYS), 64))


def _launch_decode(grid, q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, out, part_out,
                   part_lse, scale: float, num_splits: int, block_h: int, cfg: dict, fp8: dict) -> None:
    """The pointer-load decode kernel (any shape; ``ops.triton.mla_tma`` serves the shapes TMA can)."""
    num_heads, rank, rope = q_nope_absorbed.shape[1], q_nope_absorbed.shape[2], q_pe.shape[-1]
    _mla_decode_kernel[grid](
        q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, out, part_out, part_lse,
        query_start_loc.shape[0] - 1, num_heads, scale * _LOG2E, num_splits,
        q_nope_absorbed.stride(0), q_nope_absorbed.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0), kv_cache.shape[1],
        out.stride(0), out.stride(1),
        RANK=rank, ROPE=rope, BLOCK_R=_tile(rank), BLOCK_P=_tile(rope), BLOCK_H=block_h, BLOCK_N=cfg["block_n"],
        SINGLE=num_splits == 1, RELOAD_Q=cfg.get("reload_q", False), UPCAST=not q_nope_absorbed.is_cuda,
        **fp8, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_args(q_nope_absorbed.device),
    )


def _fp8_flags(q: torch.Tensor, kv_cache: torch.Tensor) -> dict:
    """The decode kernels' FP8-cache switches: FP8 (the cache is), F16 (a bf16 query and the tiles multiply in
    fp16 on the GPU, as the GQA kernel's ``FP8_AS_F16``), FP8_CVT (tiles widened by ``widen_fp8``'s opaque
    conversion)."""
    fp8 = kv_cache.dtype in FP8_DTYPES
    return dict(FP8=fp8, F16=bool(fp8 and gqa.FP8_AS_F16 and q.is_cuda and q.dtype == torch.bfloat16),
                FP8_CVT=bool(fp8 and gqa.FP8_V_CVT and has_fp8_convert(q.device)))


def mla_decode_triton(
    q_nope_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """See ``ops.mla.mla_decode_ref``. ``max_seq_len`` (host int) sizes the splits; without it the bound
    comes from block_tables' width. ``num_splits`` / ``config`` override the heuristics (tuning; a config's
    ``reload_q`` re-reads the query every key tile instead of holding it in registers; ``tma`` fetches whole key
    tiles with TMA copies where the shapes allow, ``ops.triton.mla_tma``)."""
    split = decode_splits(q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                          max_seq_len=max_seq_len, num_splits=num_splits, config=config)
    return split.out if split.part_out is None else combine_splits(split, query_start_loc)


class DecodeSplits(NamedTuple):
    """What the decode kernel wrote: ``out`` [T, H, R] (written when ``num_splits`` is 1), else each split's
    float32 partial ``part_out`` [T, H, S, R] and its base-2 log-sum-exp ``part_lse`` [T, H, S]."""

    out: torch.Tensor
    part_out: torch.Tensor | None
    part_lse: torch.Tensor | None
    num_splits: int


def combine_splits(split: DecodeSplits, query_start_loc: torch.Tensor) -> torch.Tensor:
    """The latent [T, H, R] from a decode's split partials (into ``split.out``)."""
    num_rows, num_heads, rank = split.out.shape
    _mla_reduce_kernel[(num_rows, num_heads)](
        split.part_out, split.part_lse, query_start_loc, split.out, query_start_loc.shape[0] - 1, num_heads,
        split.num_splits, split.out.stride(0), split.out.stride(1),
        RANK=rank, BLOCK_R=triton.next_power_of_2(rank), BLOCK_S=max(triton.next_power_of_2(split.num_splits), 2),
        num_warps=4, **launch_args(split.part_out.device, MLA_COMBINE),
    )
    return split.out


def decode_splits(
    q_nope_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
) -> DecodeSplits:
    """The split-KV decode kernel alone (arguments as ``mla_decode_triton``); the caller combines the splits."""
    num_rows, num_heads, rank = q_nope_absorbed.shape
    rope = q_pe.shape[-1]
    if kv_cache.shape[-1] != rank + rope:
        raise ValueError(f"cache rows hold {kv_cache.shape[-1]} values, expected R + P = {rank} + {rope}")
    out = q_nope_absorbed.new_empty(num_rows, num_heads, rank)
    if num_rows == 0:
        return DecodeSplits(out, None, None, 1)
    cfg = config or decode_config(num_heads, q_nope_absorbed.is_cuda, kv_cache.dtype in FP8_DTYPES)
    # a tile wider than the heads is allowed (a tuned config may pad 16 heads to 64 rows: tl.dot then runs as
    # Hopper wgmma, whose tiles start at 64 rows, instead of mma.sync); padding rows load zeros, store nothing
    block_h = max(_MIN_DOT, cfg["block_h"])
    head_tiles = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * kv_cache.shape[1]
        num_splits = decode_num_splits(num_rows, head_tiles, bound, q_nope_absorbed.device,
                                       cfg.get("programs_per_sm", 4))
    part_out = part_lse = out
    if num_splits > 1:
        part_out = torch.empty(num_rows, num_heads, num_splits, rank, dtype=torch.float32, device=out.device)
        part_lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=out.device)
    grid = (head_tiles, num_splits, num_rows)
    fp8 = _fp8_flags(q_nope_absorbed, kv_cache)
    chunks = None
    if cfg.get("tma"):
        from dsinfer.ops.triton.mla_tma import launch_tma_decode, tma_chunks

        chunks = tma_chunks(rank, _tile(rope), kv_cache, cfg["block_n"])
    if chunks:
        launch_tma_decode(grid, q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, out,
                          part_out, part_lse, scale * _LOG2E, num_splits, chunks, _tile(rope), block_h, cfg, fp8)
    else:
        _launch_decode(grid, q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, out,
                       part_out, part_lse, scale, num_splits, block_h, cfg, fp8)
    if num_splits == 1:
        return DecodeSplits(out, None, None, 1)
    return DecodeSplits(out, part_out, part_lse, num_splits)


# ---- prefill ----

@triton.jit
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, kv_ptr, ctx_ptr, cu_ctx_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    num_seqs, scale_log2,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_kv_t, stride_kv_h, stride_ctx_t,
    stride_ot, stride_oh,
    NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, RANK: tl.constexpr,
    BLOCK_NOPE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last, causal) tiles first
    head = tl.program_id(1)
    seq = find_tile_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_M + seq)
    if q_tile * BLOCK_M >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)
    ctx0 = tl.load(cu_ctx_ptr + seq).to(tl.int64)
    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = offs_m < q_len
    q_pos = ctx_len - q_len + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    offs_dn = tl.arange(0, BLOCK_NOPE)
    offs_dp = tl.arange(0, BLOCK_P)
    offs_dv = tl.arange(0, BLOCK_V)
    qn = tl.load(qn_ptr + rows[:, None] * stride_qn_t + head * stride_qn_h + offs_dn[None, :],
                 mask=m_valid[:, None] & (offs_dn[None, :] < NOPE), other=0.0)
    qp = tl.load(qp_ptr + rows[:, None] * stride_qp_t + head * stride_qp_h + offs_dp[None, :],
                 mask=m_valid[:, None] & (offs_dp[None, :] < ROPE), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
    hi = tl.minimum(ctx_len - q_len + tl.minimum(q_tile * BLOCK_M + BLOCK_M, q_len), ctx_len)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        tok = ctx0 + offs_n
        kv_row = kv_ptr + tok[:, None] * stride_kv_t + head * stride_kv_h
        k_nope = tl.load(kv_row + offs_dn[None, :], mask=n_valid[:, None] & (offs_dn[None, :] < NOPE), other=0.0)
        k_pe = tl.load(ctx_ptr + tok[:, None] * stride_ctx_t + RANK + offs_dp[None, :],
                       mask=n_valid[:, None] & (offs_dp[None, :] < ROPE), other=0.0)
        s = _dot(qn, tl.trans(k_nope), UPCAST) + _dot(qp, tl.trans(k_pe.to(qp.dtype)), UPCAST)
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kv_row + NOPE + offs_dv[None, :], mask=n_valid[:, None] & (offs_dv[None, :] < VDIM),
                    other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & (offs_dv[None, :] < VDIM))


def mla_prefill_triton(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    w_kv_b: torch.Tensor,
    scale: float,
    contexts: PackedContexts | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """See ``ops.mla.mla_prefill_ref``. The contexts are gathered through ``contexts`` (made here when None).
    ``config`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the default tile (tuning)."""
    num_heads, nope_v, rank = w_kv_b.shape
    num_rows, nope, rope = q_nope.shape[0], q_nope.shape[-1], q_pe.shape[-1]
    vdim = nope_v - nope
    out = q_nope.new_empty(num_rows, num_heads, vdim)
    if num_rows == 0:
        return out
    if contexts is None:
        contexts = PackedContexts(block_tables, seq_lens, kv_cache.shape[1])
    elif contexts.block_size != kv_cache.shape[1]:
        raise ValueError(f"contexts were packed for blocks of {contexts.block_size} tokens, the cache has "
                         f"{kv_cache.shape[1]}")
    slots, cu = contexts.slots_and_starts
    ctx = cache_rows(kv_cache, slots)
    ctx = ctx.to(q_nope.dtype)
    kv = torch.nn.functional.linear(ctx[:, :rank], w_kv_b.reshape(-1, rank).to(q_nope.dtype))
    kv = kv.view(-1, num_heads, nope_v)
    num_seqs = query_start_loc.shape[0] - 1
    is_cuda = q_nope.is_cuda
    # CUDA tile: the best of a sweep at V2-Lite shapes (H=16, 4 x 2048; 8 warps over 128 rows, 3 stages)
    block_m, block_n, warps, stages = config or ((128, 64, 8, 3) if is_cuda else (16, 16, 4, 1))
    grid = (num_rows // block_m + num_seqs, num_heads)
    _mla_prefill_kernel[grid](
        q_nope, q_pe, kv, ctx, cu, query_start_loc, seq_lens, out, num_seqs, scale * _LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), kv.stride(1),
        ctx.stride(0), out.stride(0), out.stride(1),
        NOPE=nope, ROPE=rope, VDIM=vdim, RANK=rank,
        BLOCK_NOPE=_tile(nope), BLOCK_P=_tile(rope), BLOCK_V=_tile(vdim), BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=not is_cuda,
        num_warps=warps, num_stages=stages, **launch_args(q_nope.device),
    )
    return out
