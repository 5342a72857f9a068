"""The grouped GEMM kernel of the fused MoE (``moe_fused``) and of the dense FP8 / few-row linears, and its tile
configs. The fused MoE: the (token, expert) pairs aligned by expert, then this kernel used twice.

1. ``moe_align`` (``ops.triton.moe_align``): the pairs sorted by expert, each expert's run padded to a
   multiple of ``BLOCK_M``, with the expert of every block of rows.
2. Gate/up: ``_gemm_kernel`` with ``GATED``: each program multiplies a block of sorted pairs (rows gathered
   from ``hidden`` by ``pair // top_k``) by the gate and the up rows of its expert's ``w13`` (``fuse_gu``: one
   dot over the two interleaved, else two dots) and stores ``silu(gate) * up`` per pair ([pairs, I]).
3. Down: the same kernel over the pair rows of the intermediate with ``w2``, scaled by each pair's top-k
   weight; ``topk_sum`` then adds up each token's top_k rows (float32, in slot order).
4. With ``sorted`` tiles (prefill sizes) the hidden rows are first copied per pair into the aligned order
   (``ops.triton.moe_permute``, quantized on the way for FP8), and the intermediate stays in that order, so both
   GEMMs read consecutive A rows (TMA tiles) instead of gathering them.

FP8 (w8a8, block-scaled): weights e4m3 with a float32 scale per [GROUP_N, GROUP_K] block (128 x 128), the
activations quantized per token and group of GROUP_K (``ops.triton.fp8.per_token_group_quant``). The kernel
multiplies e4m3 tiles (BLOCK_K divides GROUP_K) and applies ``a_scale[m] * b_scale[n]`` per K step.
The same kernel without the gather is the dense block-scaled GEMM (``ops.triton.fp8``).

Tile configs: ``configs/moe.json`` maps "E,N,K,dtype" to configs per average pairs-per-expert bucket.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch
import triton
import triton.language as tl

from dsinfer.ops.triton.pdl import MOE, OTHER, enter, launch_args
from dsinfer.ops.triton.split_k import split_sizes, sum_partials

_CONFIGS = Path(__file__).parent / "configs" / "moe.json"


@functools.cache
def _config_table() -> dict:
    return json.loads(_CONFIGS.read_text()) if _CONFIGS.exists() else {}


def default_config(rows_per_expert: float, fp8: bool, is_cuda: bool) -> dict:
    """The config when the table has none: gate/up keys, plus ``down`` (overrides for the down GEMM)."""
    if not is_cuda:
        return dict(block_m=16, block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=1, fuse_gu=True)
    if rows_per_expert <= 16:
        return dict(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return dict(block_m=32, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
    if fp8:
        return dict(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4,
                    down=dict(block_n=128, num_stages=3))
    return dict(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=3)


def down_config(cfg: dict) -> dict:
    """The down GEMM's config: ``cfg`` with its ``down`` overrides (its own block_m means its own alignment,
    except with ``sorted``: the intermediate is in the gate/up's sorted order, so the down GEMM keeps its rows)."""
    down = {**{k: v for k, v in cfg.items() if k != "down"}, **cfg.get("down", {})}
    if cfg.get("sorted"):
        down["block_m"] = cfg["block_m"]
    return down


def moe_config(key: str, rows_per_expert: float, fp8: bool, is_cuda: bool) -> dict:
    """The tuned config of the nearest bucket (``key`` = "E,N,K,dtype", buckets = average pairs per expert)
    within a factor of 4, else ``default_config``. Keys of a config: block_m, block_n (output columns; the
    gated GEMM's dot is twice as wide), block_k, group_m (programs sharing a B tile, L2 swizzle), num_warps,
    num_stages, fuse_gu (gate and up in one dot; default off on CUDA), tma (weights, and the activations of a
    dense or sorted GEMM, through TMA descriptors; default off; excludes fuse_gu), sorted (the activations
    copied into expert order first, ``ops.triton.moe_permute``, and the intermediate kept in it: consecutive A
    rows instead of a gather; default off) and ``down`` (see ``down_config``)."""
    return nearest_config(key, rows_per_expert, is_cuda) or default_config(rows_per_expert, fp8, is_cuda)


def nearest_config(key: str, rows: float, is_cuda: bool) -> dict | None:
    """``configs/moe.json``'s config under ``key`` of the bucket nearest ``rows`` by ratio (within 4x), else
    None."""
    table = _config_table().get(key, {}) if is_cuda else {}
    rows = max(rows, 1e-9)
    near = [b for b in table if 0.25 <= float(b) / rows <= 4]
    if not near:
        return None
    return dict(table[min(near, key=lambda b: abs(math.log(float(b) / rows)))])


@triton.jit
def _mma(a, b, acc):
    """acc + a @ b; float32 operands stay exact (no TF32) so float32 models match the CPU path."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _scale(a_s, b_s, SCALAR_BS: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] dequantization factor of one K step: a row scale times a column (or tile) scale."""
    if SCALAR_BS:
        return (a_s * b_s)[:, None]
    return a_s[:, None] * b_s[None, :]


@triton.jit
def _prefetch_rows(w_ptr, rows, N, k_lo, K, stride_n, PREFETCH_K: tl.constexpr):
    """Ask L2 for elements [k_lo, k_lo + PREFETCH_K) of weight rows ``rows`` (< N), one request per 128-byte
    line (``prefetch.global.L2``: no registers written, nothing waited for)."""
    LINE: tl.constexpr = 128 // w_ptr.dtype.element_ty.primitive_bitwidth * 8
    lines = tl.arange(0, PREFETCH_K // LINE) * LINE
    rows = tl.where(rows < N, rows, 0).to(tl.int64)
    cols = tl.minimum(k_lo + lines, K - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [w_ptr + rows[:, None] * stride_n
                              + cols[None, :]], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, bias_ptr, weight_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, b_raw_ptr,
    M, N, K, num_pairs, up_offset, k_split, swiglu_limit,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_cs,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    A_DIV: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr, FUSE_GU: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr, GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, SCALAR_BS: tl.constexpr, A_DESC: tl.constexpr,
    B_DESC: tl.constexpr, UPCAST: tl.constexpr, A_SORTED: tl.constexpr, C_SORTED: tl.constexpr,
    SPLIT_K: tl.constexpr, PREFETCH_K: tl.constexpr = 0, CLAMP: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """C[rows] = A[rows] @ B[e]^T (rows: pairs sorted by expert when GATHER, else 0..M); see module doc.

    GATED with FUSE_GU: one dot over a B tile of 2 * BLOCK_N columns, gate and up rows interleaved (column
    2j = gate row n_j, 2j + 1 = up row n_j), split in the epilogue; without FUSE_GU: two dots, two accumulators.
    CLAMP (with GATED): DeepSeek-V4's clamped SwiGLU, gate <= swiglu_limit and |up| <= swiglu_limit.
    Rows past the valid ones (padding pairs, the last M / N tile) read row 0 of A / B instead of masking, so
    with EVEN_K (K % BLOCK_K == 0) the K loop has no masks; only the stores are masked. SCALAR_BS: the tile's
    columns lie in one scale block of B (BLOCK_N divides GROUP_N, two dots), so a K step's scale is per row only
    (one multiply-add per accumulator element). A_DESC / B_DESC: ``a_ptr`` / ``b_ptr`` are TMA tensor descriptors
    (A [M, K] without gather, B viewed [E * rows, K]) loading [BLOCK_M | BLOCK_N, BLOCK_K] tiles; the tiles
    past N read the next rows (the next expert's, or zeros past the end), never stored; not with FUSE_GU.
    A_SORTED / C_SORTED (with GATHER): A's / C's rows are already in sorted order (row = position in
    ``sorted_ids``, ``ops.triton.moe_permute``), so a tile's A rows are consecutive (a TMA tile with A_DESC) and
    C is stored at the sorted positions (padding rows included; they are zeros).
    SPLIT_K > 1 (dense: not GATHER, no bias): program_id(1) takes K elements [s * k_split, (s + 1) * k_split)
    (k_split a multiple of BLOCK_K) and stores its float32 partial at C + s * stride_cs; ``split_k.sum_partials``
    adds them after.
    PREFETCH_K > 0 (dense, launched with PDL): before waiting for the previous kernel, the program asks L2 for
    the first PREFETCH_K elements of each of its weight rows (``b_raw_ptr``: the weight's memory), which no
    kernel writes, so the weight stream starts while the previous kernel finishes (``pdl``)."""
    pid = tl.program_id(0)
    if SPLIT_K > 1:
        k_lo = tl.program_id(1) * k_split
        k_hi = tl.minimum(K, k_lo + k_split)
    else:
        k_lo = 0
        k_hi = K
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    if PREFETCH_K > 0:  # dense only: a gathered GEMM's experts come from the kernels this one waits for
        _prefetch_rows(b_raw_ptr, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N, k_lo, K, stride_bn, PREFETCH_K)
        if GATED:  # and the up rows
            _prefetch_rows(b_raw_ptr, up_offset + pid_n * BLOCK_N + tl.arange(0, BLOCK_N), up_offset + N, k_lo,
                           K, stride_bn, PREFETCH_K)
    enter(PDL)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if GATHER:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert32 = tl.load(expert_ids_ptr + pid_m).to(tl.int32)  # int64 from ``moe_align.pair_blocks``
        expert = expert32.to(tl.int64)
        rows = tl.load(sorted_ids_ptr + offs_m)
        m_valid = rows < num_pairs
        if A_SORTED:
            a_rows = offs_m.to(tl.int64)
        else:
            a_rows = tl.where(m_valid, rows // A_DIV, 0).to(tl.int64)
    else:
        expert32 = 0
        expert = 0
        rows = offs_m
        m_valid = offs_m < M
        a_rows = tl.where(m_valid, offs_m, 0).to(tl.int64)
    if GATED and FUSE_GU:
        offs_c = tl.arange(0, 2 * BLOCK_N)
        col_n = pid_n * BLOCK_N + offs_c // 2
        b_rows = tl.where(col_n < N, col_n + (offs_c % 2) * up_offset, 0)
    else:
        col_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        b_rows = tl.where(col_n < N, col_n, 0)
    offs_k = tl.arange(0, BLOCK_K)
    if not A_DESC:
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k_lo + offs_k[None, :]) * stride_ak
    if B_DESC:
        b_row0 = expert32 * (stride_be // stride_bn) + pid_n * BLOCK_N
    else:
        b_ptrs = (b_ptr + expert * stride_be + b_rows[None, :].to(tl.int64) * stride_bn
                  + (k_lo + offs_k[:, None]) * stride_bk)
    as_ptrs = a_scale_ptr + a_rows * stride_asm
    if SCALAR_BS:
        bs_ptrs = b_scale_ptr + expert * stride_bse + (pid_n * BLOCK_N // GROUP_N) * stride_bsn
        bs_up_ptrs = b_scale_ptr + expert * stride_bse + ((pid_n * BLOCK_N + up_offset) // GROUP_N) * stride_bsn
    else:
        bs_ptrs = b_scale_ptr + expert * stride_bse + (b_rows // GROUP_N) * stride_bsn
        bs_up_ptrs = b_scale_ptr + expert * stride_bse + ((b_rows + up_offset) // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N if GATED and FUSE_GU else BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_valid = offs_k < K - k0
        if A_DESC:
            a = a_ptr.load([pid_m * BLOCK_M, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_valid[None, :], other=0.0)
        if B_DESC:
            b = tl.trans(b_ptr.load([b_row0, k0]))
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=k_valid[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP8:
            kg = k0 // GROUP_K
            a_s = tl.load(as_ptrs + kg * stride_ask)
            b_s = tl.load(bs_ptrs + kg * stride_bsk)
            acc += tl.dot(a, b) * _scale(a_s, b_s, SCALAR_BS)
        else:
            acc = _mma(a, b, acc)
        if GATED and not FUSE_GU:
            if B_DESC:
                b_up = tl.trans(b_ptr.load([b_row0 + up_offset, k0]))
            elif EVEN_K:
                b_up = tl.load(b_ptrs + up_offset * stride_bn)
            else:
                b_up = tl.load(b_ptrs + up_offset * stride_bn, mask=k_valid[:, None], other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            if FP8:
                b_up_s = tl.load(bs_up_ptrs + kg * stride_bsk)
                acc_up += tl.dot(a, b_up) * _scale(a_s, b_up_s, SCALAR_BS)
            else:
                acc_up = _mma(a, b_up, acc_up)
        if not A_DESC:
            a_ptrs += BLOCK_K * stride_ak
        if not B_DESC:
            b_ptrs += BLOCK_K * stride_bk
    if GATED:
        if FUSE_GU:
            acc, acc_up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        if CLAMP:
            acc = tl.minimum(acc, swiglu_limit)
            acc_up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + rows, mask=m_valid, other=0.0)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    if SPLIT_K > 1:
        c_ptrs = (c_ptr + tl.program_id(1) * stride_cs + rows[:, None].to(tl.int64) * stride_cm
                  + offs_n[None, :] * stride_cn)
        tl.store(c_ptrs, acc, mask=m_valid[:, None] & n_valid[None, :])
    elif C_SORTED:  # every row of a block below num_padded is a sorted position
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_valid[None, :])
    else:
        c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


PREFETCH_BYTES = 8 << 20  # what a dense GEMM asks L2 for before its wait: ~2 us of the H200's bandwidth


def prefetch_elements(rows: int, k: int, element_size: int) -> int:
    """Elements per weight row (a power of two of 128-byte lines, at most the row's K range) that make about
    PREFETCH_BYTES over ``rows`` rows; 0 (no prefetch) when PREFETCH_BYTES is 0."""
    if PREFETCH_BYTES <= 0:
        return 0
    line = 128 // element_size
    lines = max(1, min(PREFETCH_BYTES // (rows * 128), triton.cdiv(k, line)))
    return line * (1 << (lines.bit_length() - 1))


def _tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor can cover t as [rows, K]: contiguous, 16-byte aligned base and rows."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    cfg: dict,
    *,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    a_div: int = 1,
    gated: bool = False,
    topk_weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    sorted_a: bool = False,
    sorted_out: bool = False,
    num_pairs: int | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """out[rows, :N] = f(a[rows // a_div] @ b[expert]^T); b [E, N(*2 if gated), K] (or [N, K] for dense).

    ``align`` = ``moe_align``'s output (rows are sorted pairs), else dense rows 0..a.shape[0].
    FP8 when ``a_scale`` / ``b_scale`` are given (scales per [block_size] of b, per (row, block_size[1]) of a).
    ``sorted_a`` / ``sorted_out``: a's / out's rows are in sorted order (``moe_permute.permute_rows``), not
    pair (or token) order; ``num_pairs`` (default out's rows) is then needed when ``sorted_out``.
    ``swiglu_limit`` (with ``gated``): the clamped SwiGLU (``ops._common.swiglu``).
    ``cfg["split_k"]`` (dense only) splits K (``split_k``): float32 partials, summed by a second kernel.
    """
    if b.dim() == 2:
        b = b.unsqueeze(0)
        b_scale = b_scale.unsqueeze(0) if b_scale is not None else None
    n_out = out.shape[1]
    k = b.shape[2]
    fp8 = a_scale is not None
    if fp8 and (block_size is None or block_size[1] % cfg["block_k"] and cfg["block_k"] % block_size[1]):
        raise ValueError(f"block_k={cfg['block_k']} must divide the scale block {block_size} along K")
    # An e4m3 dot needs K >= 32 on CUDA: smaller scale blocks (tiny test checkpoints) multiply as float32, exact
    # for e4m3 operands (UPCAST below)
    block_k = min(cfg["block_k"], block_size[1]) if fp8 else cfg["block_k"]
    b_desc = cfg.get("tma", False) and _tma_ok(b)
    a_desc = b_desc and (align is None or sorted_a) and _tma_ok(a)
    fuse_gu = gated and cfg.get("fuse_gu", not a.is_cuda) and not b_desc
    if align is not None:
        sorted_ids, expert_ids, num_padded = align
        rows, num_pairs = sorted_ids.shape[0], out.shape[0] if num_pairs is None else num_pairs
    else:
        sorted_ids = expert_ids = num_padded = out  # unused
        rows = num_pairs = a.shape[0]
    dummy = out
    a_s = a_scale if fp8 else dummy
    b_s = b_scale if fp8 else dummy
    k_split, split = split_sizes(k, block_k, cfg.get("split_k", 1))
    target = out
    if split > 1:
        if align is not None or gated or topk_weights is not None:
            raise ValueError("split_k splits dense GEMMs only (expert rows and SiLU(gate) * up need whole sums)")
        target = torch.empty(split, out.shape[0], n_out, dtype=torch.float32, device=out.device)
    grid = (triton.cdiv(rows, cfg["block_m"]) * triton.cdiv(n_out, cfg["block_n"]), split)
    a_arg, b_arg = a, b
    pdl_args = launch_args(out.device, MOE if align is not None else OTHER)
    if pdl_args and align is None and rows <= cfg["block_m"] and b.stride(2) == 1:  # one row tile: a GEMV
        pdl_args["PREFETCH_K"] = prefetch_elements(n_out * split * (2 if gated else 1), k_split, b.element_size())
    if b_desc:
        from triton.tools.tensor_descriptor import TensorDescriptor

        b_arg = TensorDescriptor.from_tensor(b.view(-1, k), [cfg["block_n"], block_k])
        if a_desc:
            a_arg = TensorDescriptor.from_tensor(a, [cfg["block_m"], block_k])
    _gemm_kernel[grid](
        a_arg, a_s, b_arg, b_s, target, bias if bias is not None else dummy,
        topk_weights if topk_weights is not None else dummy,
        sorted_ids, expert_ids, num_padded, b,
        rows, n_out, k, num_pairs, n_out if gated else 0, k_split,
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), target.stride(-2), target.stride(-1),
        target.stride(0) if split > 1 else 0,
        a_s.stride(0) if fp8 else 0, a_s.stride(1) if fp8 else 0,
        b_s.stride(0) if fp8 else 0, b_s.stride(1) if fp8 else 0, b_s.stride(2) if fp8 else 0,
        A_DIV=a_div, GATHER=align is not None, GATED=gated, FUSE_GU=fuse_gu, MUL_WEIGHT=topk_weights is not None,
        HAS_BIAS=bias is not None and split == 1, FP8=fp8,
        GROUP_N=block_size[0] if fp8 else 1, GROUP_K=block_size[1] if fp8 else 1,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=block_k, GROUP_M=cfg["group_m"],
        EVEN_K=k % block_k == 0, SCALAR_BS=fp8 and not fuse_gu and block_size[0] % cfg["block_n"] == 0,
        A_DESC=a_desc, B_DESC=b_desc,
        UPCAST=not a.is_cuda or (fp8 and block_k < 32),
        A_SORTED=sorted_a and align is not None, C_SORTED=sorted_out and align is not None, SPLIT_K=split,
        CLAMP=gated and swiglu_limit is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_args,
    )
    if split > 1:
        sum_partials(target, out, bias)
    return out

