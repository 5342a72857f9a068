"""Few-row dense linears on the grouped GEMM kernel (``moe._gemm_kernel`` without the expert gather, split-K
from ``split_k``), for the weight shapes whose tuned entry says it beat cuBLAS (``ops.linear``); and a merged
gate/up projection with SiLU(gate) * up in the same kernel's epilogue (its ``GATED`` mode, two accumulators),
where the tuner measured it beating the projection and the SiLU-mul kernel (``ops.linear.linear_silu_mul``)."""

from __future__ import annotations

import functools

import torch

from dsinfer.ops.triton.moe import grouped_gemm, nearest_config

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def table_key(n: int, k: int, dtype: torch.dtype, gated: bool = False) -> str:
    """``dense,N,K,<dtype>``: the tuned table's key of an N x K weight; ``dense_silu_mul,N,K,<dtype>`` that of a
    merged gate/up weight of 2N x K whose N outputs are SiLU(gate) * up."""
    return f"{'dense_silu_mul' if gated else 'dense'},{n},{k},{DTYPE_NAMES[dtype]}"


@functools.lru_cache(maxsize=4096)
def _tuned(rows: int, n: int, k: int, dtype: torch.dtype, gated: bool = False) -> dict | None:
    cfg = nearest_config(table_key(n, k, dtype, gated), rows, True)
    if cfg is None or cfg.get("cublas") or cfg.get("unfused") or rows > cfg["block_m"]:
        return None
    return cfg


def tuned_config(rows: int, weight: torch.Tensor, gated: bool = False) -> dict | None:
    """The tuned tile of ``rows`` x weight^T (nearest row bucket within 4x), or None: cuBLAS (the tuner found it
    faster, measured nothing for this shape, or tuned a tile of fewer rows: past one row tile the weight streams
    once per tile, a cost the tuner did not time). ``gated``: the tile of SiLU(gate) * up over a merged gate/up
    weight, or None (the projection, then the SiLU-mul kernel)."""
    if weight.dim() != 2 or weight.dtype not in DTYPE_NAMES or not weight.is_contiguous():
        return None
    if gated and weight.shape[0] % 2:
        return None
    return _tuned(rows, weight.shape[0] // (2 if gated else 1), weight.shape[1], weight.dtype, gated)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: dict) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) in x's dtype, float32 accumulation."""
    return _rows_through(x, weight.shape[0], lambda x2, out: grouped_gemm(x2, weight, out, cfg, bias=bias))


def linear_silu_mul_triton(x: torch.Tensor, weight: torch.Tensor, cfg: dict) -> torch.Tensor:
    """SiLU(x W_gate^T) * (x W_up^T) for weight [2N, K] (gate rows, then up rows), in x's dtype: both products
    accumulate in float32 in one program, the epilogue multiplies them and rounds once. No split-K: the SiLU
    needs whole sums."""
    gated_cfg = dict(cfg, split_k=1)
    return _rows_through(x, weight.shape[0] // 2,
                         lambda x2, out: grouped_gemm(x2, weight, out, gated_cfg, gated=True))


def _rows_through(x: torch.Tensor, n: int, gemm) -> torch.Tensor:
    """x [..., K] as contiguous rows [M, K] into ``gemm(rows, out [M, n])``; out shaped [..., n]."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    gemm(x2, out)
    return out.view(*lead, n)
