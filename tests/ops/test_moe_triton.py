"""Triton fused MoE (GPU alignment, grouped gate/up + down GEMMs, bf16 and FP8 block-scaled) vs the reference."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.fp8 import block_dequantize, block_quantize
from dsinfer.ops.moe import Routing, fused_moe, fused_moe_ref, select_experts, select_experts_ref


def _experts(num_experts, hidden, inter, gen, std=0.1):
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * std
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * std
    return w13, w2


def _route(num_tokens, num_experts, top_k, gen, device):
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(device)
    return select_experts(logits, top_k, Routing(norm_topk_prob=True))


def _quantize_stack(w, block):
    parts = [block_quantize(w_e, block) for w_e in w]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def _qdq(x, group):
    """Per-token-group e4m3 quantize-dequantize, as the kernel's activation path (float64)."""
    g = x.view(x.shape[0], -1, group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0
    return ((g / scale).float().to(torch.float8_e4m3fn).double() * scale).view_as(x)


def _emulated_fp8_moe(x, w13, w2, weights, ids, group):
    """w8a8 MoE in float64 per (token, expert) pair: quantized hidden, bf16 intermediate quantized again."""
    top_k, inter = ids.shape[1], w2.shape[2]
    xq = _qdq(x.double(), group).repeat_interleave(top_k, dim=0)  # [pairs, H]
    flat = ids.reshape(-1)
    gate_up = torch.einsum("ph,pnh->pn", xq, w13[flat])
    h = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).bfloat16().double()
    down = torch.einsum("pi,phi->ph", _qdq(h, group), w2[flat]) * weights.reshape(-1, 1).double()
    return down.view(x.shape[0], top_k, -1).sum(1)


def test_moe_align_sorts_pairs_by_expert_in_padded_blocks(device):
    from dsinfer.ops.triton.moe_align import moe_align

    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=device)
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, 5, 4)
    sentinel = 6
    assert int(num_padded) == 12  # experts 0 (2 pairs), 2 (3), 3 (1): one block of 4 each
    assert sorted_ids[:12].tolist() == [1, 4, sentinel, sentinel, 0, 2, 5, sentinel, 3, sentinel, sentinel,
                                        sentinel]
    assert expert_ids[:3].tolist() == [0, 2, 3]
    assert (sorted_ids[12:] == sentinel).all()


def _align_ids(num_pairs, num_experts, pattern, gen):
    """Expert ids of ``num_pairs`` pairs: uniform, all on the last expert, or on three experts (most empty)."""
    if pattern == "uniform":
        ids = torch.randint(0, num_experts, (num_pairs,), generator=gen)
    elif pattern == "one":
        ids = torch.full((num_pairs,), num_experts - 1)
    else:
        ids = torch.randint(0, 3, (num_pairs,), generator=gen) * (num_experts // 3)
    return ids.view(-1, 2) if num_pairs % 2 == 0 else ids.view(-1, 1)


def _check_align(ids, num_experts, block_m):
    from dsinfer.ops.triton.moe_align import moe_align, moe_align_ref

    out = moe_align(ids, num_experts, block_m)
    ref = moe_align_ref(ids.cpu(), num_experts, block_m)
    for name, a, b in zip(("sorted_ids", "expert_ids", "num_padded"), out, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("num_experts", [8, 64, 256])
@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("num_pairs", [1, 13, 300, 5000])  # 5000: the two-launch path for every E
def test_moe_align_kernel_matches_reference(num_experts, block_m, num_pairs, device):
    """Same sorted_ids (stable by pair index within an expert), expert_ids and num_padded as the torch version,
    with empty experts, all pairs on one expert and pair counts off the block size."""
    gen = torch.Generator().manual_seed(num_pairs + num_experts)
    patterns = ["uniform", "one", "three"] if num_pairs < 5000 else ["uniform", "three"]
    for pattern in patterns:
        _check_align(_align_ids(num_pairs, num_experts, pattern, gen).to(device), num_experts, block_m)


def test_moe_align_kernel_no_pairs_and_int32_ids(device):
    from dsinfer.ops.triton.moe_align import moe_align

    sorted_ids, expert_ids, num_padded = moe_align(torch.zeros(0, 6, dtype=torch.long, device=device), 64, 16)
    assert sorted_ids.numel() == 0 and expert_ids.numel() == 0 and int(num_padded) == 0
    _check_align(torch.tensor([[3, 1], [1, 0], [3, 3]], dtype=torch.int32, device=device), 4, 16)


# (name, experts, top_k, router kwargs): DeepSeek-V2-Lite, V2, V3 and the tiny parity models' routers
ROUTERS = [
    ("v2-lite", 64, 6, dict(scoring_func="softmax", topk_method="greedy")),
    ("v2", 160, 6, dict(scoring_func="softmax", topk_method="group_limited_greedy", n_group=8, topk_group=3,
                        routed_scaling_factor=16.0)),
    ("v3", 256, 8, dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
                        norm_topk_prob=True, routed_scaling_factor=2.5)),
    ("tiny-v2", 8, 3, dict(scoring_func="softmax", topk_method="group_limited_greedy", n_group=4, topk_group=2,
                           norm_topk_prob=True, routed_scaling_factor=1.5)),
    ("tiny-v3", 8, 2, dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=2, topk_group=1,
                           norm_topk_prob=True, routed_scaling_factor=2.5)),
    ("greedy-k1", 16, 1, dict(scoring_func="sigmoid", topk_method="greedy", norm_topk_prob=True)),
    ("noaux-1-group", 8, 3, dict(scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)),
    ("groups-of-one", 8, 2, dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=3,
                                 norm_topk_prob=True)),
]


def _by_id(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _check_router(name, num_experts, top_k, kwargs, num_tokens, device, seed=0):
    from dsinfer.ops.triton.router import select_experts_triton

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    routing, bias = Routing(**kwargs), None
    if routing.topk_method == "noaux_tc":
        bias = (torch.randn(num_experts, generator=gen) * 0.1).to(device)
    w, ids = select_experts_triton(logits.to(device), top_k, routing, bias)
    ref_w, ref_ids = select_experts_ref(logits.to(device), top_k, routing, bias)
    assert w.dtype == torch.float32 and ids.dtype == ref_ids.dtype and w.shape == (num_tokens, top_k), name
    (w, ids), (ref_w, ref_ids) = _by_id(w, ids), _by_id(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids), name
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: r[0])
def test_router_kernel_matches_reference(router, device):
    _check_router(*router, num_tokens=19, device=device)


def test_select_experts_takes_the_kernel_except_in_deterministic_mode(device, monkeypatch):
    from dsinfer import batch_invariant
    from dsinfer.ops.triton import router

    calls = []
    kernel = router.select_experts_triton
    monkeypatch.setattr(router, "select_experts_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(3)).to(device)
    w, ids = select_experts(logits, 2, Routing(norm_topk_prob=True))
    assert calls == [1] and ids.dtype == torch.int64
    with batch_invariant.batch_invariant():
        w2, ids2 = select_experts(logits, 2, Routing(norm_topk_prob=True))
    assert calls == [1] and bool((ids2[:, 1:] > ids2[:, :-1]).all())  # the torch path: expert-id order
    (w, ids), (w2, ids2) = _by_id(w, ids), _by_id(w2, ids2)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2)


# (experts, hidden, intermediate, top_k): odd sizes, and the tiny DeepSeek parity models' V2 / V3 experts
MOE_SHAPES = [(8, 32, 24, 3), (8, 64, 32, 3), (8, 64, 32, 2)]


@pytest.mark.parametrize("shape", MOE_SHAPES, ids=lambda s: "e{}-h{}-i{}-k{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_fused_moe_matches_reference(dtype, num_tokens, shape, device, poisoned, assert_close):
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, hidden, inter, top_k = shape
    w13, w2 = _experts(num_experts, hidden, inter, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _route(num_tokens, num_experts, top_k, gen, device)
    to = dict(dtype=dtype, device=device)
    out = fused_moe(x.to(**to), w13.to(**to), w2.to(**to), weights, ids)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double().cpu(), ids.cpu())
    assert_close(out, ref, dtype)


def test_fused_moe_fp8_block_scaled_matches_dequantized_reference(device, poisoned, assert_close):
    gen = torch.Generator().manual_seed(5)
    num_experts, hidden, inter, top_k, block = 4, 64, 32, 2, (16, 32)
    w13, w2 = _experts(num_experts, hidden, inter, gen)
    w13_q, w13_s = _quantize_stack(w13, block)
    w2_q, w2_s = _quantize_stack(w2, block)
    x = torch.randn(9, hidden, generator=gen)
    weights, ids = _route(9, num_experts, top_k, gen, device)
    out = fused_moe(x.bfloat16().to(device), w13_q.to(device), w2_q.to(device), weights, ids,
                    w13_scale_inv=w13_s.to(device), w2_scale_inv=w2_s.to(device), block_size=block)
    w13_d = block_dequantize(w13_q, w13_s, block, torch.float64)
    w2_d = block_dequantize(w2_q, w2_s, block, torch.float64)
    xb = x.bfloat16()
    emulated = _emulated_fp8_moe(xb, w13_d, w2_d, weights.cpu(), ids.cpu(), block[1])
    assert_close(out, emulated, torch.bfloat16, tol=3e-2)  # bf16 intermediate: a few e4m3 rounding flips
    ref = fused_moe_ref(xb.double(), w13_d, w2_d, weights.double().cpu(), ids.cpu())
    assert_close(out, ref, torch.bfloat16, tol=0.15)  # activations quantized to e4m3 per token group


# ---- GPU, real shapes ----

@pytest.mark.gpu
@pytest.mark.parametrize("num_experts, top_k", [(64, 6), (160, 6), (256, 8)])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 341, 2048, 8192])
def test_moe_align_kernel_real_sizes(num_experts, top_k, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    for block_m in (16, 32, 64, 128):
        for pattern in ("uniform", "three"):
            ids = _align_ids(num_tokens * top_k, num_experts, pattern, gen).view(num_tokens, top_k)
            _check_align(ids.cuda(), num_experts, block_m)


@pytest.mark.gpu
def test_moe_align_kernel_cuda_graph():
    from dsinfer.ops.triton.moe_align import moe_align, moe_align_ref

    ids = torch.randint(0, 256, (16, 8), device="cuda")
    moe_align(ids, 256, 16)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_align(ids, 256, 16)
    for _ in range(3):
        ids.copy_(torch.randint(0, 256, (16, 8), device="cuda"))
        graph.replay()
        for a, b in zip(out, moe_align_ref(ids, 256, 16)):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_pair_blocks_fall_back_to_the_align_kernel_inside_a_first_capture():
    """A capture that meets a block size whose constants were never made takes ``moe_align`` (no allocation
    from the graph's pool kept in a module cache); after an eager call the graph needs no alignment kernel."""
    from dsinfer.ops.triton.moe_align import moe_align, moe_align_ref
    from dsinfer.ops.triton.moe_fused import _align

    ids = torch.tensor([[3, 1, 9, 4, 11]], device="cuda")  # 5 pairs in blocks of 64: no other test's constants
    moe_align(ids, 16, 64)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _align(ids, 16, 64)
    graph.replay()
    for a, b in zip(captured, moe_align_ref(ids, 16, 64)):
        assert torch.equal(a, b)
    eager = _align(ids, 16, 64)
    assert eager[1].dtype == torch.int64 and eager[1].data_ptr() == ids.data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("router", ROUTERS[:3], ids=lambda r: r[0])
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
def test_router_kernel_real_sizes(router, num_tokens):
    _check_router(*router, num_tokens=num_tokens, device="cuda", seed=num_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [4, 300])
def test_fused_moe_bf16_v2_lite_shapes(num_tokens, assert_close):
    gen = torch.Generator().manual_seed(0)
    w13, w2 = _experts(64, 2048, 1408, gen, std=0.02)
    x = torch.randn(num_tokens, 2048, generator=gen)
    weights, ids = _route(num_tokens, 64, 6, gen, "cuda")
    out = fused_moe(x.bfloat16().cuda(), w13.bfloat16().cuda(), w2.bfloat16().cuda(), weights, ids)
    ref = fused_moe_ref(x.cuda(), w13.cuda(), w2.cuda(), weights, ids)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 3, 8])
def test_fused_moe_v2_lite_stack_decode_tiles(num_tokens, assert_close):
    """V2-Lite's expert stack as the model runs it (64 routed + 2 shared, 6 + 2 per token): decode batches take
    configs/moe.json's tiles for that key (TMA weight tiles at 1-3 tokens)."""
    from dsinfer.ops.moe import with_shared
    from dsinfer.ops.triton.moe import moe_config

    gen = torch.Generator().manual_seed(2)
    w13, w2 = _experts(66, 2048, 1408, gen, std=0.02)
    x = torch.randn(num_tokens, 2048, generator=gen)
    weights, ids = with_shared(*_route(num_tokens, 64, 6, gen, "cuda"), 64, 2)
    if num_tokens < 4:
        assert moe_config("66,1408,2048,bfloat16", num_tokens * 8 / 66, False, True).get("tma")
    out = fused_moe(x.bfloat16().cuda(), w13.bfloat16().cuda(), w2.bfloat16().cuda(), weights, ids)
    ref = fused_moe_ref(x.cuda(), w13.cuda(), w2.cuda(), weights, ids)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 256])
def test_fused_moe_bf16_v4_flash_expert_shapes_with_swiglu_limit(num_tokens, assert_close):
    """V4-Flash's experts (hidden 4096, intermediate 2048, top-6; 32 of its 256) with the clamped SwiGLU at a limit
    that clips (1.0 against pre-activations of std ~1.3), the decode and graph-batch sizes."""
    gen = torch.Generator("cuda").manual_seed(4)
    w13 = torch.randn(32, 2 * 2048, 4096, generator=gen, device="cuda") * 0.02
    w2 = torch.randn(32, 4096, 2048, generator=gen, device="cuda") * 0.02
    x = torch.randn(num_tokens, 4096, generator=gen, device="cuda")
    weights, ids = _route(num_tokens, 32, 6, torch.Generator().manual_seed(num_tokens), "cuda")
    out = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids, swiglu_limit=1.0)
    ref = fused_moe_ref(x.bfloat16().float(), w13.bfloat16().float(), w2.bfloat16().float(), weights, ids,
                        swiglu_limit=1.0)
    assert_close(out, ref, torch.bfloat16)
    unclamped = fused_moe_ref(x.bfloat16().float(), w13.bfloat16().float(), w2.bfloat16().float(), weights, ids)
    assert float((unclamped - ref).norm() / ref.norm()) > 0.1  # the clamp matters at these sizes


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [3, 512])
def test_fused_moe_fp8_v3_expert_shapes(num_tokens, assert_close):
    gen = torch.Generator().manual_seed(1)
    num_experts, hidden, inter, block = 16, 7168, 2048, (128, 128)  # V3 expert shapes, fewer experts
    w13, w2 = _experts(num_experts, hidden, inter, gen, std=0.02)
    w13_q, w13_s = _quantize_stack(w13, block)
    w2_q, w2_s = _quantize_stack(w2, block)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _route(num_tokens, num_experts, 8, gen, "cuda")
    out = fused_moe(x.bfloat16().cuda(), w13_q.cuda(), w2_q.cuda(), weights, ids, w13_scale_inv=w13_s.cuda(),
                    w2_scale_inv=w2_s.cuda(), block_size=block)
    ref = fused_moe_ref(x.bfloat16().float().cuda(), block_dequantize(w13_q, w13_s, block).cuda(),
                        block_dequantize(w2_q, w2_s, block).cuda(), weights, ids)
    assert_close(out, ref, torch.bfloat16, tol=0.15)  # two e4m3 activation quantizations (see the CPU test)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fuse_gu", "tma", "sorted"])
def test_fused_moe_fp8_v3_tile_modes(mode, assert_close):
    """The tuner's tile modes at V3 expert shapes: gate/up in one dot, weights through TMA descriptors,
    activations in expert order (TMA tiles)."""
    from dsinfer.ops.triton.moe_fused import fused_moe_triton

    gen = torch.Generator().manual_seed(4)
    num_experts, hidden, inter, block = 8, 7168, 2048, (128, 128)
    w13, w2 = _experts(num_experts, hidden, inter, gen, std=0.02)
    w13_q, w13_s = _quantize_stack(w13, block)
    w2_q, w2_s = _quantize_stack(w2, block)
    x = torch.randn(200, hidden, generator=gen)
    weights, ids = _route(200, num_experts, 8, gen, "cuda")
    cfg = dict(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3, **{mode: True},
               down=dict(block_m=128, block_n=128, num_warps=8))
    if mode == "sorted":  # activations in expert order through TMA, both GEMMs
        cfg |= dict(tma=True)
    out = fused_moe_triton(x.bfloat16().cuda(), w13_q.cuda(), w2_q.cuda(), weights, ids,
                           w13_scale_inv=w13_s.cuda(), w2_scale_inv=w2_s.cuda(), block_size=block, config=cfg)
    ref = fused_moe_ref(x.bfloat16().float().cuda(), block_dequantize(w13_q, w13_s, block).cuda(),
                        block_dequantize(w2_q, w2_s, block).cuda(), weights, ids)
    assert_close(out, ref, torch.bfloat16, tol=0.15)


def _check_bf16_and_fp8_stacks(num_tokens, top_k, cfg, seed, device, assert_close):
    """fused_moe_triton under ``cfg`` over a tiny stack (4 experts, hidden 64, inter 48; FP8 scale blocks of
    16 x 16) in bf16, against float64, and in FP8, against the exact w8a8 emulation."""
    from dsinfer.ops.triton.moe_fused import fused_moe_triton

    gen = torch.Generator().manual_seed(seed)
    num_experts, hidden, inter, block = 4, 64, 48, (16, 16)
    w13, w2 = _experts(num_experts, hidden, inter, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    weights, ids = _route(num_tokens, num_experts, top_k, gen, device)
    out = fused_moe_triton(x.to(device), w13.bfloat16().to(device), w2.bfloat16().to(device), weights, ids,
                           config=cfg)
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, hidden)
    ref = fused_moe_ref(x.double(), w13.bfloat16().double(), w2.bfloat16().double(), weights.double().cpu(),
                        ids.cpu())
    assert_close(out, ref, torch.bfloat16)
    w13_q, w13_s = _quantize_stack(w13, block)
    w2_q, w2_s = _quantize_stack(w2, block)
    out = fused_moe_triton(x.to(device), w13_q.to(device), w2_q.to(device), weights, ids,
                           w13_scale_inv=w13_s.to(device), w2_scale_inv=w2_s.to(device), block_size=block,
                           config=cfg)
    w13_d = block_dequantize(w13_q, w13_s, block, torch.float64)
    w2_d = block_dequantize(w2_q, w2_s, block, torch.float64)
    emulated = _emulated_fp8_moe(x, w13_d, w2_d, weights.cpu(), ids.cpu(), block[1])
    assert_close(out, emulated, torch.bfloat16, tol=3e-2)


@pytest.mark.parametrize("fuse_gu, tma, sorted_rows", [(False, False, False), (True, False, False),
                                                      (False, True, False), (True, False, True),
                                                      (False, True, True)])
def test_fused_moe_tile_configs_agree(fuse_gu, tma, sorted_rows, device, poisoned, assert_close):
    """Gate and up in one interleaved dot or two; weights through TMA descriptors (the last N tile reads the
    next expert's rows); the down GEMM with its own tile and alignment (block_m; sorted rows keep gate/up's);
    activations copied into expert order first (sorted), with TMA also for them."""
    # bf16 down: K 48 in steps of 32 (a masked K tail)
    cfg = dict(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1, fuse_gu=fuse_gu,
               tma=tma, sorted=sorted_rows, down=dict(block_m=32, block_n=16))
    _check_bf16_and_fp8_stacks(11, 2, cfg, 7, device, assert_close)


def test_pair_blocks_hold_one_pair_each_and_are_cached(device):
    """One token's alignment without a launch: block j holds pair j under expert ids[j]; the same (expert,
    pair) blocks as ``moe_align_ref`` for distinct experts, in pair order; the constants made once."""
    from dsinfer.ops.triton.moe_align import moe_align_ref, pair_blocks

    ids = torch.tensor([[5, 0, 7, 2]], device=device)
    sorted_ids, expert_ids, num_padded = pair_blocks(ids, 16)
    assert sorted_ids.shape == (64,) and int(num_padded) == 64
    assert sorted_ids.view(4, 16)[:, 0].tolist() == [0, 1, 2, 3]
    assert (sorted_ids.view(4, 16)[:, 1:] == 4).all()  # the sentinel: the pair count
    assert expert_ids.tolist() == [5, 0, 7, 2]
    ref_sorted, ref_experts, ref_padded = moe_align_ref(ids, 8, 16)
    assert int(ref_padded) == int(num_padded) and ref_sorted.shape == sorted_ids.shape
    ref_blocks = {(int(e), int(p)) for e, p in zip(ref_experts, ref_sorted.view(-1, 16)[:, 0])}
    assert ref_blocks == {(int(e), int(p)) for e, p in zip(expert_ids, sorted_ids.view(-1, 16)[:, 0])}
    again = pair_blocks(torch.tensor([[1, 3, 4, 6]], device=device), 16)
    assert again[0] is sorted_ids and again[2] is num_padded and again[1].tolist() == [1, 3, 4, 6]


@pytest.mark.parametrize("cfg", [
    dict(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=1),
    dict(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1, fuse_gu=True,
         down=dict(block_m=32, block_n=16)),
    dict(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=1, sorted=True, tma=True),
], ids=["plain", "down-own-block-m", "sorted-tma"])
def test_fused_moe_one_token_pair_blocks_with_repeated_experts(cfg, device, poisoned, assert_close):
    """One token takes ``pair_blocks``: exact for any ids, an expert named twice (two blocks of it) too."""
    from dsinfer.ops.triton.moe_fused import fused_moe_triton

    gen = torch.Generator().manual_seed(3)
    w13, w2 = _experts(4, 64, 48, gen)
    x = torch.randn(1, 64, generator=gen).bfloat16()
    ids = torch.tensor([[2, 0, 2]], device=device)
    weights = torch.tensor([[0.5, 0.3, 0.2]], device=device)
    out = fused_moe_triton(x.to(device), w13.bfloat16().to(device), w2.bfloat16().to(device), weights, ids,
                           config=cfg)
    ref = fused_moe_ref(x.double(), w13.bfloat16().double(), w2.bfloat16().double(), weights.double().cpu(),
                        ids.cpu())
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("cfg", [
    dict(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=1),
    dict(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=1, fuse_gu=True),
    dict(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=1, sorted=True),
], ids=["two-dots", "fuse-gu", "sorted"])
@pytest.mark.parametrize("num_tokens", [1, 11])
def test_fused_moe_swiglu_limit_matches_clamped_reference(cfg, num_tokens, device, poisoned, assert_close):
    """DeepSeek-V4's clamped SwiGLU in the gated epilogue: weights of unit scale so that a limit of 0.5 clips most
    gates and ups, and the unclamped result is far from the clamped one."""
    from dsinfer.ops.triton.moe_fused import fused_moe_triton

    gen = torch.Generator().manual_seed(num_tokens)
    w13, w2 = _experts(4, 64, 48, gen, std=0.3)
    x = torch.randn(num_tokens, 64, generator=gen)
    weights, ids = _route(num_tokens, 4, 2, gen, device)
    to = dict(device=device)
    out = fused_moe_triton(x.to(**to), w13.to(**to), w2.to(**to), weights, ids, config=cfg, swiglu_limit=0.5)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double().cpu(), ids.cpu(), swiglu_limit=0.5)
    assert_close(out, ref, torch.float32)
    unclamped = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double().cpu(), ids.cpu())
    assert (unclamped - ref).abs().max() > 0.1
    assert_close(fused_moe(x.to(**to), w13.to(**to), w2.to(**to), weights, ids, swiglu_limit=0.5), ref,
                 torch.float32)


def test_split_k_is_refused_over_expert_rows(device):
    """A K split leaves float32 partials: only the dense GEMM sums them (``split_k.sum_partials``); expert rows
    and the gated SiLU(gate) * up need whole sums."""
    from dsinfer.ops.triton.moe import grouped_gemm
    from dsinfer.ops.triton.moe_align import moe_align

    a, b = torch.randn(4, 64, device=device), torch.randn(2, 32, 64, device=device)
    cfg = dict(block_m=16, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1, split_k=2)
    align = moe_align(torch.tensor([[0], [1], [0], [1]], device=device), 2, 16)
    with pytest.raises(ValueError, match="dense GEMMs only"):
        grouped_gemm(a, b, torch.empty(4, 32, device=device), cfg, align=align)
    with pytest.raises(ValueError, match="dense GEMMs only"):
        grouped_gemm(a, b[0], torch.empty(4, 16, device=device), cfg, gated=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_sum_matches_torch_sum(dtype, device):
    from dsinfer.ops.triton.moe_fused import topk_sum

    gen = torch.Generator().manual_seed(3)
    for tokens, top_k, hidden in [(5, 6, 96), (1, 8, 2048), (3, 2, 1500)]:  # 1500: a partial last tile
        rows = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
        out = topk_sum(rows.to(device), tokens, top_k)
        ref = rows.float().view(tokens, top_k, hidden).sum(1).to(dtype)
        assert out.dtype == dtype and out.shape == (tokens, hidden)
        # bf16: one rounding of the float32 sum (the CPU interpreter may round it the other way: one ulp)
        torch.testing.assert_close(out.cpu(), ref, rtol=0 if dtype == torch.float32 else 2**-7, atol=0)


def test_router_16bit_gemm_only_for_exact_cuda_weights():
    """The 16-bit gate GEMM is taken only when the model dtype holds every gate weight exactly and on CUDA; on
    CPU (and for float32 weights off the bf16 grid) the float32 reference path stays."""
    from dsinfer.layers.moe import Router, RouterConfig
    from dsinfer.models.loader.model_loader import _default_dtype_and_device

    with _default_dtype_and_device(torch.bfloat16, torch.device("cpu")):
        router = Router(64, RouterConfig(num_experts=8, top_k=2))
    router.weight.dummy_init(0.02, torch.Generator().manual_seed(0))
    assert torch.equal(router.weight.data.bfloat16().float(), router.weight.data)  # a bf16 checkpoint's values
    router.process_weights_after_loading()
    assert router.weight_16bit is None  # CPU


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [True, False])
def test_router_16bit_gemm_matches_float32_logits(exact):
    from dsinfer.layers.moe import Router, RouterConfig
    from dsinfer.models.loader.model_loader import _default_dtype_and_device

    with _default_dtype_and_device(torch.bfloat16, torch.device("cuda")):
        router = Router(2048, RouterConfig(num_experts=64, top_k=6))
    gen = torch.Generator("cuda").manual_seed(0)
    router.weight.dummy_init(0.02, gen)
    if not exact:
        router.weight.data += 1e-6  # off the bf16 grid: the float32 path must stay
    router.process_weights_after_loading()
    assert (router.weight_16bit is not None) == exact
    hidden = torch.randn(300, 2048, device="cuda", generator=gen).bfloat16()
    weights, ids = router(hidden)
    ref_w, ref_ids = select_experts_ref(hidden.float() @ router.weight.t(), 6)
    assert torch.equal(ids.sort(1).values, ref_ids.sort(1).values)
    torch.testing.assert_close(weights.sort(1).values, ref_w.sort(1).values, rtol=1e-5, atol=1e-6)
