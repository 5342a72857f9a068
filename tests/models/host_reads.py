"""A guard against host reads: inside ``no_host_reads()`` anything that would make the host wait for a device value
(or shape a tensor by one) raises, on CPU as it would on CUDA.

Two nets: a ``TorchDispatchMode`` fails on the aten ops that read a value back (``_local_scalar_dense``:
``.item()``, ``bool()``, ``int()``...; ``nonzero``, ``masked_select``, ``bincount``, ``unique``, indexing by a
bool mask: data-dependent shapes), and the ``Tensor`` methods that copy to the host (``.tolist()``, ``.cpu()``,
``.numpy()``, ``.item()``, ``bool()``) are replaced by ones that raise, since on CPU tensors some of them never
reach the dispatcher. What a CUDA graph capture refuses, this refuses on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ATEN_HOST_READS = {
    torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default, torch.ops.aten.bincount.default, torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default, torch.ops.aten.unique_dim.default,
}
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}
_METHODS = ("tolist", "cpu", "numpy", "item", "__bool__")


def _bool_index(func, args) -> bool:
    """Indexing by a bool mask (``x[mask]``): its result's shape is the mask's count."""
    return func in _INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1])


class HostReadError(AssertionError):
    """Something read a tensor's value on the host inside ``no_host_reads``."""


class _AtenGuard(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _ATEN_HOST_READS or _bool_index(func, args):
            raise HostReadError(f"host read: {func}")
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _refuse(name: str):
    def method(self, *args, **kwargs):
        raise HostReadError(f"host read: Tensor.{name}() of a {tuple(self.shape)} tensor")
    return method


@contextlib.contextmanager
def no_host_reads() -> Iterator[list[str]]:
    """Raise ``HostReadError`` on any host read inside; yields the list of aten ops run (to compare two runs)."""
    saved = {name: getattr(torch.Tensor, name) for name in _METHODS}
    guard = _AtenGuard()
    try:
        for name in _METHODS:
            setattr(torch.Tensor, name, _refuse(name))
        with guard:
            yield guard.ops
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
