"""The fused MoE pipeline on ``moe.grouped_gemm`` (see ``moe``'s module doc): align, gate/up with SiLU-mul, down
times the top-k weights, and the top-k sum."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from dsinfer.ops.triton.moe import down_config, grouped_gemm, moe_config
from dsinfer.ops.triton.moe_align import moe_align, pair_blocks
from dsinfer.ops.triton.pdl import MOE, enter, launch_args


def expert_pair_outputs(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    cfg: dict,
    cfg2: dict,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """[T * k, H]: each (token, expert) pair's weighted expert output, in pair order (token-major), by the two
    grouped GEMMs (gate/up with SiLU-mul under ``cfg``, down times the top-k weight under ``cfg2``). The fused
    op sums a token's k rows; the deterministic mode sums them in its own fixed order."""
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8 and (w13_scale_inv is None or w2_scale_inv is None or block_size is None):
        raise ValueError("FP8 experts need w13_scale_inv, w2_scale_inv and block_size")
    if fp8 and inter % block_size[0]:
        raise ValueError(f"FP8 fused MoE needs the intermediate size ({inter}) to be a multiple of "
                         f"the scale block height {block_size[0]} (gate and up share the scale grid)")
    align = _align(topk_ids, num_experts, cfg["block_m"])
    weights = topk_weights.reshape(-1).float()  # the router's float32 [T, k]: a view, no kernel
    if cfg.get("sorted"):
        if cfg2["block_m"] != cfg["block_m"]:
            raise ValueError("sorted MoE tiles need one block_m for gate/up and down (see down_config)")
        return _sorted_pair_outputs(hidden, w13, w2, weights, align, top_k, cfg, cfg2, w13_scale_inv,
                                    w2_scale_inv, block_size if fp8 else None, swiglu_limit)
    align2 = align if cfg2["block_m"] == cfg["block_m"] else _align(topk_ids, num_experts, cfg2["block_m"])
    inter_out = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    down = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if fp8:
        from dsinfer.ops.triton.fp8 import per_token_group_quant

        a, a_s = per_token_group_quant(hidden, block_size[1])
        grouped_gemm(a, w13, inter_out, cfg, a_scale=a_s, b_scale=w13_scale_inv, block_size=block_size,
                     align=align, a_div=top_k, gated=True, swiglu_limit=swiglu_limit)
        a2, a2_s = per_token_group_quant(inter_out, block_size[1])
        grouped_gemm(a2, w2, down, cfg2, a_scale=a2_s, b_scale=w2_scale_inv, block_size=block_size,
                     align=align2, topk_weights=weights)
    else:
        grouped_gemm(hidden, w13, inter_out, cfg, align=align, a_div=top_k, gated=True, swiglu_limit=swiglu_limit)
        grouped_gemm(inter_out, w2, down, cfg2, align=align2, topk_weights=weights)
    return down


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The expert blocks of the grouped GEMMs: for one token a block per pair, with no launch
    (``moe_align.pair_blocks``; 26 launches of a V2-Lite batch-1 step), else ``moe_align``."""
    if topk_ids.shape[0] == 1:
        blocks = pair_blocks(topk_ids, block_m)
        if blocks is not None:
            return blocks
    return moe_align(topk_ids, num_experts, block_m)


def sorted_gate_up(hidden: torch.Tensor, w13: torch.Tensor, cfg: dict, align, top_k: int,
                   w13_scale_inv: torch.Tensor | None = None, block_size: tuple[int, int] | None = None,
                   out: torch.Tensor | None = None, swiglu_limit: float | None = None) -> torch.Tensor:
    """The gate/up GEMM of ``sorted`` tiles: the hidden rows copied (and quantized for FP8) per pair into
    ``align``'s expert order, then ``silu(gate) * up`` per row of that order ([capacity, I], padding rows zero)."""
    from dsinfer.ops.triton.moe_permute import permute_rows

    a, a_s = permute_rows(hidden, align, a_div=top_k, group=block_size[1] if block_size else None)
    if out is None:
        out = torch.empty(align[0].shape[0], w13.shape[1] // 2, dtype=hidden.dtype, device=hidden.device)
    return grouped_gemm(a, w13, out, cfg, a_scale=a_s, b_scale=w13_scale_inv, block_size=block_size, align=align,
                        gated=True, sorted_a=True, sorted_out=True, num_pairs=hidden.shape[0] * top_k,
                        swiglu_limit=swiglu_limit)


def _sorted_pair_outputs(hidden, w13, w2, weights, align, top_k, cfg, cfg2, w13_scale_inv, w2_scale_inv,
                         block_size, swiglu_limit=None) -> torch.Tensor:
    """``expert_pair_outputs`` through activations in expert order (``sorted_gate_up``), the down GEMM reading
    the intermediate in that order and storing in pair order."""
    from dsinfer.ops.triton.moe_permute import permute_rows

    inter_out = sorted_gate_up(hidden, w13, cfg, align, top_k, w13_scale_inv, block_size,
                               swiglu_limit=swiglu_limit)
    down = torch.empty(hidden.shape[0] * top_k, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    group = block_size[1] if block_size else None
    a2, a2_s = permute_rows(inter_out, align, gather=False, group=group) if group else (inter_out, None)
    grouped_gemm(a2, w2, down, cfg2, a_scale=a2_s, b_scale=w2_scale_inv, block_size=block_size, align=align,
                 topk_weights=weights, sorted_a=True)
    return down


@triton.jit
def _topk_sum_kernel(x_ptr, add_ptr, out_ptr, hidden_size, TOP_K: tl.constexpr, HAS_ADD: tl.constexpr,
                     BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = sum_j x[t * TOP_K + j] (+ add[t]) in float32, j in order, the addend last, rounded once."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    valid = offs < hidden_size
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + j) * hidden_size + offs, mask=valid, other=0.0).to(tl.float32)
    if HAS_ADD:
        acc += tl.load(add_ptr + t * hidden_size + offs, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden_size + offs, acc.to(out_ptr.dtype.element_ty), mask=valid)


def topk_sum(pair_rows: torch.Tensor, num_tokens: int, top_k: int, add: torch.Tensor | None = None) -> torch.Tensor:
    """[T * k, H] (token-major) -> [T, H]: each token's k rows summed in float32, plus ``add`` [T, H] when given
    (the shared experts' output: no separate add kernel). One pass at the copy rate (``torch.sum`` over the
    middle dim of [T, k, H] ran at ~30% of it)."""
    hidden_size = pair_rows.shape[1]
    out = pair_rows.new_empty(num_tokens, hidden_size)
    if add is not None and (add.shape != out.shape or not add.is_contiguous()):
        raise ValueError(f"topk_sum: add must be a contiguous {tuple(out.shape)} tensor, got {tuple(add.shape)}")
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    _topk_sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        pair_rows, pair_rows if add is None else add, out, hidden_size, TOP_K=top_k, HAS_ADD=add is not None,
        BLOCK_H=block_h, num_warps=4, **launch_args(pair_rows.device, MOE),
    )
    return out


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    config: dict | None = None,
    addend: Callable[[], torch.Tensor] | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """See ``ops.moe.fused_moe``; FP8 experts (e4m3 ``w13``/``w2``) take their block scales."""
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return hidden.new_zeros(0, hidden_size) + (addend() if addend is not None else 0)
    fp8 = w13.dtype == torch.float8_e4m3fn
    dtype = "fp8" if fp8 else str(w13.dtype).removeprefix("torch.")
    cfg = config or moe_config(f"{num_experts},{inter},{hidden_size},{dtype}", num_pairs / num_experts, fp8,
                               hidden.is_cuda)
    down = expert_pair_outputs(hidden, w13, w2, topk_weights, topk_ids, cfg, down_config(cfg),
                               w13_scale_inv=w13_scale_inv, w2_scale_inv=w2_scale_inv, block_size=block_size,
                               swiglu_limit=swiglu_limit)
    add = addend() if addend is not None else None  # called only now: its producer may run beside the experts
    if top_k == 1:
        return down if add is None else down.add_(add)
    return topk_sum(down, num_tokens, top_k, add)
