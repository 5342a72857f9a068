"""Batch-invariant matmul: the result of one row depends only on that row and the weight.

CPU (MKL): a row's accumulation order over K is the same for every call whose M is >= 4 (measured: M = 1..3
take other code paths); calls are made with M in [16, 256] (row chunks of 256, the last padded to 16 with
zeros), so any row gets the same bits alone or in any batch. CUDA: ``triton_kernels.matmul_invariant_triton``
(fixed tiles, no split-K; batched products in one launch).
"""

from __future__ import annotations

import torch

MIN_ROWS = 16
MAX_ROWS = 256


def mm_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N], each row computed with the same accumulation order in any batch."""
    if a.is_cuda:
        from dsinfer.batch_invariant.triton_kernels import matmul_invariant_triton

        return matmul_invariant_triton(a, b)
    m = a.shape[0]
    if MIN_ROWS <= m <= MAX_ROWS:
        return torch.mm(a, b)
    out = a.new_empty(m, b.shape[1])
    for start in range(0, m, MAX_ROWS):
        chunk = a[start:start + MAX_ROWS]
        rows = chunk.shape[0]
        if rows < MIN_ROWS:
            chunk = torch.cat((chunk, chunk.new_zeros(MIN_ROWS - rows, chunk.shape[1])))
        out[start:start + rows] = torch.mm(chunk, b)[:rows]
    return out


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = mm_invariant(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def bmm_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[G, M, K] @ [G, K, N]: each of the G products as ``mm_invariant`` (M padded to >= 16, batched)."""
    m = a.shape[1]
    if a.is_cuda:
        from dsinfer.batch_invariant.triton_kernels import matmul_invariant_triton

        return matmul_invariant_triton(a, b)  # one launch, the same tiles as every 2-D product
    if m > MAX_ROWS:
        return torch.stack([mm_invariant(a[g], b[g]) for g in range(a.shape[0])])
    if m < MIN_ROWS:
        pad = a.new_zeros(a.shape[0], MIN_ROWS - m, a.shape[2])
        return torch.bmm(torch.cat((a, pad), 1), b)[:, :m]
    return torch.bmm(a, b)


def matmul_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dim() >= 2 and b.dim() == 2:
        return mm_invariant(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[1])
    if a.dim() == 3 and b.dim() == 3:
        return bmm_invariant(a, b)
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return bmm_invariant(a3, b3).reshape(*lead, a.shape[-2], b.shape[-1])
