"""The host-read guard (``host_reads.no_host_reads``) catches every kind of read the decode path must not make."""

from __future__ import annotations

import pytest
import torch

from .host_reads import HostReadError, no_host_reads

X = torch.arange(4.0)


@pytest.mark.parametrize("read", [
    lambda: X[0].item(), lambda: X.tolist(), lambda: X.cpu(), lambda: X.numpy(), lambda: bool(X[0]),
    lambda: int(X[1]), lambda: X.nonzero(), lambda: X[X > 1], lambda: torch.bincount(X.long()),
    lambda: X.unique(),
], ids=["item", "tolist", "cpu", "numpy", "bool", "int", "nonzero", "bool-mask", "bincount", "unique"])
def test_every_host_read_raises(read):
    with no_host_reads(), pytest.raises(HostReadError):
        read()


def test_device_ops_pass_and_are_listed_and_the_methods_come_back():
    with no_host_reads() as ops:
        (X * 2).softmax(0).topk(2)
    assert ops == ["aten.mul.Tensor", "aten._softmax.default", "aten.topk.default"]
    assert X.tolist() == [0.0, 1.0, 2.0, 3.0] and bool(X[1])
