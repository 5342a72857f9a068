"""Triton ``silu_and_mul``: SiLU(gate) * up over rows laid out as [gate | up], tiled along the row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops.triton.pdl import enter, launch_args


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # rounded like torch's F.silu
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    n_cols = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], n_cols), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    block = min(triton.next_power_of_2(n_cols), 1024)
    if x2.shape[0] > 0:
        grid = (x2.shape[0], triton.cdiv(n_cols, block))
        _silu_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), n_cols, BLOCK=block, num_warps=4,
                                   **launch_args(x2.device))
    return out
