"""Triton ``rms_norm``: one program per row, optional fused residual add (the sum is written out too)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops.triton.pdl import NORM, enter, launch_args


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    stride_x, stride_res, stride_out, stride_sum,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait (``pdl``)
    enter(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded to x's dtype, as torch's add
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, n_cols)
    if residual is not None:
        res2 = _rows(residual)
        total = torch.empty_like(x)
        sum2 = total.view(-1, n_cols)
    else:
        res2 = sum2 = x2
    block_n = triton.next_power_of_2(n_cols)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out2, sum2,
            x2.stride(0), res2.stride(0), out2.stride(0), sum2.stride(0),
            n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_N=block_n,
            num_warps=min(max(block_n // 512, 1), 16), **launch_args(x2.device, NORM),
        )
    return out if residual is None else (out, total)
