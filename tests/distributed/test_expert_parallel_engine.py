"""Expert parallelism in the engine on CPU (gloo, two spawned ranks): the routed experts of DeepSeek-V2
partitioned over the ranks, with tensor-parallel attention (data_parallel_size 1) or DP attention, give the tokens
of one process, with logprobs within float32 tolerance, through prefix-cache hits, preemption and EPLB
rebalances; a killed rank fails generate; sizes that cannot be partitioned are refused before any rank starts."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.executor.base import WorkerDiedError
from tests.distributed.test_tensor_parallel import ENGINE, LOGPROB_TOLERANCE, _prompts, _run

pytest.importorskip("transformers")


def _transformers_logprobs(path: str, prompt: list[int], tokens: list[int]) -> list[float]:
    """The logprob transformers gives each generated token after the prompt and the tokens before it."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logprobs = hf(ids).logits[0].float().log_softmax(-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_ep2_deepseek_v2_gives_one_process_tokens_and_transformers_logprobs(tiny_deepseek_dir):
    """TP attention, experts partitioned, EPLB rebalancing between the ranks all along (weights moved over
    gloo): greedy tokens of one process without EPLB, logprobs within 1e-4 of transformers'."""
    path = str(tiny_deepseek_dir)
    prompts = _prompts(256)
    expected = _run(LLM(path, **ENGINE), prompts)
    two = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
              eplb_config={"num_redundant_experts": 2, "window_size": 4, "step_interval": 8}, **ENGINE)
    try:
        assert two.engine.executor.num_local_expert_slots == 6  # (8 experts + 2 redundant) / 2 ranks + a spare
        got = _run(two, prompts)
        two.engine.get_stats()  # the next step brings rank 0's rebalance totals
        assert _run(two, prompts[:1])[0][0] == got[0][0]
        stats = two.engine.get_stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0  # both paths were taken
    finally:
        two.engine.shutdown()
    assert stats["eplb"]["num_rebalances"] >= 2 and stats["eplb"]["received_bytes"] > 0, stats["eplb"]
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for prompt, (tokens, lps) in zip(prompts, got):
        want = _transformers_logprobs(path, prompt["prompt_token_ids"], tokens)
        assert max(abs(a - b) for a, b in zip(lps, want)) < LOGPROB_TOLERANCE
    assert not any(p.is_alive() for p in two.engine.executor.processes)


def test_dp2_attention_gives_one_process_tokens_and_logprobs(tiny_deepseek_dir):
    """Each rank its own requests, scheduler and KV cache (12 blocks each: preemptions), the MoE layers across
    the two ranks through ``ep_moe``, rebalanced by EPLB from both ranks' loads; an idle rank runs empty steps.
    The second round hits each rank's prefix cache."""
    path = str(tiny_deepseek_dir)
    engine = {k: v for k, v in ENGINE.items() if k != "async_scheduling"} | {"num_kv_blocks": 12}
    prompts = _prompts(256) + [{"prompt_token_ids": [9, 8, 7, 6, 5]}]  # 7 prompts: one rank ends up idle
    expected = _run(LLM(path, **engine), prompts)
    dp = LLM(path, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
             eplb_config={"num_redundant_experts": 2, "window_size": 4, "step_interval": 8}, **engine)
    try:
        assert dp.engine.executor.num_local_expert_slots == 6  # (8 experts + 2 redundant) / 2 ranks + a spare
        got = _run(dp, prompts)
        dp.engine.get_stats()  # the next step brings rank 0's rebalance totals
        again = _run(dp, prompts[:4])
        stats = dp.engine.get_stats()
        per_rank = stats["per_rank"]
    finally:
        dp.engine.shutdown()
    assert [tokens for tokens, _ in got + again] == [tokens for tokens, _ in expected + expected[:4]]
    for (_, lps), (_, want) in zip(got + again, expected + expected[:4]):
        assert max(abs(a - b) for a, b in zip(lps, want)) < LOGPROB_TOLERANCE
    assert all(s["num_generation_tokens"] > 0 for s in per_rank)  # both ranks served requests
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert sum(stats["num_empty_steps"]) > 0  # a rank without work took part in the others' steps
    assert stats["eplb"]["num_rebalances"] >= 1 and stats["eplb"]["received_bytes"] > 0  # outputs unchanged
    assert not any(p.is_alive() for p in dp.engine.executor.processes)


def test_serve_flags_build_dp_engines_and_a_killed_rank_fails_a_step_within_30s(tiny_deepseek_dir):
    """``dsinfer serve -dp 2 --enable-expert-parallel``'s engine serves a request; then a rank killed mid-run
    fails the step in bounded time (the server answers 503 and exits on that error)."""
    import argparse

    from dsinfer.engine.dp_engine import DataParallelEngine
    from dsinfer.server.cli import add_serve_args, build_engine, check_serve_args

    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        [str(tiny_deepseek_dir), "-dp", "2", "--enable-expert-parallel", "--device", "cpu"])
    check_serve_args(args)
    engine = build_engine(args)
    try:
        assert isinstance(engine, DataParallelEngine) and len(engine.engines) == 2
        engine.add_request("short", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0.0))
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        assert len(done) == 1 and len(done[0].outputs[0].token_ids) == 3
        long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)  # far longer than the delay
        for i in range(4):
            engine.add_request(f"long-{i}", {"prompt_token_ids": [5, 6, 7]}, long)
        rank1 = engine.executor.processes[1]
        killer = threading.Timer(0.5, os.kill, (rank1.pid, signal.SIGKILL))
        started = time.monotonic()
        killer.start()
        with pytest.raises(WorkerDiedError, match=r"worker process 1 \(pid \d+\) died \(signal 9\)"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < 30
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in engine.executor.processes)


def _refused(path, match: str, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(path), device="cpu", **kwargs)
    assert not multiprocessing.active_children()  # said before any rank started


def test_expert_parallel_sizes_that_do_not_partition_are_refused(tiny_deepseek_dir, tiny_llama_dir):
    _refused(tiny_deepseek_dir, r"n_routed_experts \(8\) is not divisible by the expert-parallel size "
             r"tensor_parallel_size x data_parallel_size=3", tensor_parallel_size=3, enable_expert_parallel=True,
             hf_overrides={"num_attention_heads": 3})
    _refused(tiny_deepseek_dir, r"n_routed_experts \(8\) \+ eplb_config.num_redundant_experts \(1\) is not "
             r"divisible", tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
             eplb_config={"num_redundant_experts": 1})
    _refused(tiny_llama_dir, "enable_expert_parallel=True needs a DeepSeek V2 / V3 MoE model",
             tensor_parallel_size=2, enable_expert_parallel=True)
    _refused(tiny_deepseek_dir, "enable_expert_parallel must be true or false", enable_expert_parallel="yes")
    _refused(tiny_deepseek_dir, r"data_parallel_size=2: dsinfer has no data parallelism without "
             r"enable_expert_parallel=True", data_parallel_size=2)
    _refused(tiny_deepseek_dir, r"data_parallel_size=2 \(DP attention\) does not take tensor_parallel_size > 1",
             data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    _refused(tiny_deepseek_dir, r"does not take speculative_config", data_parallel_size=2,
             enable_expert_parallel=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    _refused(tiny_deepseek_dir, r"n_routed_experts \(8\) is not divisible by the expert-parallel size "
             r"tensor_parallel_size x data_parallel_size=3", data_parallel_size=3, enable_expert_parallel=True)


def test_serve_flag_enables_expert_parallel():
    import argparse

    from dsinfer.server.cli import add_serve_args, engine_args

    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(["m", "-tp", "2", "--enable-expert-parallel"])
    eargs = engine_args(args)
    assert eargs.enable_expert_parallel is True and eargs.tensor_parallel_size == 2
