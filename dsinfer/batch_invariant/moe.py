"""Batch-invariant mixture of experts: a token's output depends only on the token, never on its companions.

- Routing (``ops.moe.select_experts``): the gate matmul goes through the invariant matmuls; softmax / sigmoid /
  group masks / top-k are per token; in this mode the chosen experts are then ordered by expert id
  (``sort_topk``: the order ``topk(sorted=False)`` returns may depend on the batch on CUDA) and their weights
  are normalized with a sequential sum (``ordered_sum``).
- Experts (``fused_moe_invariant``): every (token, expert) pair's ``w * down(silu(gate(x)) * up(x))`` is
  computed by a matmul whose row results do not depend on the other rows (CPU: ``matmul.mm_invariant`` per
  active expert; CUDA: ``ops.triton.moe``'s grouped GEMM with one fixed tile configuration, no split-K); the
  top-k pairs of a token are then summed in float32, one after the other in expert-id order (no
  ``index_add_`` / reduce kernel whose order follows the batch). Shared experts fused into the stack are pairs
  like the others (ids after every routed one, so summed last); a separate shared MLP is added after that, in
  ``DeepseekMoE``, always in the same place.
"""

from __future__ import annotations

import torch

from dsinfer.batch_invariant.matmul import mm_invariant
from dsinfer.ops._common import block_dequantize, expert_outputs_by_expert


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


def _pairs_torch(hidden, w13, w2, topk_weights, topk_ids, swiglu_limit):
    order, sorted_out = expert_outputs_by_expert(hidden, w13, w2, topk_ids,
                                                 linear=lambda x, w: mm_invariant(x, w.t()), swiglu_limit=swiglu_limit)
    out = torch.empty_like(sorted_out)
    out[order] = sorted_out
    return out.view(*topk_ids.shape, -1).float() * topk_weights.float().unsqueeze(-1)


def _pairs_triton(hidden, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, block_size, swiglu_limit):
    from dsinfer.ops.triton.moe_fused import expert_pair_outputs

    cfg = gemm_config(hidden.is_cuda)  # one fixed tile config for both GEMMs: row results independent of the batch
    down = expert_pair_outputs(hidden, w13, w2, topk_weights, topk_ids, cfg, cfg, w13_scale_inv=w13_scale_inv,
                               w2_scale_inv=w2_scale_inv, block_size=block_size, swiglu_limit=swiglu_limit)
    return down.view(topk_ids.shape[0], topk_ids.shape[1], -1).float()


def fused_moe_invariant(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    *, w13_scale_inv: torch.Tensor | None = None, w2_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None, use_triton: bool = False, swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Same contract as ``ops.moe.fused_moe``; pairs summed in the order of ``topk_ids``' columns (expert-id
    order after ``sort_topk``)."""
    if hidden.shape[0] == 0:
        return torch.zeros_like(hidden)
    if use_triton:
        pairs = _pairs_triton(hidden, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, block_size,
                              swiglu_limit)
    else:
        if w13.dtype == torch.float8_e4m3fn:
            w13 = block_dequantize(w13, w13_scale_inv, block_size, hidden.dtype)
            w2 = block_dequantize(w2, w2_scale_inv, block_size, hidden.dtype)
        pairs = _pairs_torch(hidden, w13, w2, topk_weights, topk_ids, swiglu_limit)
    total = pairs[:, 0]
    for j in range(1, pairs.shape[1]):
        total = total + pairs[:, j]
    return total.to(hidden.dtype)
