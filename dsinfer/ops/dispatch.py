"""Which implementation an op call takes: Triton on CUDA (or when DSINFER_USE_TRITON=always), else torch."""

from __future__ import annotations

import torch

from dsinfer import envs


def use_triton(x: torch.Tensor) -> bool:
    mode = envs.USE_TRITON.get()
    if mode == "never":
        return False
    if mode == "always":
        return True
    return x.is_cuda
