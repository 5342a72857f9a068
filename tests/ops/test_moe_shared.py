"""The router's shared-expert columns (``select_experts(..., num_shared=S)``): the torch reference, its
deterministic mode and the Triton kernel (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from dsinfer import batch_invariant
from dsinfer.ops.moe import Routing, select_experts, select_experts_ref

# (name, experts, top_k, routing): scaled and renormalized weights, so a shared column that took either shows
ROUTERS = [
    ("greedy-scaled", 16, 3, Routing("softmax", "greedy", routed_scaling_factor=1.5)),
    ("v2-groups", 16, 4, Routing("softmax", "group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=True,
                                 routed_scaling_factor=16.0)),
    ("v3-noaux", 16, 3, Routing("sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=2.5)),
    ("k1", 8, 1, Routing("sigmoid", "greedy", norm_topk_prob=True, routed_scaling_factor=2.5)),
]


def _inputs(num_experts: int, routing: Routing, device: str, num_tokens: int = 19):
    gen = torch.Generator().manual_seed(num_experts)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 2).to(device)
    bias = (torch.randn(num_experts, generator=gen) * 0.1).to(device) if routing.topk_method == "noaux_tc" else None
    return logits, bias


def _assert_shared_columns(weights, ids, routed_w, routed_ids, num_experts, num_shared):
    top_k = routed_ids.shape[1]
    assert weights.shape == ids.shape == (routed_ids.shape[0], top_k + num_shared)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids[:, :top_k], routed_ids) and torch.equal(weights[:, :top_k], routed_w)
    want = torch.arange(num_experts, num_experts + num_shared, device=ids.device).expand(ids.shape[0], -1)
    assert torch.equal(ids[:, top_k:], want)
    assert bool((weights[:, top_k:] == 1.0).all())


@pytest.mark.parametrize("num_shared", [1, 2])
@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: r[0])
def test_reference_appends_shared_experts_with_weight_one(router, num_shared):
    _, num_experts, top_k, routing = router
    logits, bias = _inputs(num_experts, routing, "cpu")
    routed = select_experts_ref(logits, top_k, routing, bias)
    _assert_shared_columns(*select_experts_ref(logits, top_k, routing, bias, num_shared), *routed, num_experts,
                           num_shared)


def test_deterministic_mode_keeps_expert_id_order_with_shared_experts():
    _, num_experts, top_k, routing = ROUTERS[2]
    logits, bias = _inputs(num_experts, routing, "cpu")
    with batch_invariant.batch_invariant():
        routed = select_experts(logits, top_k, routing, bias)
        weights, ids = select_experts(logits, top_k, routing, bias, num_shared=2)
    _assert_shared_columns(weights, ids, *routed, num_experts, 2)
    assert bool((ids[:, 1:] > ids[:, :-1]).all())


@pytest.mark.parametrize("num_shared", [1, 2])
@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: r[0])
def test_router_kernel_writes_shared_columns(router, num_shared, device, poisoned):
    from dsinfer.ops.triton.router import select_experts_triton

    _, num_experts, top_k, routing = router
    logits, bias = _inputs(num_experts, routing, device)
    routed = select_experts_triton(logits, top_k, routing, bias)
    weights, ids = select_experts_triton(logits, top_k, routing, bias, num_shared)
    _assert_shared_columns(weights, ids, *routed, num_experts, num_shared)
    # the routed columns are the reference's choice (the kernel orders them by score, the reference does not)
    ref_w, ref_ids = select_experts_ref(logits, top_k, routing, bias)
    order, ref_order = ids[:, :top_k].argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids[:, :top_k].gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights[:, :top_k].gather(1, order), ref_w.gather(1, ref_order))


def test_select_experts_takes_the_kernel_with_shared_columns(device, monkeypatch):
    from dsinfer.ops.triton import router

    calls = []
    kernel = router.select_experts_triton
    monkeypatch.setattr(router, "select_experts_triton", lambda *a, **k: calls.append(a) or kernel(*a, **k))
    _, num_experts, top_k, routing = ROUTERS[2]
    logits, bias = _inputs(num_experts, routing, device)
    weights, ids = select_experts(logits, top_k, routing, bias, num_shared=1)
    assert len(calls) == 1 and ids.shape == (logits.shape[0], top_k + 1) and bool((ids[:, -1] == num_experts).all())
    weights, ids = select_experts(logits[:0], top_k, routing, bias, num_shared=1)
    assert weights.shape == ids.shape == (0, top_k + 1)


def test_kernel_support_counts_the_shared_columns():
    from dsinfer.ops.triton.router import MAX_TOP_K, supports

    assert supports(256, 8, 8, 1) and supports(64, 6, 1, 2)  # V3, V2-Lite
    assert not supports(256, MAX_TOP_K, 8, 1) and supports(256, MAX_TOP_K, 8)
