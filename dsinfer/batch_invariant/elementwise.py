"""Sigmoid, SiLU and softplus whose bits do not depend on where an element sits in its tensor (CPU, deterministic mode).

PyTorch's CPU kernels for ``exp``-based functions run a vectorized loop (Sleef) over a thread's range and finish
its tail with the scalar function (libm). The two differ in the last bit, and which elements fall in a tail
depends on the tensor's size and on how it is split between threads, that is on the batch. On an AVX512 machine
(16 floats per vector), a DeepSeek-V3 router's sigmoid over 8 experts gave a token other weights alone than among
companions. These versions use only operations that IEEE 754 rounds exactly (add, multiply, divide, round,
exponent bits), in float64, and round once to the input's dtype, so every element gets the same bits on any
machine, in any batch, vector lane or thread. They are within one unit in the last place of ``torch.sigmoid`` /
``F.silu`` / ``F.softplus`` in float32 (DeepSeek-V4's router scores are sqrt(softplus): sqrt is IEEE-exact
already). The mode's dispatch hook (``mode.py``) sends ``aten.sigmoid`` / ``aten.silu`` / ``aten.softplus`` here
on CPU;
on CUDA every element runs the same instructions, so the GPU keeps torch's kernels.
"""

from __future__ import annotations

import math

import torch

_LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that k * _LN2_HI is exact for |k| < 2^11 (fdlibm)
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00
# 1/n! for n = 13..0: exp(r) on |r| <= ln(2)/2 by Horner's rule, error below 1e-17 relative
_TAYLOR = [1.0 / math.factorial(n) for n in range(13, -1, -1)]


def _exp64(x: torch.Tensor) -> torch.Tensor:
    """exp of a float64 tensor clamped to [-700, 700], from exactly rounded operations only."""
    x = x.clamp(-700.0, 700.0)
    k = torch.round(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = torch.full_like(r, _TAYLOR[0])
    for c in _TAYLOR[1:]:
        p = p * r + c
    two_k = ((k.to(torch.int64) + 1023) << 52).view(torch.float64)  # 2^k from its exponent bits
    return p * two_k


# 1 / (2n + 1) for n = 20..0: log(u) = 2 atanh(s), s = (u - 1) / (u + 1) in [0, 1/3] for u in [1, 2]; the series in
# s^2 <= 1/9 has terms below 1e-19 relative by n = 20
_ATANH = [1.0 / (2 * n + 1) for n in range(20, -1, -1)]


def _log1p_unit64(t: torch.Tensor) -> torch.Tensor:
    """log(1 + t) for float64 t in [0, 1], from exactly rounded operations only."""
    s = t / (2.0 + t)  # (u - 1) / (u + 1) with u = 1 + t, without rounding u first
    s2 = s * s
    p = torch.full_like(s, _ATANH[0])
    for c in _ATANH[1:]:
        p = p * s2 + c
    return 2.0 * s * p


def _sigmoid64(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + _exp64(-x.double()))  # exp's clamp: 1 or 1e-304 past +-700, 1 or 0 once rounded


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid(x)`` with position-independent bits (see module doc); NaN stays NaN."""
    return _sigmoid64(x).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x)`` = x * sigmoid(x), with position-independent bits."""
    return (x.double() * _sigmoid64(x)).to(x.dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``F.softplus(x)`` (beta 1) = max(x, 0) + log(1 + exp(-|x|)), with position-independent bits; NaN stays NaN."""
    d = x.double()
    return (d.clamp(min=0.0) + _log1p_unit64(_exp64(-d.abs()))).where(~d.isnan(), d).to(x.dtype)
