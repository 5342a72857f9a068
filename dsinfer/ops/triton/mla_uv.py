"""MLA decode followed by W_UV, with the split combine and W_UV in one kernel at few rows.

The absorbed decode (``ops.triton.mla``) leaves each head's attended latent [R] in float32 partials, one per
split of the context. Separately, a combine kernel writes the latent [T, H, R] and a batched GEMM multiplies it
by W_UV [H, V, R]: two launches of a few microseconds each at batch 1 (27 of each per V2-Lite step, a quarter of
its kernel boundaries outside the GEMMs). ``_mla_reduce_uv_kernel`` does both: a program takes one row, one
head and ``BLOCK_V`` output columns, loads its W_UV columns and the head's partials at once, combines the splits
and multiplies, so the latent never goes to memory (and is not rounded to bf16).

Each program reads its head's W_UV columns, so the weight is read once per row: past ``FUSED_UV_MAX_HEAD_ROWS``
rows x heads (or with a single split, where nothing is combined) the two-launch path is used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops._common import latent_values
from dsinfer.ops.triton.mla import combine_splits, decode_splits
from dsinfer.ops.triton.pdl import MLA_COMBINE, enter, launch_args

# Rows x heads up to which the fused combine + W_UV runs: every row reads all of W_UV again (2 MB for V2-Lite's
# 16 heads, 16 MB for V3's 128) where the batched GEMM reads it once. H200, CUDA-graph timed with the decode
# kernel, 1k context (session 17): 16 heads, 1 / 2 / 4 rows 16.5 / 17.3 / 19.1 us against 19.3 / 19.9 / 20.4;
# 128 heads, 1 / 2 / 4 rows 27.4 / 34.4 / 49.3 against 28.1 / 29.1 / 32.6.
FUSED_UV_MAX_HEAD_ROWS = 64
_BLOCK_V = 32


@triton.jit
def _mla_reduce_uv_kernel(
    part_out_ptr, part_lse_ptr, query_start_loc_ptr, w_ptr, out_ptr, num_seqs, num_heads, num_splits, v_dim,
    stride_wh, stride_wv, stride_ot, stride_oh,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False,
):
    head = tl.program_id(0)
    v_tile = tl.program_id(1)
    row = tl.program_id(2)
    # every load is issued before any arithmetic: at one row the kernel is a chain of memory latencies; the
    # step's metadata and the weight before the wait (``pdl``: no kernel of a forward writes them)
    num_rows = tl.load(query_start_loc_ptr + num_seqs)
    offs_r = tl.arange(0, BLOCK_R)
    offs_v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    w = tl.load(w_ptr + head.to(tl.int64) * stride_wh + offs_v[:, None] * stride_wv + offs_r[None, :],
                mask=(offs_v[:, None] < v_dim) & (offs_r[None, :] < RANK), other=0.0)
    enter(PDL)
    if row >= num_rows:  # a padding row of a graph's batch
        return
    offs_s = tl.arange(0, BLOCK_S)
    part = (row.to(tl.int64) * num_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=offs_s < num_splits, other=float("-inf"))
    parts = tl.load(part_out_ptr + part[:, None] * RANK + offs_r[None, :],
                    mask=(offs_s[:, None] < num_splits) & (offs_r[None, :] < RANK), other=0.0)
    top = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(weight, axis=0)
    latent = tl.sum(parts * weight[:, None], axis=0)  # [BLOCK_R], not yet divided by the total
    out = tl.sum(w.to(tl.float32) * latent[None, :], axis=1) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + offs_v,
             out.to(out_ptr.dtype.element_ty), mask=offs_v < v_dim)


def mla_decode_uv_triton(
    q_nope_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    w_uv: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """See ``ops.mla.mla_decode_uv_ref``. ``fused`` forces the one-kernel combine + W_UV on (True) or off
    (False); by default it runs at up to ``FUSED_UV_MAX_HEAD_ROWS`` rows x heads."""
    num_rows, num_heads, rank = q_nope_absorbed.shape
    v_dim = w_uv.shape[1]
    if w_uv.shape != (num_heads, v_dim, rank) or w_uv.stride(-1) != 1:
        raise ValueError(f"w_uv must be [H, V, R] = [{num_heads}, V, {rank}] with unit stride over R, "
                         f"got {tuple(w_uv.shape)} with strides {w_uv.stride()}")
    if out is None:
        out = q_nope_absorbed.new_empty(num_rows, num_heads, v_dim)
    elif out.shape != (num_rows, num_heads, v_dim) or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, H, V] = [{num_rows}, {num_heads}, {v_dim}] with unit stride over V, "
                         f"got {tuple(out.shape)} with strides {out.stride()}")
    if num_rows == 0:
        return out
    if fused is None:
        fused = num_rows * num_heads <= FUSED_UV_MAX_HEAD_ROWS
    split = decode_splits(q_nope_absorbed, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                          max_seq_len=max_seq_len, num_splits=num_splits)
    if split.part_out is None or not fused:
        latent = split.out if split.part_out is None else combine_splits(split, query_start_loc)
        return latent_values(latent, w_uv, out)
    _mla_reduce_uv_kernel[(num_heads, triton.cdiv(v_dim, _BLOCK_V), num_rows)](
        split.part_out, split.part_lse, query_start_loc, w_uv, out, query_start_loc.shape[0] - 1, num_heads,
        split.num_splits, v_dim, w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1),
        RANK=rank, BLOCK_R=triton.next_power_of_2(rank), BLOCK_S=max(triton.next_power_of_2(split.num_splits), 2),
        BLOCK_V=_BLOCK_V, num_warps=8, **launch_args(split.part_out.device, MLA_COMBINE),
    )
    return out
