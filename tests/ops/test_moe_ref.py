"""MoE torch references: the router against transformers' DeepSeek gates, fused_moe against a token loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsinfer.ops.moe import Routing, fused_moe_ref
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


def test_fused_moe_matches_per_token_loop():
    gen = torch.Generator().manual_seed(2)
    num_tokens, hidden, inter, experts, top_k = 37, 24, 16, 8, 3
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[:, 0] = 5  # one expert many tokens use, some experts none
    weights = torch.rand(num_tokens, top_k, generator=gen)
    out = fused_moe_ref(x, w13, w2, weights, ids)
    ref = torch.zeros_like(x)
    for t in range(num_tokens):
        for j in range(top_k):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            ref[t] += weights[t, j] * (w2[ids[t, j]] @ (F.silu(gate) * up))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
