"""Which implementation an op call takes: Triton on CUDA (or everywhere with ``use_triton="always"``), else torch.

The mode is a process-wide kernel option (``ops.options``), set at start-up from the engine's ``KernelConfig``.
"""

from __future__ import annotations

import torch

from dsinfer.ops import options


def use_triton(x: torch.Tensor) -> bool:
    mode = options.current().use_triton
    if mode == "never":
        return False
    if mode == "always":
        return True
    return x.is_cuda
