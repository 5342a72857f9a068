"""Piecewise prefill graphs: where the forward is cut (CPU, no graphs) and graphs against eager steps (CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.layers.graph_pieces import attention_piece
from dsinfer.runner.prefill_graphs import _Recorder, capture_sizes
from dsinfer.runner.warmup import dummy_prefill_batch

HAS_CUDA = torch.cuda.is_available()


def test_attention_piece_outside_a_capture_is_the_call():
    calls = []

    def fn(a, b, batch):
        calls.append(batch)
        return a + b

    batch = dummy_prefill_batch(3, 16, 16, torch.device("cpu"))  # no ``pieces``: not being captured
    out = attention_piece(fn, (torch.ones(3, 2), torch.full((3, 2), 2.0)), batch)
    assert torch.equal(out, torch.full((3, 2), 3.0)) and len(calls) == 1 and calls[0] is batch


def test_warm_up_recorder_cuts_every_attention_layer_through_shared_buffers(tiny_llama_dir, monkeypatch):
    """The recorder's eager pass (the one before a capture) gives the plain forward's hidden states, cuts once
    per layer, and shares one set of buffers (q, k, v, positions in; the output) between the layers."""
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32")
    model = llm.engine.runner.model
    batch = dummy_prefill_batch(40, 16, llm.engine.runner.block_size, torch.device("cpu"), decode_rows=3)
    batch.input_ids.copy_(torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)))
    with torch.inference_mode():
        plain = model(batch.input_ids, batch.positions, batch)
        buffers: dict = {}
        recorder = _Recorder(buffers, rows=64, capture=False)
        batch.pieces = recorder  # as PrefillGraphs._forward cuts a forward
        cut = model(batch.input_ids, batch.positions, batch)
    torch.testing.assert_close(cut, plain, rtol=0, atol=0)
    assert len(recorder.result.pieces) == len(model.layers) == 2
    assert len(buffers) == 5 and all(buf.shape[0] == 64 for buf in buffers.values())
    first, second = recorder.result.pieces
    assert first.output is second.output and all(a is b for a, b in zip(first.inputs, second.inputs))


def test_runner_eager_turns_both_graph_kinds_off_and_restores_them(tiny_llama_dir):
    runner = LLM(str(tiny_llama_dir), device="cpu", dtype="float32").engine.runner
    runner.graphs, runner.prefill_graphs = "decode graphs", "prefill graphs"
    with pytest.raises(KeyError), runner.eager():
        assert runner.graphs is None and runner.prefill_graphs is None
        raise KeyError("a failing step")
    assert (runner.graphs, runner.prefill_graphs) == ("decode graphs", "prefill graphs")


def test_capture_sizes_pad_a_step_by_at_most_half():
    assert capture_sizes(2048) == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert capture_sizes(300) == [16, 32, 64, 128, 256] and capture_sizes(8) == []
    sizes = capture_sizes(1 << 14)
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:])) and sizes[-1] == 1 << 14
    assert all(b <= 1.5 * a for a, b in zip(sizes, sizes[1:]) if a >= 256)


def test_max_prefill_graph_tokens_is_validated(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_prefill_graph_tokens"):
        LLM(str(tiny_llama_dir), device="cpu", max_prefill_graph_tokens=-1)


# ---- CUDA ----


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(5, 60))] for _ in range(count)]


def _mixed_step_logits(llm: LLM) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits of one step with decode rows and prompts (graphs, then eager), and the step's token count."""
    from dsinfer.core.request import Request
    from dsinfer.scheduler.scheduler import ScheduledRequest, standalone_output

    runner, kv = llm.engine.runner, llm.engine.kv_manager
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    old = [Request(f"old{i}", p, params, seed=0, max_tokens=4) for i, p in enumerate(_prompts(3, 1))]
    new = [Request(f"new{i}", p, params, seed=0, max_tokens=4) for i, p in enumerate(_prompts(2, 2))]
    for req in old + new:
        assert kv.allocate_slots(req, req.num_tokens)
    runner.execute(standalone_output([ScheduledRequest(r, r.num_tokens - 1, 0) for r in old]).plan)
    step = [ScheduledRequest(r, 1, r.num_tokens - 1) for r in old] + [ScheduledRequest(r, r.num_tokens, 0) for r in new]
    plan = standalone_output(step).plan
    graphs = runner._forward(runner.prepare(plan)).clone()
    with runner.eager():
        eager = runner._forward(runner.prepare(plan))
    return graphs, eager, sum(item.num_new_tokens for item in step)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_llama_prefill_graphs_match_eager(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", max_num_batched_tokens=256,
              enable_prefix_caching=False)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs.sizes == [16, 32, 64, 128, 256]  # the step budget caps them
    with_graphs, eager, tokens = _mixed_step_logits(llm)
    size = graphs.padded_size(tokens)
    assert size > tokens, f"the step did not run padded in graphs ({graphs.captured_sizes})"
    torch.testing.assert_close(with_graphs, eager, rtol=1e-4, atol=1e-4)
    # the padding rows were token 0 at position 0 with zero attention outputs, not what earlier steps left
    for buf in (graphs.input_ids, graphs.positions, *graphs._captured[size].outputs):
        assert not buf[tokens:size].any()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_prefill_graphs_serve_prompt_steps_and_can_be_turned_off(tiny_llama_dir, monkeypatch):
    prompts = [{"prompt_token_ids": p} for p in _prompts(6, 3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    off = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", max_prefill_graph_tokens=0)
    assert off.engine.runner.prefill_graphs is None
    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32")
    graphs, runs = llm.engine.runner.prefill_graphs, []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda size, batch: runs.append(size) or run(size, batch))
    ours, ref = (m.generate(prompts, params, use_tqdm=False) for m in (llm, off))
    assert runs, "no prompt step ran through the prefill graphs"
    for a, b in zip(ours, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for got, want in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
