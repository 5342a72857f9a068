"""Activations in expert order for the fused MoE's ``sorted`` tiles: one copy of each (token, expert) pair's row
at its place in ``moe_align``'s padded order, quantized to e4m3 on the way for FP8 experts.

With the rows already in expert order, a grouped GEMM tile reads ``BLOCK_M`` consecutive rows (a TMA tile)
instead of gathering ``pair // top_k`` rows one by one, and its per-row FP8 scales are consecutive too: the
scales are stored transposed ([groups, rows] memory, returned as a [rows, groups] view), so one K step's
``BLOCK_M`` scales are one contiguous load. Padding rows are zeros (scale 0), so their products are zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops.triton.fp8 import groups_per_program, quantize_groups
from dsinfer.ops.triton.pdl import MOE, enter, launch_args


@triton.jit
def _permute_kernel(x_ptr, ids_ptr, num_padded_ptr, q_ptr, s_ptr, K, num_groups, num_pairs, stride_xm, stride_qm,
                    stride_sg, A_DIV: tl.constexpr, GATHER: tl.constexpr, QUANT: tl.constexpr,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                    EXACT_CAST: tl.constexpr, PDL: tl.constexpr = False):
    """Row ``r`` of the output (r < num_padded): x[ids[r] // A_DIV] (GATHER; zeros for a padding id), else x[r];
    QUANT: e4m3 with a float32 scale per group of GROUP columns, at s_ptr + group * stride_sg + r."""
    enter(PDL)
    row = tl.program_id(0)
    if row >= tl.load(num_padded_ptr):
        return
    if GATHER:
        pair = tl.load(ids_ptr + row)
        src = tl.where(pair < num_pairs, pair // A_DIV, 0).to(tl.int64)
        width = tl.where(pair < num_pairs, K, 0)  # a padding row reads nothing: zeros
    else:
        src = row.to(tl.int64)
        width = K
    offs_g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    offs_c = tl.arange(0, GROUP_PAD)
    cols = offs_g[:, None] * GROUP + offs_c[None, :]
    mask = (offs_g[:, None] < num_groups) & (offs_c[None, :] < GROUP) & (cols < K)
    x = tl.load(x_ptr + src * stride_xm + cols, mask=mask & (cols < width), other=0.0)
    out_ptrs = q_ptr + row.to(tl.int64) * stride_qm + cols
    if QUANT:
        q, scale = quantize_groups(x.to(tl.float32), EXACT_CAST)
        tl.store(out_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + offs_g * stride_sg + row, scale, mask=offs_g < num_groups)
    else:
        tl.store(out_ptrs, x, mask=mask)


def permute_rows(
    x: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    a_div: int = 1,
    gather: bool = True,
    group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (rows [capacity, K], scales [capacity, K / group] or None); row r < num_padded filled (no host sync).

    ``align`` = ``moe_align``'s (sorted_ids, expert_ids, num_padded). With ``gather``, row r is
    x[sorted_ids[r] // a_div] (zeros for padding), else x is already in that order and row r is x[r]. With
    ``group``, rows are e4m3 with a float32 scale per (row, group of ``group`` columns), as
    ``fp8.per_token_group_quant``; the scale view has strides (1, capacity)."""
    sorted_ids, _, num_padded = align
    capacity, k = sorted_ids.shape[0], x.shape[1]
    quant = group is not None
    group = group or 128
    num_groups = triton.cdiv(k, group)
    out = torch.empty(capacity, k, dtype=torch.float8_e4m3fn if quant else x.dtype, device=x.device)
    scales = torch.empty(num_groups, capacity, dtype=torch.float32, device=x.device).t() if quant else None
    if capacity == 0:
        return out, scales
    if x.stride(-1) != 1:
        x = x.contiguous()
    gpp = groups_per_program(num_groups, group)
    _permute_kernel[(capacity, triton.cdiv(num_groups, gpp))](
        x, sorted_ids, num_padded, out, scales if quant else out, k, num_groups,
        x.shape[0] * a_div if gather else capacity, x.stride(0), out.stride(0), capacity,
        A_DIV=a_div, GATHER=gather, QUANT=quant, GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        GROUPS_PER_PROG=gpp, EXACT_CAST=not x.is_cuda, num_warps=4, **launch_args(x.device, MOE),
    )
    return out, scales
