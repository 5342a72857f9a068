"""SiLU(gate) * up over a [T, 2*I] tensor laid out as [gate | up]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.dispatch import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from dsinfer.ops.triton.activation import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
