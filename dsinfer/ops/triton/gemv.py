"""Few-row dense linears on the grouped GEMM kernel (``moe._gemm_kernel`` without the expert gather, split-K
from ``split_k``), for the weight shapes whose tuned entry says it beat cuBLAS (``ops.linear``)."""

from __future__ import annotations

import functools

import torch

from dsinfer.ops.triton.moe import grouped_gemm, nearest_config

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def table_key(n: int, k: int, dtype: torch.dtype) -> str:
    """``dense,N,K,<dtype>``: the tuned table's key of an N x K weight."""
    return f"dense,{n},{k},{DTYPE_NAMES[dtype]}"


@functools.lru_cache(maxsize=4096)
def _tuned(rows: int, n: int, k: int, dtype: torch.dtype) -> dict | None:
    cfg = nearest_config(table_key(n, k, dtype), rows, True)
    if cfg is None or cfg.get("cublas") or rows > cfg["block_m"]:
        return None
    return cfg


def tuned_config(rows: int, weight: torch.Tensor) -> dict | None:
    """The tuned tile of ``rows`` x weight^T (nearest row bucket within 4x), or None: cuBLAS (the tuner found it
    faster, measured nothing for this shape, or tuned a tile of fewer rows: past one row tile the weight streams
    once per tile, a cost the tuner did not time)."""
    if weight.dim() != 2 or weight.dtype not in DTYPE_NAMES or not weight.is_contiguous():
        return None
    return _tuned(rows, weight.shape[0], weight.shape[1], weight.dtype)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: dict) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) in x's dtype, float32 accumulation."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    grouped_gemm(x2, weight, out, cfg, bias=bias)
    return out.view(*lead, weight.shape[0])
