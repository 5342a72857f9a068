"""The batch-invariant context: a flag read by ``ops.paged_attention`` and a dispatch mode for the matmuls (and, on
CPU, sigmoid, SiLU and softplus)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsinfer.batch_invariant import elementwise, matmul

_state = threading.local()
aten = torch.ops.aten
_ELEMENTWISE = {aten.sigmoid.default: elementwise.sigmoid, aten.silu.default: elementwise.silu}


def is_enabled() -> bool:
    return getattr(_state, "enabled", False)


class _InvariantOps(TorchDispatchMode):
    """Routes aten matmuls to ``matmul.py``, and on CPU sigmoid, SiLU and softplus to ``elementwise.py`` (torch's
    CPU kernels give an element other bits in a vectorized loop's scalar tail); every other op runs unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ELEMENTWISE and not args[0].is_cuda:
            return _ELEMENTWISE[func](args[0])
        if func is aten.softplus.default and not args[0].is_cuda and (args[1:] or (1,))[0] == 1:
            return elementwise.softplus(args[0])
        if func is aten.linear.default:
            return matmul.linear_invariant(*args, **kwargs)
        if func is aten.mm.default:
            return matmul.mm_invariant(*args)
        if func is aten.addmm.default and not kwargs:
            return args[0] + matmul.mm_invariant(args[1], args[2])
        if func is aten.bmm.default:
            return matmul.bmm_invariant(*args)
        if func is aten.matmul.default:
            return matmul.matmul_invariant(*args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Run the enclosed forward pass batch-invariantly (a no-op when ``enabled`` is false); not re-entrant."""
    if not enabled:
        yield
        return
    if is_enabled():
        raise RuntimeError("batch_invariant() is already active on this thread; it does not nest")
    _state.enabled = True
    try:
        with _InvariantOps():
            yield
    finally:
        _state.enabled = False
