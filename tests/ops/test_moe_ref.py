"""MoE torch references: the router against transformers' DeepSeek gates, fused_moe against a token loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsinfer.ops.moe import Routing, fused_moe, fused_moe_gathered_ref, fused_moe_ref
from dsinfer.ops.moe import select_experts_ref as select_experts  # the Triton router: test_moe_triton.py

transformers = pytest.importorskip("transformers")


def _sorted(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize(
    "method, n_group, topk_group", [("greedy", None, None), ("group_limited_greedy", 4, 2)]
)
def test_softmax_gates_match_deepseek_v2(method, n_group, topk_group):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = transformers.DeepseekV2Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=1.7,
    )
    router = DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(0))
    logits, ref_w, ref_ids = router(x)
    routing = Routing(scoring_func="softmax", topk_method=method, n_group=n_group or 1, topk_group=topk_group or 1,
                      routed_scaling_factor=1.7)
    w, ids = select_experts(logits, 3, routing)
    (w, ids), (ref_w, ref_ids) = _sorted(w, ids), _sorted(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w)


def test_sigmoid_noaux_tc_gate_matches_deepseek_v3():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(1)
    router.weight.data = torch.randn(16, 32, generator=gen) * 0.5
    router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.2)
    x = torch.randn(50, 32, generator=gen)
    logits, ref_w, ref_ids = router(x)
    routing = Routing(scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                      routed_scaling_factor=2.5)
    w, ids = select_experts(logits, 4, routing, router.e_score_correction_bias)
    (w, ids), (ref_w, ref_ids) = _sorted(w, ids), _sorted(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w)
    groups = ids // 4  # every token's experts come from at most topk_group groups
    assert all(len(set(row)) <= 2 for row in groups.tolist())


def _moe_case(num_tokens: int, scale: float = 0.2):
    gen = torch.Generator().manual_seed(2)
    hidden, inter, experts, top_k = 24, 16, 8, 3
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * scale
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[:, 0] = 5  # one expert many tokens use, some experts none
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return x, w13, w2, weights, ids


def _per_token_loop(x, w13, w2, weights, ids, limit=None):
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            ref[t] += weights[t, j] * (w2[ids[t, j]] @ (F.silu(gate) * up))
    return ref


@pytest.mark.parametrize("limit", [None, 0.5], ids=["silu", "clamped"])
@pytest.mark.parametrize("moe", [fused_moe_ref, fused_moe_gathered_ref], ids=["sorted", "gathered"])
def test_fused_moe_matches_per_token_loop(moe, limit):
    """Both torch paths, with DeepSeek-V4's clamped SwiGLU too (pre-activations of std ~1: limit 0.5 clips many
    gates and ups)."""
    case = _moe_case(37, scale=1.0 if limit else 0.2)
    out = moe(*case, swiglu_limit=limit)
    ref = _per_token_loop(*case, limit=limit)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if limit is not None:  # the clamp changed the result
        assert (out - _per_token_loop(*case)).abs().max() > 0.1


def test_static_fused_moe_reads_nothing_on_the_host_and_a_row_ignores_its_batch():
    """``static``: the gathered path, whose rows are bit-identical whatever else is in the batch."""
    from tests.models.host_reads import no_host_reads

    x, w13, w2, weights, ids = _moe_case(9)
    with no_host_reads():
        full = fused_moe(x, w13, w2, weights, ids, swiglu_limit=0.5, static=True)
    alone = fused_moe(x[4:5], w13, w2, weights[4:5], ids[4:5], swiglu_limit=0.5, static=True)
    assert torch.equal(full[4:5], alone)
