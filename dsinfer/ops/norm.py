"""RMSNorm with an optional fused residual add.

``rms_norm(x, w, eps)`` -> normed; ``rms_norm(x, w, eps, residual)`` -> (normed(x + residual), x + residual).
Statistics are computed in float32 and the result cast back to x's dtype, as the HF reference does.
``rms_norm_cpu`` is the same in one C++ pass (float32 on CPU; the quantized CPU models' norms take it).
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


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` by the C++ kernel (``csrc/cpu_norm.cpp``, built with the quantized linears: call only where
    ``cpu_quant.native_available()``): float32 x, residual and weight on CPU. One pass instead of torch's six ops
    (~40 us a call at [1, 576]); its sum of squares is in double, so results differ from ``rms_norm_ref`` by an
    ulp or two: the exact float32 path keeps ``rms_norm``."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).contiguous()
    if residual is None:
        return torch.ops.dsinfer_cpu.rms_norm(flat, weight, eps).view(shape)
    out, total = torch.ops.dsinfer_cpu.add_rms_norm(flat, residual.reshape(-1, shape[-1]).contiguous(), weight, eps)
    return out.view(shape), total.view(shape)
