"""RMSNorm with an optional fused residual add.

``rms_norm(x, w, eps)`` -> normed; ``rms_norm(x, w, eps, residual)`` -> (normed(x + residual), x + residual).
Statistics are computed in float32 and the result cast back to x's dtype, as the HF reference does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.dispatch import use_triton


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32:  # torch's fused kernel: the same arithmetic (bit for bit in float32), fewer ops
        out = F.rms_norm(x, weight.shape, weight, eps)
        return out if residual is None else (out, residual)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return out if residual is None else (out, residual)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from dsinfer.ops.triton.norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
