"""FP8 (e4m3) block-quantized weights, as DeepSeek-V3 checkpoints store them.

A weight ``W [N, K]`` is stored as ``W_fp8 [N, K]`` (float8_e4m3fn) plus
``scale_inv [ceil(N/bn), ceil(K/bk)]``
(float32): ``W[i, j] = W_fp8[i, j] * scale_inv[i // bn, j // bk]`` (the name says "inverse": it undoes the
quantization scale). Edge blocks may be partial.

``fp8_block_linear`` is the op a block-scaled GEMM kernel replaces (same signature); the torch reference
dequantizes and runs a plain matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer import batch_invariant
from dsinfer.ops._common import block_dequantize
from dsinfer.ops.dispatch import use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def scale_grid(rows: int, cols: int, block_size: tuple[int, int]) -> tuple[int, int]:
    """Shape of the block-scale tensor of a [rows, cols] weight."""
    return -(-rows // block_size[0]), -(-cols // block_size[1])


def block_quantize(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] float32); scale = block amax / 448."""
    bn, bk = block_size
    n, k = weight.shape
    gn, gk = scale_grid(n, k, block_size)
    padded = weight.new_zeros(gn * bn, gk * bk, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    blocks = padded.view(gn, bn, gk, bk)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    quant = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quant.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale_inv


def fp8_block_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] @ dequant(weight [N, K])^T (+ bias) -> [T, N] in x's dtype."""
    return F.linear(x, block_dequantize(weight, weight_scale_inv, block_size, x.dtype), bias)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """See ``fp8_block_linear_ref``. The Triton path quantizes x per token and group of ``block_size[1]``
    (e4m3, w8a8) and runs the block-scaled GEMM."""
    if use_triton(x):
        from dsinfer.ops.triton.fp8 import fp8_block_linear_triton

        config = None
        if batch_invariant.is_enabled():  # deterministic mode: one tile configuration whatever the rows
            from dsinfer.batch_invariant.moe import gemm_config

            config = gemm_config(x.is_cuda)
        return fp8_block_linear_triton(x, weight, weight_scale_inv, block_size, bias, config=config)
    return fp8_block_linear_ref(x, weight, weight_scale_inv, block_size, bias)
