"""Tensor parallelism on CPU (gloo, two spawned ranks): a TP=2 engine gives the tokens of one process, with
logprobs within float32 tolerance, through chunked prefill, prefix-cache hits, preemption and async scheduling;
a rank killed mid-run fails ``generate`` at once; sizes, launchers and ports that cannot work are refused before
any process starts."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import socket
import threading
import time

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.executor.base import WorkerDiedError

# a budget of 24 blocks of 4 tokens holds fewer sequences than run at once: some are preempted and recomputed
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=24, block_size=4, max_num_batched_tokens=24,
              async_scheduling=True)
LOGPROB_TOLERANCE = 1e-4


def _prompts(vocab: int) -> list[dict]:
    """Six prompts, four sharing a 12-token prefix (three full blocks: prefix-cache hits)."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab) for _ in range(12)]
    shared = [{"prompt_token_ids": prefix + [rng.randrange(3, vocab) for _ in range(3)]} for _ in range(4)]
    return shared + [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(9)]} for _ in range(2)]


def _run(llm: LLM, prompts: list[dict]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                           o.outputs[0].token_ids)])
            for o in outs]


def _assert_same_as_one_process(path: str, vocab: int) -> None:
    prompts = _prompts(vocab)
    one = LLM(path, **ENGINE)
    expected = _run(one, prompts)
    two = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        assert len(two.engine.executor.processes) == 2
        assert two.engine.kv_manager.pool.num_blocks == 24
        got = _run(two, prompts)
        stats = two.engine.get_stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0  # both paths were taken
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        for (_, lps), (_, want) in zip(got, expected):
            assert max(abs(a - b) for a, b in zip(lps, want)) < LOGPROB_TOLERANCE
    finally:
        two.engine.shutdown()
    assert not any(p.is_alive() for p in two.engine.executor.processes)


def test_tp2_llama_gives_one_process_tokens_and_logprobs(tiny_llama_dir):
    _assert_same_as_one_process(str(tiny_llama_dir), 256)


def test_tp2_deepseek_v2_gives_one_process_tokens_and_logprobs(tiny_deepseek_dir):
    """MLA heads split, the routed experts' and the stacked shared experts' intermediate columns split."""
    _assert_same_as_one_process(str(tiny_deepseek_dir), 256)


def test_a_killed_rank_fails_generate_within_30s(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=2)
    rank1 = llm.engine.executor.processes[1]
    killer = threading.Timer(0.5, os.kill, (rank1.pid, signal.SIGKILL))
    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)  # far longer than the delay
    started = time.monotonic()
    killer.start()
    try:
        with pytest.raises(WorkerDiedError, match=r"worker process 1 \(pid \d+\) died \(signal 9\)"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, long, use_tqdm=False)
    finally:
        killer.cancel()
        llm.engine.shutdown()
    assert time.monotonic() - started < 30
    assert not any(p.is_alive() for p in llm.engine.executor.processes)  # rank 0 was not left in a collective


def _refused(path, match: str, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(path), device="cpu", **kwargs)
    assert not multiprocessing.active_children()  # said before any rank started


def test_sizes_that_do_not_split_are_refused_before_any_rank_starts(tiny_llama_dir, tiny_deepseek_dir):
    _refused(tiny_llama_dir, r"vocab_size \(256\) is not divisible by tensor_parallel_size \(3\)",
             tensor_parallel_size=3)
    _refused(tiny_llama_dir, r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(8\)",
             tensor_parallel_size=8)
    _refused(tiny_deepseek_dir, r"moe_intermediate_size \(31\) is not divisible by tensor_parallel_size \(2\)",
             tensor_parallel_size=2, hf_overrides={"moe_intermediate_size": 31})
    _refused(tiny_llama_dir, "distributed_executor_backend='uni'", tensor_parallel_size=2,
             distributed_executor_backend="uni")
    _refused(tiny_llama_dir, "kv_store is not supported with tensor_parallel_size", tensor_parallel_size=2,
             kv_store={"host_gb": 0.01})
    _refused(tiny_llama_dir, "pipeline_parallel_size=2: dsinfer has no pipeline parallelism", pipeline_parallel_size=2)


def test_a_launcher_world_size_that_does_not_match_is_refused(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    _refused(tiny_llama_dir, r"WORLD_SIZE=4 \(set by the launcher\) does not match the engine's world size "
             r"tensor_parallel_size=2", tensor_parallel_size=2)
    monkeypatch.delenv("MASTER_PORT")
    _refused(tiny_llama_dir, r"not \['MASTER_PORT'\]", tensor_parallel_size=4)
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("RANK", "1")
    _refused(tiny_llama_dir, "RANK=1: only RANK 0 of a launched job runs the engine", tensor_parallel_size=4)


def test_a_busy_master_port_is_refused(tiny_llama_dir, monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        _refused(tiny_llama_dir, f"MASTER_PORT={busy.getsockname()[1]} is already in use", tensor_parallel_size=2)
