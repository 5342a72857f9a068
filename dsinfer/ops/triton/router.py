"""The MoE router in one Triton kernel: ``ops.moe.select_experts`` (its torch version is the reference).

One program per token row: scores (softmax or sigmoid of the float32 logits), the choice scores (+
``e_score_correction_bias`` for noaux_tc), the group limit (groups scored by their max or by the sum of their
top two, the ``topk_group`` best kept), the top-k by repeated argmax, the weights from the unbiased scores,
renormalization and ``routed_scaling_factor``, then the ``NUM_SHARED`` shared-expert columns (ids E.., weight 1.0)
of a row [T, TOP_K + NUM_SHARED]. Groups need not be a power of two wide (DeepSeek-V2: 160 experts
in 8 groups of 20): an expert's group is ``e // group_size``, and the group reductions run over a
[groups, experts] tile.

Ties (measure zero for real logits): the lowest expert / group index wins; ``torch.topk`` leaves tie order
unspecified. The chosen experts come out in descending choice score (``topk(sorted=False)`` has no order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops._common import Routing
from dsinfer.ops.triton.pdl import MOE, enter, launch_args

# MAX_TOP_K bounds a row's columns, routed + shared (V3: 8 + 1; V2 / V2-Lite: 6 + 2)
MAX_EXPERTS, MAX_TOP_K, MAX_GROUPS = 256, 16, 32


@triton.jit
def _router_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, group_size, stride_l, scaling,
    E_PAD: tl.constexpr, G_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, NUM_SHARED: tl.constexpr, S_PAD: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NOAUX: tl.constexpr, NORM: tl.constexpr,
    NUM_PARTS: tl.constexpr = 1, PART_CHUNK: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    """NOAUX: groups scored by their top-2 sum and dropped groups' experts at -inf, else by their max and at 0.0
    (group_limited_greedy, as the reference's masked scores). Output rows are TOP_K + NUM_SHARED wide; the shared
    columns have their own store, so the routed weights' sums keep their width (bit-identical to NUM_SHARED=0)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    valid = e < num_experts
    if NUM_PARTS == 1:
        x = tl.load(logits_ptr + row * stride_l + e, mask=valid, other=-float("inf")).to(tl.float32)
    else:  # the split-K GEMV's partial logits [NUM_PARTS, E_PAD] of this row (``_router_gemv_kernel``), summed
        x = tl.zeros([E_PAD], tl.float32)
        for p0 in tl.static_range(0, NUM_PARTS, PART_CHUNK):  # unrolled: every chunk's load issued up front
            part = p0 + tl.arange(0, PART_CHUNK)
            tile = tl.load(logits_ptr + (row * NUM_PARTS + part[:, None]) * E_PAD + e[None, :],
                           mask=part[:, None] < NUM_PARTS, other=0.0)
            x += tl.sum(tile, axis=0)
        x = tl.where(valid, x, -float("inf"))
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, -float("inf"))
    if N_GROUP > 1:
        g = tl.arange(0, G_PAD)
        member = (e // group_size)[None, :] == g[:, None]  # [G_PAD, E_PAD]; padded experts: no real group
        vals = tl.where(member, choice[None, :], -float("inf"))
        best = tl.max(vals, axis=1)
        if NOAUX:
            first = tl.min(tl.where(vals == best[:, None], e[None, :], E_PAD), axis=1)
            second = tl.max(tl.where(e[None, :] == first[:, None], -float("inf"), vals), axis=1)
            best = best + tl.where(second > -float("inf"), second, 0.0)  # groups of one: their max
        group_score = tl.where(g < N_GROUP, best, -float("inf"))
        kept = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(tl.where(kept, -float("inf"), group_score), axis=0)
            pick = tl.min(tl.where(~kept & (group_score == top), g, G_PAD), axis=0)
            kept = kept | (g == pick)
        keep = tl.max((member & kept[:, None]).to(tl.int32), axis=0) > 0
        choice = tl.where(valid & ~keep, -float("inf") if NOAUX else 0.0, choice)
    kk = tl.arange(0, K_PAD)
    out_w = tl.zeros([K_PAD], tl.float32)
    out_i = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        top = tl.max(choice, axis=0)
        idx = tl.minimum(tl.min(tl.where(choice == top, e, E_PAD), axis=0), num_experts - 1)  # NaN: stay in range
        hit = e == idx
        out_w = tl.where(kk == j, tl.sum(tl.where(hit, scores, 0.0), axis=0), out_w)
        out_i = tl.where(kk == j, idx, out_i)
        choice = tl.where(hit, -float("inf"), choice)
    if NORM:
        out_w = out_w / (tl.sum(out_w, axis=0) + 1e-20)
    out_w = out_w * scaling
    width = TOP_K + NUM_SHARED
    tl.store(weights_ptr + row * width + kk, out_w, mask=kk < TOP_K)
    tl.store(ids_ptr + row * width + kk, out_i.to(tl.int64), mask=kk < TOP_K)
    if NUM_SHARED > 0:
        s = tl.arange(0, S_PAD)
        tl.store(weights_ptr + row * width + TOP_K + s, tl.full([S_PAD], 1.0, tl.float32), mask=s < NUM_SHARED)
        tl.store(ids_ptr + row * width + TOP_K + s, (num_experts + s).to(tl.int64), mask=s < NUM_SHARED)


def supports(num_experts: int, top_k: int, n_group: int, num_shared: int = 0) -> bool:
    """Whether the kernel covers these router sizes (else the torch reference runs)."""
    return num_experts <= MAX_EXPERTS and top_k + num_shared <= MAX_TOP_K and n_group <= MAX_GROUPS


def select_experts_triton(
    router_logits: torch.Tensor,
    top_k: int,
    routing: Routing = Routing(),
    e_score_correction_bias: torch.Tensor | None = None,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``ops.moe.select_experts``: (topk_weights [T, k + S] float32, topk_ids [T, k + S] int64),
    the S = ``num_shared`` shared-expert columns written by the same kernel."""
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    return _route(logits, logits.shape[0], logits.shape[1], 1, top_k, routing, e_score_correction_bias,
                  num_shared)


def _route(logits: torch.Tensor, num_tokens: int, num_experts: int, num_parts: int, top_k: int, routing: Routing,
           e_score_correction_bias: torch.Tensor | None, num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing kernel over ``logits`` [T, E] (``num_parts`` 1) or the GEMV's partials [T, num_parts, E_PAD]."""
    n_group, topk_group, topk_method = routing.n_group, routing.topk_group, routing.topk_method
    weights = torch.empty(num_tokens, top_k + num_shared, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k + num_shared, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    grouped = topk_method in ("group_limited_greedy", "noaux_tc") and n_group > 1
    noaux = topk_method == "noaux_tc"
    has_bias = noaux and e_score_correction_bias is not None
    e_pad = _experts_pad(num_experts)
    _router_kernel[(num_tokens,)](
        logits, e_score_correction_bias if has_bias else logits, weights, ids, num_experts,
        num_experts // n_group if grouped else num_experts, logits.stride(0), float(routing.routed_scaling_factor),
        E_PAD=e_pad, G_PAD=max(2, triton.next_power_of_2(n_group)) if grouped else 2,
        N_GROUP=n_group if grouped else 1, TOPK_GROUP=topk_group if grouped else 1, TOP_K=top_k,
        K_PAD=max(2, triton.next_power_of_2(top_k)), NUM_SHARED=num_shared,
        S_PAD=max(2, triton.next_power_of_2(num_shared)), SIGMOID=routing.scoring_func == "sigmoid",
        HAS_BIAS=has_bias, NOAUX=noaux, NORM=routing.norm_topk_prob,
        NUM_PARTS=num_parts, PART_CHUNK=min(8, max(2, triton.next_power_of_2(num_parts))),
        num_warps=4 if e_pad >= 128 else 2, **launch_args(logits.device, MOE),
    )
    return weights, ids


def _experts_pad(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))


# ---- the gate GEMV of small batches ----------------------------------------------------------------------------

# cuBLAS multiplies a decode step's few rows by the gate (V2-Lite: 64 x 2048 bf16, 256 KB) with one 64 x 8 tile,
# so one thread block (going by its kernel's name): 5 us a layer on an H200, 5% of V2-Lite's batch-1 step. Split
# over the hidden dimension, a program per 128 columns (and 16 rows) reads 16 KB. Past GEMV_MAX_TOKENS rows cuBLAS
# has thread blocks enough.
GEMV_MAX_TOKENS, _GEMV_BLOCK_T, _GEMV_BLOCK_K = 64, 16, 128


@triton.jit
def _router_gemv_kernel(x_ptr, w_ptr, part_ptr, num_tokens, num_experts, hidden, stride_x, stride_w,
                        NUM_PARTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    """part[t, s, e] = sum over the columns k of split s of x[t, k] * w[e, k], in float32 (16-bit products are
    exact in it); program (i, s): rows i * BLOCK_T.., split s."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    e = tl.arange(0, E_PAD)
    # the gate's weight before the wait (``pdl``: no kernel writes it), off the critical path
    w = tl.load(w_ptr + e[:, None] * stride_w + k[None, :], mask=(e[:, None] < num_experts) & (k[None, :] < hidden),
                other=0.0)
    enter(PDL)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                mask=(rows[:, None] < num_tokens) & (k[None, :] < hidden), other=0.0)
    if UPCAST:  # Triton's CPU interpreter multiplies bf16 tiles wrongly
        x, w = x.to(tl.float32), w.to(tl.float32)
    acc = tl.dot(x, tl.trans(w))  # [BLOCK_T, E_PAD]
    tl.store(part_ptr + (rows[:, None].to(tl.int64) * NUM_PARTS + split) * E_PAD + e[None, :], acc,
             mask=rows[:, None] < num_tokens)


def gemv_supports(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the GEMV takes this batch: a few 16-bit rows times a gate of their dtype (``supports`` decides
    whether the routing kernel covers the gate)."""
    return (hidden.dim() == 2 and hidden.shape[0] <= GEMV_MAX_TOKENS and hidden.dtype == weight.dtype
            and hidden.dtype in (torch.bfloat16, torch.float16))


def route_hidden_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    routing: Routing = Routing(),
    e_score_correction_bias: torch.Tensor | None = None,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts`` of the gate logits ``hidden @ weight.T`` [T, E] (float32), for a batch
    ``gemv_supports`` takes: the split-K GEMV writes [T, splits, E] partial logits, which the routing kernel
    sums (in split order) before it scores and picks. Two launches, as cuBLAS's GEMV and the routing kernel."""
    num_tokens, hidden_size = hidden.shape
    num_experts = weight.shape[0]
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    e_pad = _experts_pad(num_experts)
    num_parts = triton.cdiv(hidden_size, _GEMV_BLOCK_K)
    parts = torch.empty(num_tokens, num_parts, e_pad, dtype=torch.float32, device=hidden.device)
    if num_tokens:
        _router_gemv_kernel[(triton.cdiv(num_tokens, _GEMV_BLOCK_T), num_parts)](
            x, w, parts, num_tokens, num_experts, hidden_size, x.stride(0), w.stride(0),
            NUM_PARTS=num_parts, E_PAD=e_pad, BLOCK_T=_GEMV_BLOCK_T, BLOCK_K=_GEMV_BLOCK_K,
            UPCAST=not hidden.is_cuda, num_warps=4 if e_pad <= 64 else 8, **launch_args(x.device, MOE),
        )
    return _route(parts, num_tokens, num_experts, num_parts, top_k, routing, e_score_correction_bias, num_shared)
