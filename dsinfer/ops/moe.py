"""Mixture of experts: the router (``select_experts``) and the expert computation (``fused_moe``).

``fused_moe`` is the op a fused Triton grouped GEMM replaces (same signature). The torch reference sorts the
T * top_k (token, expert) pairs by expert, runs one gate/up and one down matmul per *active* expert over its
contiguous slice of rows, and scatters the weighted results back with ``index_add_``: no loop over tokens.

Weight layout (stacked at load from the checkpoint's per-expert tensors):
``w13 [E, 2I, H]`` = [gate_proj; up_proj] of each expert, ``w2 [E, H, I]`` = down_proj. ``swiglu_limit`` clamps the
pre-activations as DeepSeek-V4 does (gate <= limit, |up| <= limit). ``static``: the torch path reads nothing on the
host (``fused_moe_gathered_ref``: each pair's expert weights gathered; for decode steps and CUDA graphs). Shared
experts may be
stacked after the routed ones (``layers.moe.FusedExperts``): ``select_experts(..., num_shared=S)`` then appends
their ids with weight 1.0 to every token's routed choice, so one grouped GEMM pair runs both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsinfer import batch_invariant
from dsinfer.ops._common import Routing, block_dequantize, expert_outputs_by_expert, swiglu
from dsinfer.ops.dispatch import use_triton


def _group_mask(scores: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """[T, E] bool: experts in the ``topk_group`` best groups of each token (a group scored by its max
    or by the sum of its top two experts)."""
    t, e = scores.shape
    grouped = scores.view(t, n_group, e // n_group)
    if group_score == "max":
        per_group = grouped.max(dim=-1).values
    else:
        per_group = grouped.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)
    chosen = per_group.topk(topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    routing: Routing = Routing(),
    e_score_correction_bias: torch.Tensor | None = None,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (float32) -> (topk_weights [T, k + S] float32, topk_ids [T, k + S] int64).

    - ``greedy``: top-k of the scores (DeepSeek-V2-Lite).
    - ``group_limited_greedy``: top-k within the ``topk_group`` groups of highest max score (DeepSeek-V2).
    - ``noaux_tc``: the choice uses scores + ``e_score_correction_bias`` within the ``topk_group`` groups of
      highest top-2 sum; the weights are the unbiased scores of the chosen experts (DeepSeek-V3).
    Weights are renormalized to sum 1 when ``norm_topk_prob`` (top_k 1 included, as HF's V3 and vLLM), then
    multiplied by
    ``routed_scaling_factor``. ``num_shared`` (S) shared experts stacked after the E routed ones: columns k..k+S-1
    hold ids E..E+S-1 with weight exactly 1.0 (neither renormalized nor scaled), after the routed choice.

    On the Triton path (CUDA) one kernel does all of it (``ops.triton.router``), except in deterministic mode,
    which keeps this torch path (expert-id order, sequential sums).
    """
    if use_triton(router_logits) and not batch_invariant.is_enabled():
        from dsinfer.ops.triton import router

        if router.supports(router_logits.shape[-1], top_k, routing.n_group, num_shared):
            return router.select_experts_triton(router_logits, top_k, routing, e_score_correction_bias, num_shared)
    return select_experts_ref(router_logits, top_k, routing, e_score_correction_bias, num_shared)


def route_hidden(
    hidden: torch.Tensor,
    weight_16bit: torch.Tensor,
    top_k: int,
    routing: Routing = Routing(),
    e_score_correction_bias: torch.Tensor | None = None,
    num_shared: int = 0,
    *,
    gemv: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts`` of the gate logits ``hidden @ weight_16bit.T``, accumulated in float32 (16-bit products
    are exact in it, so this is the float32 product up to summation order). On the Triton path, with ``gemv``
    (``KernelConfig.router_gemv``), a batch of up to ``GEMV_MAX_TOKENS`` rows takes a split-K GEMV whose partials
    the routing kernel sums; otherwise one GEMM writes float32 logits."""
    if gemv and use_triton(hidden) and not batch_invariant.is_enabled():
        from dsinfer.ops.triton import router

        if router.gemv_supports(hidden, weight_16bit) and router.supports(
                weight_16bit.shape[0], top_k, routing.n_group, num_shared):
            return router.route_hidden_triton(hidden, weight_16bit, top_k, routing, e_score_correction_bias,
                                              num_shared)
    if hidden.is_cuda:
        logits = torch.mm(hidden, weight_16bit.t(), out_dtype=torch.float32)
    else:  # torch has no CPU kernel of a 16-bit GEMM with a float32 output
        logits = hidden.float() @ weight_16bit.float().t()
    return select_experts(logits, top_k, routing, e_score_correction_bias, num_shared)


def select_experts_ref(
    router_logits: torch.Tensor,
    top_k: int,
    routing: Routing = Routing(),
    e_score_correction_bias: torch.Tensor | None = None,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts`` in torch ops (the reference, the CPU path and the deterministic mode's path)."""
    r, n_group, topk_group = routing, routing.n_group, routing.topk_group
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if r.scoring_func == "softmax" else logits.sigmoid()
    if r.topk_method == "noaux_tc":
        choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
        if n_group > 1:
            choice = choice.masked_fill(~_group_mask(choice, n_group, topk_group, "top2"), float("-inf"))
        topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
        topk_weights = scores.gather(1, topk_ids)
    else:
        if r.topk_method == "group_limited_greedy" and n_group > 1:
            scores = scores.masked_fill(~_group_mask(scores, n_group, topk_group, "max"), 0.0)
        topk_weights, topk_ids = scores.topk(top_k, dim=-1, sorted=False)
    if batch_invariant.is_enabled():  # deterministic mode: expert-id order, sequential sums
        from dsinfer.batch_invariant.moe import ordered_sum, sort_topk

        topk_weights, topk_ids = sort_topk(topk_weights, topk_ids)
        if r.norm_topk_prob:
            topk_weights = topk_weights / (ordered_sum(topk_weights) + 1e-20)
        # the shared ids E.. come after every routed id: the columns stay in expert-id order
        return with_shared(topk_weights * r.routed_scaling_factor, topk_ids, logits.shape[1], num_shared)
    if r.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return with_shared(topk_weights * r.routed_scaling_factor, topk_ids, logits.shape[1], num_shared)


def with_shared(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_routed: int, num_shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] routed choice -> [T, k + S]: the S shared experts (ids num_routed.., weight 1.0) appended."""
    if not num_shared:
        return topk_weights, topk_ids
    num_tokens = topk_ids.shape[0]
    ids = torch.arange(num_routed, num_routed + num_shared, dtype=topk_ids.dtype, device=topk_ids.device)
    return (torch.cat((topk_weights, topk_weights.new_ones(num_tokens, num_shared)), dim=1),
            torch.cat((topk_ids, ids.expand(num_tokens, num_shared)), dim=1))


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [T, k] -> sum_k w_k expert_k(x) [T, H].

    SiLU-gated experts (clamped with ``swiglu_limit``). Pairs are sorted by expert once; each active expert does
    two matmuls over its rows (one host sync: the slice bounds).
    """
    order, out_rows = expert_outputs_by_expert(hidden, w13, w2, topk_ids, swiglu_limit=swiglu_limit)
    token_of = order // topk_ids.shape[1]  # the token each sorted pair belongs to
    weighted = out_rows.float() * topk_weights.reshape(-1)[order].float().unsqueeze(-1)
    return torch.zeros_like(hidden).index_add_(0, token_of, weighted.to(hidden.dtype))


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    addend: Callable[[], torch.Tensor] | None = None,
    swiglu_limit: float | None = None,
    static: bool = False,
) -> torch.Tensor:
    """See ``fused_moe_ref``; ``static``: see the module doc (the Triton path never reads the host). FP8
    experts (e4m3 ``w13``/``w2``) come with their block scales (``[E, rows / bn, cols / bk]``) and ``block_size``;
    the Triton path multiplies them as FP8 (w8a8, activations quantized per token and group of bk), the torch
    path dequantizes first.

    ``addend``: called once, after the expert GEMMs are issued and before their sum, for a [T, H] tensor added to
    the result (the shared experts, computed on a side stream meanwhile: ``runner.side_stream``). The Triton
    path adds it inside the top-k sum (float32, last, one rounding)."""
    if batch_invariant.is_enabled():  # deterministic mode: fixed tiles, top-k pairs summed in a fixed order
        from dsinfer.batch_invariant.moe import fused_moe_invariant

        out = fused_moe_invariant(hidden, w13, w2, topk_weights, topk_ids, w13_scale_inv=w13_scale_inv,
                                  w2_scale_inv=w2_scale_inv, block_size=block_size, use_triton=use_triton(hidden),
                                  swiglu_limit=swiglu_limit)
        return out if addend is None else out + addend()
    if use_triton(hidden):
        from dsinfer.ops.triton.moe_fused import fused_moe_triton

        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, w13_scale_inv=w13_scale_inv,
                                w2_scale_inv=w2_scale_inv, block_size=block_size, addend=addend,
                                swiglu_limit=swiglu_limit)
    if w13.dtype == torch.float8_e4m3fn:
        w13 = block_dequantize(w13, w13_scale_inv, block_size, hidden.dtype)
        w2 = block_dequantize(w2, w2_scale_inv, block_size, hidden.dtype)
    moe = fused_moe_gathered_ref if static else fused_moe_ref
    out = moe(hidden, w13, w2, topk_weights, topk_ids, swiglu_limit)
    return out if addend is None else out + addend()


def fused_moe_gathered_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """``fused_moe_ref`` with no host read and shapes that depend only on [T, k]: each (token, expert) pair
    multiplies its own gathered expert weights (one batched matrix-vector product per pair, so a pair's result
    does not depend on the other pairs), and a token's k outputs are summed in float32 in column order. It reads
    T * k experts' weights: the path for decode-sized batches (``static``), not for prefill."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    x = hidden.repeat_interleave(top_k, dim=0).unsqueeze(1)  # [P, 1, H]
    gate, up = torch.bmm(x, w13[flat].transpose(1, 2)).chunk(2, dim=-1)  # [P, 1, I] each
    down = torch.bmm(swiglu(gate, up, swiglu_limit), w2[flat].transpose(1, 2)).squeeze(1)  # [P, H]
    weighted = down.float().view(num_tokens, top_k, -1) * topk_weights.float().unsqueeze(-1)
    total = weighted[:, 0]
    for j in range(1, top_k):
        total = total + weighted[:, j]
    return total.to(hidden.dtype)
