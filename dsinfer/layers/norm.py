"""RMSNorm module over ``ops.rms_norm`` (fused residual add when a residual is passed).

A quantized CPU model's norms take the C++ kernel instead (``native_cpu``, set by ``layers.quant`` once the
kernels are built): one pass per row, not bit-equal to the float32 path, which keeps ``ops.rms_norm``.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer import ops
from dsinfer.ops.norm import rms_norm_cpu


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.native_cpu = False  # ops.norm.rms_norm_cpu for float32 inputs (layers.quant sets it)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.native_cpu and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return rms_norm_cpu(x, self.weight, self.eps, residual)
        return ops.rms_norm(x, self.weight, self.eps, residual)
