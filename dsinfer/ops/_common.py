"""Helpers shared by the public ops, their Triton kernels and the deterministic mode's kernels.

It imports no other dsinfer module, so any module may import it without closing an import circle
(``ops.triton`` and ``batch_invariant`` take these from here, never from a public op module).

KV-cache dtypes: an FP8 cache (vLLM's ``kv_cache_dtype="fp8"``) holds ``x / scale`` saturated at the format's
largest finite value; readers multiply the scale back (``dequantize``). As in vLLM, scales apply to FP8 caches only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def fp8_max(dtype: torch.dtype) -> float:
    """The saturation bound of an FP8 cache dtype, 0.0 for any other dtype (no clamp)."""
    return float(torch.finfo(dtype).max) if dtype in FP8_DTYPES else 0.0


def read_scales(cache_dtype: torch.dtype, kv_scales: tuple[float, float]) -> tuple[float, float]:
    """The (key, value) scales a reader of a cache of ``cache_dtype`` applies: 1.0 unless it is FP8."""
    return (float(kv_scales[0]), float(kv_scales[1])) if cache_dtype in FP8_DTYPES else (1.0, 1.0)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache dtype; FP8: x / scale, saturated (a plain cast of an out-of-range value gives NaN on CUDA)."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = fp8_max(dtype)
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values back in ``dtype`` (FP8: times their scale)."""
    if x.dtype not in FP8_DTYPES or scale == 1.0:
        return x.to(dtype)
    return x.to(dtype) * scale


def copy_rows(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst.index_copy_(0, index, rows)`` for any cache dtype (index_copy_ has no FP8 kernel on CPU: an FP8
    cache's rows are copied as bytes)."""
    if dst.element_size() == 1:
        dst, rows = dst.view(torch.uint8), rows.view(torch.uint8)
    dst.index_copy_(0, index, rows)


def cache_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The MLA cache rows ``slots`` ([...] int64) -> [..., R + P] in the cache's dtype (an FP8 cache is indexed as
    bytes: a plain gather on every device and torch build)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    if kv_cache.dtype in FP8_DTYPES:
        return flat.view(torch.uint8)[slots].view(kv_cache.dtype)
    return flat[slots]


def latent_values(latent: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """W_UV per head: latent [T, H, R] x w_uv [H, V, R] -> ``out`` [T, H, V] (one batched GEMM, [H, T, R] @
    [H, R, V], written through a transposed view straight into [T, H, V])."""
    torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
    return out


def block_dequantize(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """weight [..., N, K] fp8, scale_inv [..., ceil(N/bn), ceil(K/bk)] -> [..., N, K] in ``dtype``."""
    bn, bk = block_size
    n, k = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (weight.float() * scale).to(dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with ``limit`` the clamped SwiGLU of DeepSeek-V4: gate <= limit, -limit <= up <= limit."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def expert_outputs_by_expert(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
    swiglu_limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The T * k (token, expert) pairs sorted by expert (stable), and each pair's unweighted expert output in
    that order: (order [T * k], out [T * k, H]). Each active expert runs ``linear`` (x @ w.T) twice over its
    contiguous slice of rows; the deterministic mode passes its row-invariant matmul. ``swiglu_limit``: the
    clamped SwiGLU (``swiglu``)."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # host sync: expert slice bounds
    x = hidden[order // top_k]
    out = torch.empty(x.shape[0], w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate, up = linear(x[rows], w13[expert]).chunk(2, dim=-1)
        out[rows] = linear(swiglu(gate, up, swiglu_limit), w2[expert])
        start += count
    return order, out


class PackedContexts:
    """The cache slots of every sequence's context packed back to back, for the expanded MLA prefill.

    Built on first use (``slots_and_starts``: one host sync, the packed length; prefill steps are not
    graph-captured), then shared: a layer makes one per step from the batch and every MLA layer of the step
    reads the same (``layers.mla.MLAMetadata``)."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
        self.block_tables, self.seq_lens, self.block_size = block_tables, seq_lens, block_size

    @functools.cached_property
    def slots_and_starts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [L_total] int64, cu [B + 1] int64: sequence b's rows are ``cu[b]:cu[b + 1]``)."""
        lens = self.seq_lens.long()
        cu = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
        torch.cumsum(lens, 0, out=cu[1:])
        total = int(cu[-1])
        seq_of = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=total)
        pos = torch.arange(total, device=lens.device) - cu[seq_of]
        size = self.block_size
        slots = self.block_tables[seq_of, pos // size].long() * size + pos % size
        return slots, cu


@dataclass(frozen=True)
class Routing:
    """How router scores pick a token's experts and weight them (see ``ops.moe.select_experts``)."""

    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func={self.scoring_func!r} is not supported; supported: {SCORING_FUNCS}"
            )
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r} is not supported; supported: {TOPK_METHODS}")
