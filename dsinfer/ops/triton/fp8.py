"""FP8 block-scaled GEMM on Hopper: per-token-group activation quantization and the dense w8a8 linear.

``per_token_group_quant(x, group)``: each row's groups of ``group`` values get one float32 scale
(amax / 448) and are stored as e4m3. ``fp8_block_linear_triton`` quantizes the activations that way (group =
the weight's scale block width) and runs ``ops.triton.moe``'s GEMM kernel without the expert gather: e4m3
tiles on the tensor cores, ``a_scale[m] * w_scale[n // bn, k // bk]`` applied per K step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops.triton.moe import grouped_gemm, nearest_config
from dsinfer.ops.triton.pdl import enter, launch_args
from dsinfer.ops.triton.split_k import SPLIT_MAX_ROWS, default_split

FP8_MAX = 448.0


@triton.jit
def _round_to_e4m3(v):
    """v rounded to the nearest e4m3 value (ties away from zero), still float32. The CPU interpreter's
    float32 -> e4m3 cast loses a rounding carry (126.8 -> 64), so there the cast is given exact values."""
    step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.abs(v) + 1e-30)), -6.0) - 3.0)
    r = tl.floor(tl.abs(v) / step + 0.5) * step
    return tl.where(v < 0, -r, r)


@triton.jit
def quantize_groups(x, EXACT_CAST: tl.constexpr):
    """[G, GROUP] float32 -> (e4m3-valued float32 [G, GROUP], scale [G]): a group's scale is amax / 448, and 0 for
    an all-zero group (its values stay 0). The caller casts to its e4m3 output."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.maximum(amax, 1e-10) / 448.0, 0.0)
    q = tl.clamp(x / tl.where(scale > 0, scale, 1.0)[:, None], -448.0, 448.0)  # 448: the e4m3 maximum
    if EXACT_CAST:
        q = _round_to_e4m3(q)
    return q, scale


def groups_per_program(num_groups: int, group: int) -> int:
    """Groups one quantizing program takes: up to ~2048 values."""
    return min(triton.next_power_of_2(num_groups), max(1, 2048 // triton.next_power_of_2(group)))


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm, stride_sm,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                        EXACT_CAST: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    offs_c = tl.arange(0, GROUP_PAD)
    cols = offs_g[:, None] * GROUP + offs_c[None, :]
    mask = (offs_g[:, None] < num_groups) & (offs_c[None, :] < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, EXACT_CAST)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + offs_g, scale, mask=offs_g < num_groups)


def per_token_group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]): x ~= q * scale per group (scale 0 for an
    all-zero group)."""
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    if x.stride(-1) != 1:
        x = x.contiguous()
    gpp = groups_per_program(num_groups, group)
    _group_quant_kernel[(m, triton.cdiv(num_groups, gpp))](
        x, q, s, k, num_groups, x.stride(0), q.stride(0), s.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), GROUPS_PER_PROG=gpp,
        EXACT_CAST=not x.is_cuda, num_warps=4, **launch_args(x.device),
    )
    return q, s


def dense_config(num_rows: int, device: torch.device, n: int = 0, k: int = 0) -> dict:
    """Tuned ("dense,N,K,fp8" in ``configs/moe.json``, buckets = rows) or default tile config (split K below 65
    rows, ``split_k.default_split``)."""
    is_cuda = device.type == "cuda"
    tuned = nearest_config(f"dense,{n},{k},fp8", num_rows, is_cuda)
    if tuned:
        if num_rows > SPLIT_MAX_ROWS:  # a decode bucket serving more rows: a split nobody timed there
            tuned.pop("split_k", None)
        return tuned
    if not is_cuda:
        return dict(block_m=16, block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=1)
    if num_rows <= SPLIT_MAX_ROWS:  # a few rows stream the weight: split K when the column tiles leave SMs idle
        cfg = dict(block_m=16 if num_rows <= 16 else 64, block_n=64, block_k=128, group_m=1, num_warps=4,
                   num_stages=4)
        cfg["split_k"] = default_split(triton.cdiv(n, cfg["block_n"]), k, cfg["block_k"], device)
        return cfg
    if num_rows <= 128:
        return dict(block_m=64, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    return dict(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=3)


def fp8_block_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """See ``ops.fp8.fp8_block_linear_ref``: x [..., K] -> [..., N] in x's dtype (activations quantized per
    token and group of ``block_size[1]``)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    n = weight.shape[0]
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return out.view(*lead, n)
    a, a_s = per_token_group_quant(x2, block_size[1])
    cfg = config or dense_config(x2.shape[0], x.device, n, k)
    grouped_gemm(a, weight, out, cfg, a_scale=a_s, b_scale=weight_scale_inv, block_size=block_size, bias=bias)
    return out.view(*lead, n)
