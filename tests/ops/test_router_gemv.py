"""The gate GEMV of small batches (``ops.triton.router.route_hidden_triton``, behind ``DSINFER_ROUTER_GEMV``): a
split-K Triton GEMV whose partial logits the routing kernel sums, against the float64 logits routed by the
reference."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.moe import Routing, route_hidden, select_experts_ref
from tests.ops.test_moe_triton import ROUTERS, _by_id


def _gate(num_tokens, num_experts, hidden, gen, dtype=torch.bfloat16):
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w = (torch.randn(num_experts, hidden, generator=gen) * 0.2).to(dtype)
    return x, w


def _check(name, num_experts, top_k, kwargs, num_tokens, hidden, device, num_shared=0, seed=0):
    from dsinfer.ops.triton.router import route_hidden_triton

    gen = torch.Generator().manual_seed(seed)
    x, w = _gate(num_tokens, num_experts, hidden, gen)
    routing, bias = Routing(**kwargs), None
    if routing.topk_method == "noaux_tc":
        bias = torch.randn(num_experts, generator=gen) * 0.1
    logits = (x.double() @ w.double().t()).float()  # 16-bit products, summed exactly enough
    ref_w, ref_ids = select_experts_ref(logits, top_k, routing, bias, num_shared)
    out_w, out_ids = route_hidden_triton(x.to(device), w.to(device), top_k, routing,
                                         None if bias is None else bias.to(device), num_shared)
    assert out_w.shape == (num_tokens, top_k + num_shared) and out_ids.dtype == torch.int64, name
    routed = slice(0, top_k)
    (a_w, a_ids), (b_w, b_ids) = _by_id(out_w[:, routed].cpu(), out_ids[:, routed].cpu()), _by_id(
        ref_w[:, routed], ref_ids[:, routed])
    assert torch.equal(a_ids, b_ids), name
    torch.testing.assert_close(a_w, b_w, rtol=1e-4, atol=1e-5)
    assert torch.equal(out_ids[:, top_k:].cpu(), ref_ids[:, top_k:]) and bool((out_w[:, top_k:] == 1).all())


@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: r[0])
@pytest.mark.parametrize("num_tokens", [1, 17])
def test_gemv_routes_as_the_reference_over_exact_logits(router, num_tokens, device):
    # 320 columns: two whole 128-column splits and a masked third
    _check(*router, num_tokens=num_tokens, hidden=320, device=device, seed=num_tokens)


def test_gemv_writes_the_shared_columns(device):
    _check(*ROUTERS[0], num_tokens=5, hidden=256, device=device, num_shared=2)


def test_gemv_of_no_tokens(device):
    from dsinfer.ops.triton.router import route_hidden_triton

    x, w = _gate(0, 8, 128, torch.Generator().manual_seed(0))
    weights, ids = route_hidden_triton(x.to(device), w.to(device), 2, Routing())
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("num_tokens, enabled, deterministic, expect_gemv", [
    (4, True, False, True), (64, True, False, True), (65, True, False, False), (4, False, False, False),
    (4, True, True, False)])
def test_route_hidden_takes_the_gemv_only_where_it_should(num_tokens, enabled, deterministic, expect_gemv,
                                                          device, monkeypatch):  # enabled: KernelConfig.router_gemv
    from dsinfer import batch_invariant
    from dsinfer.ops.triton import router

    calls = []
    kernel = router.route_hidden_triton
    monkeypatch.setattr(router, "route_hidden_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    x, w = _gate(num_tokens, 16, 128, torch.Generator().manual_seed(num_tokens))
    routing = Routing(norm_topk_prob=True)
    ref_w, ref_ids = select_experts_ref((x.double() @ w.double().t()).float(), 2, routing)
    with batch_invariant.batch_invariant(deterministic):
        out_w, out_ids = route_hidden(x.to(device), w.to(device), 2, routing, gemv=enabled)
    assert calls == ([1] if expect_gemv else [])
    (a_w, a_ids), (b_w, b_ids) = _by_id(out_w.cpu(), out_ids.cpu()), _by_id(ref_w, ref_ids)
    assert torch.equal(a_ids, b_ids)
    torch.testing.assert_close(a_w, b_w, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("router", ROUTERS[:3], ids=lambda r: r[0])
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_gemv_at_real_gate_sizes(router, num_tokens):
    hidden = {64: 2048, 160: 5120, 256: 7168}[router[1]]  # V2-Lite, V2, V3
    _check(*router, num_tokens=num_tokens, hidden=hidden, device="cuda", seed=num_tokens)


@pytest.mark.gpu
def test_gemv_in_a_cuda_graph():
    from dsinfer.ops.triton.router import route_hidden_triton

    x, w = _gate(8, 64, 2048, torch.Generator().manual_seed(3))
    x, w = x.cuda(), w.cuda()
    routing = Routing(norm_topk_prob=True)
    eager = route_hidden_triton(x, w, 6, routing)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = route_hidden_triton(x, w, 6, routing)
    x.copy_(torch.randn_like(x))
    graph.replay()
    again = route_hidden_triton(x, w, 6, routing)
    assert not torch.equal(eager[1], again[1])
    assert torch.equal(captured[1], again[1]) and torch.equal(captured[0], again[0])
