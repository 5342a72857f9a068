"""Split-K for the weight-streaming GEMMs of a few rows: more programs than output tiles.

At decode sizes a narrow, deep weight (DeepSeek-V3's fused q_a/kv_a projection: 2,112 x 7,168; o_proj: 7,168 x
16,384) gives one program per column tile, 33 or 112 of them for 132 SMs, each streaming a long K loop: the
H200 ran them at 16% and 46% of its bandwidth (session 16's tuner). Splitting K gives each program a slice of
the loop; the programs store float32 partials and ``sum_partials`` adds them in split order (deterministic for
one config), then the bias, and casts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops.triton.pdl import SPLIT_SUM, enter, launch_args
from dsinfer.ops.triton.utils import num_sms

MAX_SPLIT = 16
SPLIT_MAX_ROWS = 64  # the most rows a split was timed at (the tuner's decode buckets 1, 16, 64)
MIN_K_BLOCKS = 4  # K tiles each split keeps at least (a choice, not measured: short loops, more partials)


def split_sizes(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(K elements per split, a multiple of block_k; the number of splits that leaves non-empty): the splits
    requested may shrink so that none is empty."""
    if k <= 0 or split <= 1:
        return max(k, block_k), 1
    k_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    return k_split, triton.cdiv(k, k_split)


def default_split(tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """A power of two that brings ``tiles`` output tiles near two programs per SM, each split keeping
    MIN_K_BLOCKS K tiles; 1 when the tiles fill the GPU already."""
    want = min(MAX_SPLIT, (2 * num_sms(device)) // max(1, tiles), triton.cdiv(k, block_k) // MIN_K_BLOCKS)
    return 1 << (want.bit_length() - 1) if want > 1 else 1


@triton.jit
def _sum_partials_kernel(p_ptr, bias_ptr, out_ptr, N, stride_ps, stride_pm, stride_om, stride_on,
                         SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                         PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for s in tl.static_range(SPLIT_K):  # split order: the same sum every time
        acc += tl.load(p_ptr + s * stride_ps + row * stride_pm + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_partials(partials: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """out[m, n] = sum over s of partials[s, m, n] (+ bias[n]), in split order; partials [S, M, N] float32."""
    split, m, n = partials.shape
    if m == 0:
        return out
    block_n = min(512, triton.next_power_of_2(n))
    _sum_partials_kernel[(m, triton.cdiv(n, block_n))](
        partials, bias if bias is not None else partials, out, n, partials.stride(0), partials.stride(1),
        out.stride(0), out.stride(1), SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK_N=block_n, num_warps=4,
        **launch_args(partials.device, SPLIT_SUM))
    return out
