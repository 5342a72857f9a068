"""Batch-invariant matmul: the result of one row depends only on that row and the weight.

CPU (MKL): every product is computed in calls of exactly ``ROWS`` rows (the last block padded with zeros). MKL's
accumulation order over K depends on M for some shapes (on an AVX512 Xeon, [M, 960] @ [960, 2560] gives other
bits for a row at M = 16 than at M = 256), but at a fixed M a row's bits do not depend on its position or on the
other rows (checked for 16, 32 and 64 rows). So any row gets the same bits alone or in any batch. Batched products
are one ``torch.bmm`` per 16-row block, never of a single item (which takes another path). CUDA:
``triton_kernels.matmul_invariant_triton`` (fixed tiles, no split-K; batched products in one launch).
"""

from __future__ import annotations

import torch

ROWS = 16  # rows of every CPU call


def mm_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N], each row computed with the same accumulation order in any batch."""
    if a.is_cuda:
        from dsinfer.batch_invariant.triton_kernels import matmul_invariant_triton

        return matmul_invariant_triton(a, b)
    m = a.shape[0]
    padded = -(-m // ROWS) * ROWS
    if padded != m:
        a = torch.cat((a, a.new_zeros(padded - m, a.shape[1])))
    out = a.new_empty(padded, b.shape[1])
    for start in range(0, padded, ROWS):
        torch.mm(a[start:start + ROWS], b, out=out[start:start + ROWS])
    return out[:m]


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = mm_invariant(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def bmm_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[G, M, K] @ [G, K, N]: one ``torch.bmm`` of G items per ``ROWS``-row block of M, never of a single item
    (with one item, bmm takes the 2-D path, whose order can differ from the batched one)."""
    if a.is_cuda:
        from dsinfer.batch_invariant.triton_kernels import matmul_invariant_triton

        return matmul_invariant_triton(a, b)  # one launch, the same tiles as every 2-D product
    g, m, k = a.shape
    padded = max(-(-m // ROWS), 1) * ROWS
    if padded != m:
        a = torch.cat((a, a.new_zeros(g, padded - m, k)), 1)
    b = b.contiguous()  # row-major whatever the caller's layout: MKL's kernel (and so the bits) depends on it
    if g == 1:
        a, b = torch.cat((a, torch.zeros_like(a))), torch.cat((b, torch.zeros_like(b)))
    out = a.new_empty(a.shape[0], padded, b.shape[2])
    for start in range(0, padded, ROWS):  # each block contiguous, as every call's
        out[:, start:start + ROWS] = torch.bmm(a[:, start:start + ROWS].contiguous(), b)
    return out[:g, :m]


def matmul_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dim() >= 2 and b.dim() == 2:
        return mm_invariant(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[1])
    if a.dim() == 3 and b.dim() == 3:
        return bmm_invariant(a, b)
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return bmm_invariant(a3, b3).reshape(*lead, a.shape[-2], b.shape[-1])
