"""Batch-invariant mixture of experts: a token's output depends only on the token, never on its companions.

- Routing (``ops.moe.select_experts``): the gate matmul goes through the invariant matmuls; softmax / sigmoid /
  group masks / top-k are per token; in this mode the chosen experts are then ordered by expert id
  (``sort_topk``: the order ``topk(sorted=False)`` returns may depend on the batch on CUDA) and their weights
  are normalized with a sequential sum (``ordered_sum``).
- Experts (``fused_moe_invariant``): every (token, expert) pair's ``w * down(silu(gate(x)) * up(x))`` is
  computed by a matmul whose row results do not depend on the other rows (CPU: ``matmul.mm_invariant`` per
  active expert; CUDA: ``ops.triton.moe``'s grouped GEMM with one fixed tile configuration, no split-K); the
  top-k pairs of a token are then summed in float32, one after the other in expert-id order (no
  ``index_add_`` / reduce kernel whose order follows the batch). The shared experts are added after that, in
  ``DeepseekMoE``, always in the same place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.batch_invariant.matmul import mm_invariant


def gemm_config(is_cuda: bool) -> dict:
    """The one tile configuration of the deterministic grouped / FP8 GEMMs (``ops.triton.moe.grouped_gemm``):
    never chosen from the number of rows."""
    if not is_cuda:
        return dict(block_m=16, block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=1)
    return dict(block_m=64, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=3)


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension, one element after the other (keepdim)."""
    total = x[..., :1]
    for j in range(1, x.shape[-1]):
        total = total + x[..., j:j + 1]
    return total


def sort_topk(topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's chosen experts in ascending id order (weights follow)."""
    topk_ids, perm = topk_ids.sort(dim=-1)
    return topk_weights.gather(1, perm), topk_ids


def _pairs_torch(hidden, w13, w2, topk_weights, topk_ids):
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    x = hidden[order // top_k]
    sorted_out = torch.empty(x.shape[0], w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate, up = mm_invariant(x[rows], w13[expert].t()).chunk(2, dim=-1)
        sorted_out[rows] = mm_invariant(F.silu(gate) * up, w2[expert].t())
        start += count
    out = torch.empty_like(sorted_out)
    out[order] = sorted_out
    return out.view(num_tokens, top_k, -1).float() * topk_weights.float().unsqueeze(-1)


def _pairs_triton(hidden, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, block_size):
    from dsinfer.ops.triton.moe import grouped_gemm, moe_align

    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    cfg = gemm_config(hidden.is_cuda)
    align = moe_align(topk_ids, w13.shape[0], cfg["block_m"])
    inter = torch.empty(num_pairs, w13.shape[1] // 2, dtype=hidden.dtype, device=hidden.device)
    down = torch.empty(num_pairs, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).float()
    if w13.dtype == torch.float8_e4m3fn:
        from dsinfer.ops.triton.fp8 import per_token_group_quant

        a, a_s = per_token_group_quant(hidden, block_size[1])
        grouped_gemm(a, w13, inter, cfg, a_scale=a_s, b_scale=w13_scale_inv, block_size=block_size,
                     align=align, a_div=top_k, gated=True)
        a2, a2_s = per_token_group_quant(inter, block_size[1])
        grouped_gemm(a2, w2, down, cfg, a_scale=a2_s, b_scale=w2_scale_inv, block_size=block_size,
                     align=align, topk_weights=weights)
    else:
        grouped_gemm(hidden, w13, inter, cfg, align=align, a_div=top_k, gated=True)
        grouped_gemm(inter, w2, down, cfg, align=align, topk_weights=weights)
    return down.view(num_tokens, top_k, -1).float()


def fused_moe_invariant(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    *, w13_scale_inv: torch.Tensor | None = None, w2_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None, use_triton: bool = False,
) -> torch.Tensor:
    """Same contract as ``ops.moe.fused_moe``; pairs summed in the order of ``topk_ids``' columns (expert-id
    order after ``sort_topk``)."""
    if hidden.shape[0] == 0:
        return torch.zeros_like(hidden)
    if use_triton:
        pairs = _pairs_triton(hidden, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, block_size)
    else:
        if w13.dtype == torch.float8_e4m3fn:
            from dsinfer.ops.fp8 import block_dequantize

            w13 = block_dequantize(w13, w13_scale_inv, block_size, hidden.dtype)
            w2 = block_dequantize(w2, w2_scale_inv, block_size, hidden.dtype)
        pairs = _pairs_torch(hidden, w13, w2, topk_weights, topk_ids)
    total = pairs[:, 0]
    for j in range(1, pairs.shape[1]):
        total = total + pairs[:, j]
    return total.to(hidden.dtype)
