"""Shared experts on a side stream beside the router and the routed experts (``KernelConfig.side_stream``,
``layers.streams``), taken in CUDA graphs and their warm-up forwards only: the same output as one stream,
eagerly and replayed from a graph, with the shared experts stacked as slots (``FusedExperts.shared``) or as their
own MLP (``KernelConfig.fuse_shared_experts=False``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsinfer.config import KernelConfig
from dsinfer.layers.streams import SideStream, in_graphs
from dsinfer.models.deepseek import blocks
from dsinfer.runner.warmup import dummy_prefill_batch
from tests.models.test_deepseek_shared_experts import load_moe, moe_tensors, tiny_config, unfused_reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _moe(stacked: bool, monkeypatch, device: str = "cuda"):
    """V2's tiny MoE layer whose shared experts run apart from the grouped GEMM at every batch size, with the
    side-stream forks counted (``calls``)."""
    monkeypatch.setattr(blocks, "FUSED_SHARED_MAX_TOKENS", 0)
    monkeypatch.setattr(blocks, "FUSED_SHARED_MAX_TOKENS_BESIDE", 0)
    cfg = tiny_config("v2", 2)
    tensors = moe_tensors(cfg)
    _, moe = load_moe(cfg, tensors, KernelConfig(fuse_shared_experts=stacked))
    assert (moe.shared_experts is None) == stacked and moe.side_stream is not None
    calls, fork = [], moe.side_stream.run_beside
    monkeypatch.setattr(moe.side_stream, "run_beside", lambda *a: calls.append(1) or fork(*a))
    return cfg, tensors, moe.to(device), calls


def test_graphed_batches_mark_the_forward_and_cpu_never_forks(monkeypatch):
    batch = dummy_prefill_batch(4, 4, 16, torch.device("cpu"))
    assert not in_graphs(batch)
    assert in_graphs(dataclasses.replace(batch, graphed=True))  # a capture or its warm-up
    assert not in_graphs(batch)
    cfg, tensors, moe, calls = _moe(True, monkeypatch, "cpu")
    x = torch.randn(5, cfg["hidden_size"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = moe(x, graphed=True)
    assert calls == []
    torch.testing.assert_close(out, unfused_reference(cfg, tensors, moe.gate.cfg.routing, x), rtol=1e-5, atol=1e-5)


def test_the_side_stream_is_the_models_and_off_with_the_option():
    from dsinfer.models.deepseek import DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM(tiny_config("v2", 2))
    streams = {id(m.side_stream) for m in model.modules() if hasattr(m, "side_stream") and m is not model}
    assert streams == {id(model.side_stream)} and isinstance(model.side_stream, SideStream)
    off = DeepseekV2ForCausalLM(tiny_config("v2", 2), KernelConfig(side_stream=False))
    assert all(m.side_stream is None for m in off.modules() if hasattr(m, "side_stream"))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("tokens", [1, 100])
def test_side_stream_matches_one_stream_and_the_reference(stacked, tokens, monkeypatch):
    cfg, tensors, moe, calls = _moe(stacked, monkeypatch)
    x = torch.randn(tokens, cfg["hidden_size"], generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        one_stream = moe(x)
        assert calls == []  # eager: no fork
        beside = moe(x, graphed=True)  # the warm-up of a capture
        assert calls == [1]
        ref = unfused_reference(cfg, tensors, moe.gate.cfg.routing, x.cpu())
    torch.testing.assert_close(beside, one_stream, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(beside.cpu(), ref, rtol=2e-3, atol=2e-3)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("stacked", [True, False])
def test_side_stream_in_a_cuda_graph(stacked, monkeypatch):
    """The fork and join are captured: replays on fresh inputs give the eager (one-stream) outputs."""
    cfg, _, moe, calls = _moe(stacked, monkeypatch)
    gen = torch.Generator().manual_seed(3)
    static_x = torch.zeros(64, cfg["hidden_size"], device="cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()  # warm-up off the default stream, as graph capture wants
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(static_x, graphed=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = moe(static_x, graphed=True)
        assert calls == [1, 1]
        for _ in range(3):
            x = torch.randn(64, cfg["hidden_size"], generator=gen).cuda()
            static_x.copy_(x)
            graph.replay()
            torch.testing.assert_close(static_out, moe(x), rtol=1e-5, atol=1e-5)
