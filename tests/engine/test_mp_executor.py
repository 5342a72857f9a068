"""The multi-process executor (``distributed_executor_backend="mp"``): the model runs in a spawned worker process
that gets each step plan as msgpack bytes. Its outputs must be the in-process executor's, bit for bit, and a
worker that dies must fail the engine loudly and at once."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np
import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.core import wire
from dsinfer.core.outputs import RunnerOutput, TokenLogprobs
from dsinfer.core.plan import CachedRequestData, NewRequestData, RequestSampling, StepPlan
from dsinfer.executor.base import WorkerDiedError


def _prompts(count: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 30))]} for _ in range(count)]


def _outputs(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_worker_process_gives_the_in_process_tokens_and_logprobs(request, model):
    path = str(request.getfixturevalue("tiny_llama_dir" if model == "llama" else "tiny_deepseek_dir"))
    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=64)
    prompts = _prompts(6, 200)
    params = [SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=7, logprobs=1, ignore_eos=True)] * 3
    inproc = LLM(path, **kwargs)
    expected = _outputs(inproc, prompts, params)
    mp = LLM(path, distributed_executor_backend="mp", **kwargs)
    try:
        assert mp.engine.executor.process.is_alive() and mp.engine.executor.process.pid != os.getpid()
        assert mp.engine.kv_manager.pool.num_blocks == inproc.engine.kv_manager.pool.num_blocks == 128
        assert _outputs(mp, prompts, params) == expected  # chunked prefill (a budget of 64) and decode alike
        with pytest.raises(AttributeError, match="worker processes"):
            mp.engine.runner  # noqa: B018 - the runner lives in the worker
    finally:
        mp.engine.shutdown()
    assert not mp.engine.executor.process.is_alive()


def test_a_killed_worker_fails_generate_at_once(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", distributed_executor_backend="mp")
    worker = llm.engine.executor.process
    killer = threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL))
    prompts = _prompts(8, 200)
    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)  # far longer than the kill delay
    started = time.monotonic()
    killer.start()
    try:
        with pytest.raises(WorkerDiedError, match=r"worker process 0 \(pid \d+\) died \(signal 9\)"):
            llm.generate(prompts * 8, long, use_tqdm=False)
    finally:
        killer.cancel()
        llm.engine.shutdown()
    assert time.monotonic() - started < 30


def test_a_worker_that_cannot_start_says_why(tmp_path, tiny_llama_dir):
    with pytest.raises(ValueError, match="num_kv_blocks"):  # refused before any process starts
        LLM(str(tiny_llama_dir), device="cpu", distributed_executor_backend="mp", num_kv_blocks=1)
    with pytest.raises(RuntimeError, match=r"worker process 0 \(pid \d+\) failed to start"):  # the model's failure
        LLM(str(tiny_llama_dir), device="cpu", distributed_executor_backend="mp", kv_cache_memory_gb=1e-9)


def test_unknown_backend_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(str(tiny_llama_dir), distributed_executor_backend="ray")


def test_plans_and_outputs_round_trip_as_msgpack():
    sampling = RequestSampling(0.7, 5, 0.9, 0.0, seed=-3, logprobs=2, logit_bias=[[4, 1.5]], bad_word_ids=[[1, 2]])
    plan = StepPlan(new_requests=[NewRequestData("a", [1, 2, 3], 3, sampling, [[4, 5]], 0)],
                    cached_requests=CachedRequestData(["b"], [[9]], [[[7]]], [[2]], [11]),
                    num_scheduled_tokens={"a": 3, "b": 4}, draft_token_ids={"b": [5, 6, 7]},
                    finished_req_ids=["c"], grammar_bitmask=np.array([[-1, 3]], np.int32))
    back = wire.decode(wire.encode(plan))
    assert isinstance(back, StepPlan) and back.new_requests[0].sampling == sampling
    assert back.num_scheduled_tokens == plan.num_scheduled_tokens and back.cached_requests == plan.cached_requests
    assert back.grammar_bitmask.dtype == np.int32 and back.grammar_bitmask.tolist() == [[-1, 3]]
    out = RunnerOutput({"a": [1, 2]}, {"a": [TokenLogprobs([1], [-0.5], 1), TokenLogprobs([2], [-0.1], 1)]})
    assert wire.decode(wire.encode(out)) == out


def test_bytes_naming_another_type_are_refused():
    import msgpack

    forged = msgpack.ExtType(1, msgpack.packb(["Popen", [["sh", "-c", "echo hi"]]]))
    with pytest.raises(ValueError, match="unknown message type"):
        wire.decode(msgpack.packb(forged))
    with pytest.raises(TypeError, match="cannot send"):
        wire.encode(object())
