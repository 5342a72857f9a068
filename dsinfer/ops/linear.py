"""Dense linear ``y = x W^T (+ b)``: cuBLAS, except where the tuner measured a Triton tile beating it.

At a few rows (batch-1 to batch-64 decode) a linear layer is a weight-streaming GEMV. cuBLAS runs some of these
shapes well below the bandwidth (Llama-3.1-8B's o_proj at 58% of it, session 16). ``benchmarks/tune_gemv.py``
times cuBLAS against tiles of the grouped GEMM kernel (with split-K) on the GPU, per shape and row bucket, and
writes the winner to ``configs/moe.json`` under ``dense,N,K,<dtype>``: a Triton tile, or ``{"cublas": true}``.
Shapes with no entry, CPU, and the batch-invariant mode (its own fixed-tile matmul) take ``F.linear``.

``linear_silu_mul`` is an MLP's merged gate/up projection and its SiLU(gate) * up: one Triton kernel where the
tuner measured one beating the projection followed by the SiLU-mul kernel (``dense_silu_mul,N,K,<dtype>``
entries), else those two; the MLP layers pass ``fused=False`` where ``KernelConfig.fused_silu_mul`` is off.
Whether a tuned tile may run at all is the process-wide ``triton_gemv`` option (``ops.options``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer import batch_invariant
from dsinfer.ops import options
from dsinfer.ops.activation import silu_and_mul
from dsinfer.ops.dispatch import use_triton

GEMV_MAX_ROWS = 64  # past this a linear is a GEMM, cuBLAS's ground


def _tuned_tile(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> dict | None:
    if not (x.is_cuda and x.dim() >= 1 and options.current().triton_gemv and use_triton(x)
            and not batch_invariant.is_enabled()):
        return None
    rows = x.numel() // max(1, x.shape[-1])
    if not 0 < rows <= GEMV_MAX_ROWS:
        return None
    from dsinfer.ops.triton import gemv

    return gemv.tuned_config(rows, weight, gated)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; see the module doc for when a Triton tile runs it instead."""
    cfg = _tuned_tile(x, weight)
    if cfg is not None:
        from dsinfer.ops.triton.gemv import linear_triton

        return linear_triton(x, weight, bias, cfg)
    return F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    fused: bool = True) -> torch.Tensor:
    """``silu_and_mul(linear(x, weight, bias))`` for a merged gate/up weight [2I, K] (gate rows first): [..., I].
    See the module doc for when one Triton kernel runs both (never with a bias: it must be added before the
    SiLU; never with ``fused=False``)."""
    cfg = _tuned_tile(x, weight, gated=True) if bias is None and fused else None
    if cfg is not None:
        from dsinfer.ops.triton.gemv import linear_silu_mul_triton

        return linear_silu_mul_triton(x, weight, cfg)
    return silu_and_mul(linear(x, weight, bias))
