"""Dense linear ``y = x W^T (+ b)``: cuBLAS, except where the tuner measured a Triton tile beating it.

At a few rows (batch-1 to batch-64 decode) a linear layer is a weight-streaming GEMV. cuBLAS runs some of these
shapes well below the bandwidth (Llama-3.1-8B's o_proj at 58% of it, session 16). ``benchmarks/tune_gemv.py``
times cuBLAS against tiles of the grouped GEMM kernel (with split-K) on the GPU, per shape and row bucket, and
writes the winner to ``configs/moe.json`` under ``dense,N,K,<dtype>``: a Triton tile, or ``{"cublas": true}``.
Shapes with no entry, CPU, and the batch-invariant mode (its own fixed-tile matmul) take ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer import batch_invariant, envs
from dsinfer.ops.dispatch import use_triton

GEMV_MAX_ROWS = 64  # past this a linear is a GEMM, cuBLAS's ground


def _tuned_tile(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    if not (x.is_cuda and x.dim() >= 1 and envs.TRITON_GEMV.get() and use_triton(x)
            and not batch_invariant.is_enabled()):
        return None
    rows = x.numel() // max(1, x.shape[-1])
    if not 0 < rows <= GEMV_MAX_ROWS:
        return None
    from dsinfer.ops.triton import gemv

    return gemv.tuned_config(rows, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           keep_split: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; see the module doc for when a Triton tile runs it instead.

    ``keep_split`` (x [T, K], no bias): where that tile splits K, return its float32 partials [S, T, N] instead
    (``split_k``), for a consumer that adds them as it loads them (``ops.rotary_store_kv``'s ``split_dtype``) in
    place of the ``sum_partials`` launch. Tell the two apart by ``is_split``."""
    cfg = _tuned_tile(x, weight)
    if cfg is not None:
        from dsinfer.ops.triton.gemv import linear_triton

        keep = keep_split and bias is None and x.dim() == 2
        return linear_triton(x, weight, bias, cfg, keep_split=keep)
    return F.linear(x, weight, bias)


def is_split(y: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``linear(x, ..., keep_split=True)`` returned split-K partials (one more dim than x) for y."""
    return y.dim() == x.dim() + 1


def add_splits(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, ...] float32 split-K partials -> their sum in split order, rounded to ``dtype`` (``sum_partials``)."""
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    return total.to(dtype)
