"""Triton paged attention (GQA, causal, varlen, optional sliding window and attention sinks): prefill and split-KV
decode kernels.

Prefill (any batch with a row of more than one query): flash attention with online softmax. A program owns one
KV head and a tile of ``BLOCK_Q`` query rows of one sequence, packed with the ``GROUP`` query heads that share
the KV head into ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows, so each K/V tile is read once for the whole group.
The grid has ``T // BLOCK_Q + B`` tiles (an upper bound that needs no host sync); each program finds its
sequence by a binary search over ``query_start_loc``. Keys come from the paged cache, so cached prefixes and
earlier chunks are seen. Key tiles that every row sees run without a mask; only the diagonal and the window's
lower edge do.

Decode (every row has at most one query): grid (B, Hkv, splits); each program reads one KV head's keys of one
split of the context for all ``GROUP`` query heads at once (padded to 16 rows for ``tl.dot``) and writes a
partial output and its log-sum-exp; a reduce kernel combines the splits. The split count comes from shapes and
the ``max_seq_len`` hint only, so the decode path reads no tensor contents on the host (CUDA-graph safe) when
``max_query_len`` is given.

Attention sinks (GPT-OSS: one logit per query head added to the softmax's denominator) join at the end: the
prefill kernel folds ``exp(sink)`` into each row's running sum after its last key tile, the decode reduce kernel
into the sum over its splits' weights.

An FP8 cache (``ops.kv_cache``) is read as such and converted in registers; its key scale is folded into the softmax
scale and its value scale into the output. Keys convert inside the dot-operand layout; value tiles convert to fp16
before the product (``widen_fp8``), since values are the transposed operand and FP8 has no transposing
shared-memory load. H200, batch 256 at 4k: 0.68 ms against 1.02 ms over a bf16 cache, 74% of the FP8 bytes' floor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops._common import FP8_DTYPES, read_scales
from dsinfer.ops.triton.pdl import GQA_COMBINE, enter, launch_args
from dsinfer.ops.triton.utils import has_fp8_convert, num_sms

_LOG2E = 1.4426950408889634
# An FP8 cache with a bf16 query: the query goes to fp16 and the keys and values FP8 -> fp16, one conversion
# instruction per pair (FP8 -> bf16 takes several; 1-8% faster on the H200, best tile against best tile). A query
# element past fp16's 65504 would overflow; attention queries stay orders of magnitude below it. A module flag so
# the sweep can compare.
FP8_AS_F16 = True
# An FP8 cache's value tiles go to fp16 in registers before the product (``widen_fp8``). A module flag so the
# sweep can compare.
FP8_V_CVT = True
_CVT_E4M3 = tl.constexpr("cvt.rn.f16x2.e4m3x2 $0, $1;")  # two FP8 values in, two fp16 out
_CVT_E5M2 = tl.constexpr("cvt.rn.f16x2.e5m2x2 $0, $1;")
_MIN_SPLIT_KEYS = 64  # fewest keys a decode split is worth (shorter splits keep batch 1 latency-bound chains short)


@triton.jit
def find_tile_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= tile: the sequence that owns this query tile.

    Shared by the GQA and MLA prefill kernels."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _key_ptrs(cache_ptr, block_row_ptr, offs_n, n_valid, kv_head, block_size,
              stride_c_blk, stride_c_off, stride_c_h):
    """Pointers to the start of keys at positions offs_n in one sequence's paged cache, one KV head."""
    block = tl.load(block_row_ptr + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
    return cache_ptr + block * stride_c_blk + (offs_n % block_size) * stride_c_off + kv_head * stride_c_h


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot; UPCAST (the CPU interpreter, whose dot mishandles bf16) multiplies in float32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def widen_fp8(v, dtype: tl.constexpr, FP8_CVT: tl.constexpr):
    """A value tile in the dot's operand type. An FP8 tile goes to fp16 here, in the loaded layout, through an
    opaque conversion: a plain cast lets Triton move it behind the shared-memory load into the dot-operand layout,
    which for values (keys-major, so transposed for the product) reads single bytes; the fp16 tile instead takes
    the 16-bit transposing path (ldmatrix.trans), as a bf16 cache does. Shared with the MLA decode kernels, whose
    latent tiles are keys and values at once."""
    if FP8_CVT and dtype == tl.float16 and (v.dtype == tl.float8e4nv or v.dtype == tl.float8e5):
        asm: tl.constexpr = _CVT_E4M3 if v.dtype == tl.float8e4nv else _CVT_E5M2
        return tl.inline_asm_elementwise(asm, "=r,h", [v.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                                         is_pure=False, pack=2)
    else:
        return v.to(dtype)


@triton.jit
def _attend_range(
    acc, l_i, m_i, q, q_pos,
    cache_ptr, block_row_ptr, kv_head, block_size, stride_c_kv, stride_c_blk, stride_c_off, stride_c_h,
    start, end, ctx_len, scale_log2, window,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, FP8_CVT: tl.constexpr,
):
    """Online-softmax update over key tiles [start, end); MASKED applies the causal/window/length mask."""
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            n_valid = offs_n < ctx_len
        else:
            n_valid = offs_n >= 0
        base = _key_ptrs(cache_ptr, block_row_ptr, offs_n, n_valid, kv_head, block_size,
                         stride_c_blk, stride_c_off, stride_c_h)
        kv_mask = n_valid[None, :] & d_valid[:, None]
        k = tl.load(base[None, :] + offs_d[:, None], mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_D, BLOCK_N]
        qk = _dot(q, k, PRECISION, UPCAST) * scale_log2
        if MASKED:
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
            if HAS_WINDOW:
                visible &= offs_n[None, :] > q_pos[:, None] - window
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        else:
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_ref = m_new
        p = tl.exp2(qk - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_mask = n_valid[:, None] & d_valid[None, :]
        v = widen_fp8(tl.load(base[:, None] + stride_c_kv + offs_d[None, :], mask=v_mask, other=0.0),
                      q.dtype, FP8_CVT)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr, sinks_ptr,
    num_seqs, scale_log2, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_bt, block_size,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, Q_F16: tl.constexpr, FP8_CVT: tl.constexpr, HAS_SINKS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    enter(PDL)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the last (longest, causal) tiles start first
    kv_head = tl.program_id(1)
    seq = find_tile_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_valid = (q_idx < q_len) & (offs_m % GROUP_PAD < GROUP)
    q_pos = ctx_len - q_len + q_idx
    offs_d = tl.arange(0, BLOCK_D)
    row_off = (q_start + q_idx).to(tl.int64)
    io_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if Q_F16:
        q = q.to(tl.float16)

    # Key ranges: [lo, lo_full) window edge (masked), [lo_full, hi_full) seen by all rows, then the diagonal.
    pos_min = ctx_len - q_len + q_tile * BLOCK_Q
    pos_max = ctx_len - q_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(pos_min - window + 1, 0) // BLOCK_N * BLOCK_N
    hi = pos_max + 1
    hi_tiles = lo + tl.cdiv(hi - lo, BLOCK_N) * BLOCK_N
    lo_full = lo
    if HAS_WINDOW:
        lo_full = lo + tl.cdiv(tl.maximum(pos_max - window + 1 - lo, 0), BLOCK_N) * BLOCK_N
        lo_full = tl.minimum(lo_full, hi_tiles)
    hi_full = tl.maximum(lo_full + tl.maximum(pos_min + 1 - lo_full, 0) // BLOCK_N * BLOCK_N, lo_full)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    block_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, q_pos, cache_ptr, block_row_ptr, kv_head, block_size,
        stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, lo, lo_full, ctx_len, scale_log2, window,
        True, HAS_WINDOW, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, UPCAST, FP8_CVT,
    )
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, q_pos, cache_ptr, block_row_ptr, kv_head, block_size,
        stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, lo_full, hi_full, ctx_len, scale_log2, window,
        False, HAS_WINDOW, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, UPCAST, FP8_CVT,
    )
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, q_pos, cache_ptr, block_row_ptr, kv_head, block_size,
        stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, hi_full, hi_tiles, ctx_len, scale_log2, window,
        True, HAS_WINDOW, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, UPCAST, FP8_CVT,
    )
    if HAS_SINKS:  # one more logit per head in the denominator, attending to nothing
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        rescale = tl.exp2(m_i - m_fin)
        l_i = l_i * rescale + tl.exp2(sink - m_fin)
        acc = acc * rescale[:, None]
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc * (v_scale / l_safe)[:, None]
    tl.store(out_ptr + row_off[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, v_scale, window, num_splits,
    stride_qt, stride_qh,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_bt, block_size,
    stride_pb, stride_ph, stride_ps,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, Q_F16: tl.constexpr, FP8_CVT: tl.constexpr, PDL: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # the step's metadata, read before the wait (``pdl``: no kernel of a forward writes it)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    ctx_len = tl.load(seq_lens_ptr + seq)
    enter(PDL)
    if q_end == q_start:
        return  # no query for this row (padding)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(ctx_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(tl.maximum(ctx_len - first, 0), num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, ctx_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + offs_g
    io_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if Q_F16:
        q = q.to(tl.float16)
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), tl.float32)
    q_pos = tl.full((GROUP_PAD,), 0, tl.int32) + ctx_len - 1
    block_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Every key in [start, end) is visible (causal and window are in the range); MASKED only cuts at `end`.
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, q_pos, cache_ptr, block_row_ptr, kv_head, block_size,
        stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, start, end, end, scale_log2, window,
        True, False, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, UPCAST, FP8_CVT,
    )
    empty = l_i == 0
    out = acc * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    part = seq.to(tl.int64) * stride_pb + head * stride_ph + split * stride_ps
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=io_mask)
    tl.store(part_lse_ptr + part, lse, mask=offs_g < GROUP)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, query_start_loc_ptr, out_ptr, sinks_ptr, num_splits,
    stride_pb, stride_ph, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)  # the step's metadata: before the wait (``pdl``)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    enter(PDL)
    if q_end == q_start:
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    part = seq.to(tl.int64) * stride_pb + head * stride_ph + offs_s
    lse = tl.load(part_lse_ptr + part, mask=offs_s < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    mask = (offs_s[:, None] < num_splits) & (offs_d[None, :] < HEAD_DIM)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    total = tl.sum(weight, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about four times over, but no split shorter than _MIN_SPLIT_KEYS."""
    want = triton.cdiv(4 * num_sms(device), max(num_seqs * num_kv_heads, 1))
    return max(1, min(want, triton.cdiv(max_seq_len, _MIN_SPLIT_KEYS), 256))


def _prefill_config(head_dim: int, group_pad: int, cuda: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel."""
    if not cuda:
        return 32, 16, 4, 1  # the interpreter: small tiles keep the tests quick
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim <= 128:
        return 128, 64, 8, 3
    return 64, 32, 4, 2


def _decode_config(head_dim: int, cuda: bool, fp8: bool = False, seqs_x_heads: int = 0) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the decode kernel. H200 sweeps (``benchmarks/kernels.py --sweep`` and
    ``--sweep-fp8``), head dim 128, 1k-4k context: 32/4/2 best or within 2% at B=1/64/256 for a bf16 cache; for an
    FP8 cache 128/4/3 at B=64 and 256 (5-8% faster than 128/4/2, 22-37% faster than 32/4/2), 32/4/2 at B=1."""
    if not cuda:
        return 16, 4, 1
    return (128, 4, 3) if fp8 and seqs_x_heads >= 64 else (32, 4, 2)


def paged_attention_triton(
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
    plan=None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_attention_ref`` (``plan`` is the torch path's); ``num_splits``, ``block_m``,
    ``block_n`` override tuning."""
    num_seqs = query_start_loc.shape[0] - 1
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs > 0 else 0
    out = torch.empty_like(q)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must have a contiguous head dim, got strides {kv_cache.stride()}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if max_query_len <= 1:
        _decode(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, out,
                max_seq_len, num_splits, block_n, kv_scales, sinks)
    else:
        _prefill(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, out,
                 block_m, block_n, kv_scales, sinks)
    return out


def _common(q: torch.Tensor, kv_cache: torch.Tensor, scale: float, sliding_window: int | None,
            kv_scales: tuple[float, float]) -> dict:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    k_scale, v_scale = read_scales(kv_cache.dtype, kv_scales)
    return dict(
        scale_log2=scale * _LOG2E * k_scale,
        v_scale=v_scale,
        window=sliding_window if sliding_window is not None else 0,
        group=num_heads // num_kv_heads,
        head_dim=head_dim,
        block_d=triton.next_power_of_2(head_dim),
        has_window=sliding_window is not None,
        precision="ieee" if q.dtype == torch.float32 else "tf32",
        upcast=not q.is_cuda,
        q_f16=bool(FP8_AS_F16 and q.is_cuda and kv_cache.dtype in FP8_DTYPES and q.dtype == torch.bfloat16),
        fp8_cvt=bool(FP8_V_CVT and kv_cache.dtype in FP8_DTYPES and has_fp8_convert(q.device)),
    )


def _prefill(
    q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, out, block_m, block_n, kv_scales,
    sinks=None,
):
    c = _common(q, kv_cache, scale, sliding_window, kv_scales)
    num_seqs = query_start_loc.shape[0] - 1
    group_pad = triton.next_power_of_2(c["group"])
    cfg_m, cfg_n, num_warps, num_stages = _prefill_config(c["head_dim"], group_pad, q.is_cuda)
    block_m = max(block_m or cfg_m, group_pad, 16)
    block_q = block_m // group_pad
    grid = (q.shape[0] // block_q + num_seqs, kv_cache.shape[3])
    _prefill_kernel[grid](
        q, kv_cache, block_tables, query_start_loc, seq_lens, out, q if sinks is None else sinks,
        num_seqs, c["scale_log2"], c["v_scale"], c["window"],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), kv_cache.shape[2],
        GROUP=c["group"], GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n or cfg_n,
        HEAD_DIM=c["head_dim"], BLOCK_D=c["block_d"], HAS_WINDOW=c["has_window"],
        PRECISION=c["precision"], UPCAST=c["upcast"], Q_F16=c["q_f16"], FP8_CVT=c["fp8_cvt"],
        HAS_SINKS=sinks is not None, num_warps=num_warps, num_stages=num_stages, **launch_args(q.device),
    )


def _decode(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, out,
            max_seq_len, num_splits, block_n, kv_scales, sinks=None):
    c = _common(q, kv_cache, scale, sliding_window, kv_scales)
    num_seqs, num_heads, num_kv_heads = query_start_loc.shape[0] - 1, q.shape[1], kv_cache.shape[3]
    if num_splits is None:
        if max_seq_len is None:  # a bound from shapes only: no host sync
            max_seq_len = block_tables.shape[1] * kv_cache.shape[2]
        if sliding_window is not None:
            max_seq_len = min(max_seq_len, sliding_window)
        num_splits = _num_splits(num_seqs, num_kv_heads, max_seq_len, q.device)
    cfg_n, num_warps, num_stages = _decode_config(c["head_dim"], q.is_cuda, kv_cache.dtype in FP8_DTYPES,
                                                  num_seqs * num_kv_heads)
    part_out = torch.empty(num_seqs, num_heads, num_splits, c["head_dim"], dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, query_start_loc, seq_lens, part_out, part_lse,
        c["scale_log2"], c["v_scale"], c["window"], num_splits,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), kv_cache.shape[2],
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        GROUP=c["group"], GROUP_PAD=max(triton.next_power_of_2(c["group"]), 16), BLOCK_N=block_n or cfg_n,
        HEAD_DIM=c["head_dim"], BLOCK_D=c["block_d"], HAS_WINDOW=c["has_window"],
        PRECISION=c["precision"], UPCAST=c["upcast"], Q_F16=c["q_f16"], FP8_CVT=c["fp8_cvt"],
        num_warps=num_warps, num_stages=num_stages, **launch_args(q.device),
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, query_start_loc, out, part_lse if sinks is None else sinks, num_splits,
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=c["head_dim"], BLOCK_D=c["block_d"], BLOCK_S=max(triton.next_power_of_2(num_splits), 2),
        HAS_SINKS=sinks is not None, num_warps=4, **launch_args(part_out.device, GQA_COMBINE),
    )

