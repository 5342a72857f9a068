"""The CUDA path against the CPU path on the tiny Llama: Triton kernels, decode CUDA graphs, async scheduling,
memory sizing. float32 everywhere, so every path computes the same greedy tokens."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from dsinfer import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
LLAMA_8B = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "llama-3.1-8b"


def prompts(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randrange(5, 80))]} for _ in range(count)]


def greedy(llm: LLM, batch: list[dict], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def cpu_tokens(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32")
    return greedy(llm, prompts(12))


@pytest.mark.parametrize("mode", [
    dict(),  # the default on CUDA: async scheduling and CUDA graphs
    dict(async_scheduling=False),
    dict(enforce_eager=True),
    dict(async_scheduling=False, enforce_eager=True),
])
def test_cuda_greedy_matches_cpu(tiny_llama_dir, cpu_tokens, mode):
    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", max_num_batched_tokens=256, **mode)
    assert llm.engine.async_scheduling == mode.get("async_scheduling", True)
    assert (llm.engine.runner.graphs is None) == mode.get("enforce_eager", False)
    assert greedy(llm, prompts(12)) == cpu_tokens


def test_decode_graph_replay_matches_eager_logits(tiny_llama_dir):
    from dsinfer.core.request import Request
    from dsinfer.scheduler.scheduler import ScheduledRequest, standalone_output

    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", enable_prefix_caching=False)
    runner, kv = llm.engine.runner, llm.engine.kv_manager
    reqs = []
    for i, p in enumerate(prompts(5, seed=1)):
        req = Request(f"g{i}", p["prompt_token_ids"], GREEDY, seed=0, max_tokens=4)
        assert kv.allocate_slots(req, req.num_tokens)
        reqs.append(req)
    prefill = standalone_output([ScheduledRequest(r, r.num_tokens, 0) for r in reqs])
    runner.execute(prefill.plan)
    decode = standalone_output([ScheduledRequest(r, 1, r.num_tokens - 1) for r in reqs])
    graph_logits = runner._forward(runner.prepare(decode.plan)).clone()
    with runner.eager():
        eager_logits = runner._forward(runner.prepare(decode.plan))
    assert runner.graphs.padded_size(5) == 8
    torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)


def test_no_memory_growth_over_ten_thousand_requests(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", max_num_batched_tokens=2048)
    rng = random.Random(3)
    batch = [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randrange(1, 8))]} for _ in range(10_000)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 4), temperature=0.0, ignore_eos=True) for _ in batch]
    llm.generate(batch[:1000], params[:1000], use_tqdm=False)  # warm-up: allocator pools, pinned buffers
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outputs = llm.generate(batch, params, use_tqdm=False)
    torch.cuda.synchronize()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert torch.cuda.memory_allocated() - before < 1 << 20
    engine = llm.engine
    assert engine.kv_manager.num_free_blocks == engine.runner.num_blocks - 1
    assert not engine.has_unfinished_requests()


def test_model_that_does_not_fit_says_by_how_much(tmp_path):
    shutil.copy(LLAMA_8B / "config.json", tmp_path / "config.json")
    total = torch.cuda.mem_get_info()[1]
    util = 4 * 2**30 / total  # 4 GiB for a 15 GiB model
    with pytest.raises(ValueError, match=r"short by 1\d\.\d\d GiB"):
        LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", device="cuda", gpu_memory_utilization=util)
    assert json.loads((tmp_path / "config.json").read_text())["hidden_size"] == 4096


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_multi_token_decode_graphs_give_one_token_outputs(request, model, tmp_path):
    """Steps that verify 3 drafts replay the decode graphs captured for 4 tokens a sequence (Llama; DeepSeek's MLA
    runs them eagerly, beside its one-token graphs and prefill graphs); their outputs are the one-token steps'
    (drafts from the one-token run, every third one spoiled)."""
    from tests.engine.test_multi_token_steps import KnownTokensDrafter, with_drafter

    path = str(request.getfixturevalue("tiny_llama_dir" if model == "llama" else "tiny_deepseek_dir"))
    kwargs = dict(device="cuda", dtype="float32", enable_prefix_caching=False)
    batch = prompts(6, seed=4)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = greedy(LLM(path, **kwargs), batch, params)
    drafter = KnownTokensDrafter({tuple(p["prompt_token_ids"]): o for p, o in zip(batch, expected)}, 3)
    llm = with_drafter(LLM(path, **kwargs), drafter, k=3)
    runner = llm.engine.runner
    graphs = runner.graphs
    multi = model == "llama"
    assert ((8, 4) in graphs.graphs) == multi and (8, 1) in graphs.graphs and runner.prefill_graphs.captured_sizes
    replays = []
    replay = graphs.replay
    graphs.replay = lambda size, q=1: replays.append(q) or replay(size, q)
    assert greedy(llm, batch, params) == expected
    assert (4 in replays) == multi and drafter.proposed > 0
