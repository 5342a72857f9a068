"""Async scheduling (step N+1 launched before step N's tokens reach the host) gives the same outputs as the
synchronous engine: greedy and seeded tokens, stops, aborts, preemptions, penalties and logprobs, on CPU.

On CPU the overlap logic runs the same code path as on CUDA (placeholder tokens filled from the previous step's
sampled-token tensor, stops applied one step late); only the hardware overlap is missing.
"""

from __future__ import annotations

import random

import pytest

from dsinfer import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def random_prompts(count: int, low: int, high: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randrange(low, high))]}
            for _ in range(count)]


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def assert_drained(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv_manager.num_free_blocks == engine.runner.num_blocks - 1
    assert not engine._children and not engine._needs_host_tokens


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """(sync, async) engines on the tiny Llama; a small token budget so prompts are chunked. float32 on any
    device: the two schedules batch the requests differently (a stop lands one step late), and in bf16 (the CUDA
    default) another batch shape may flip a near-tied greedy token; float32 keeps them apart (H200: identical in
    float32, one of 12 requests differed in bf16). Batch-invariant outputs are the deterministic mode's job."""
    common = dict(max_num_batched_tokens=64, max_num_seqs=8, dtype="float32")
    return (LLM(str(tiny_llama_dir), async_scheduling=False, **common),
            LLM(str(tiny_llama_dir), async_scheduling=True, **common))


def run_both(engines, prompts, params):
    sync, overlapped = engines
    assert not sync.engine.async_scheduling and overlapped.engine.async_scheduling
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    assert_drained(overlapped)
    return expected, got


def test_greedy_outputs_identical_with_and_without_overlap(engines):
    prompts = random_prompts(12, 5, 90)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in range(1, 25, 2)]
    expected, got = run_both(engines, prompts, params)
    assert token_ids(got) == token_ids(expected)
    assert [len(t) for t in token_ids(got)] == list(range(1, 25, 2))


def test_seeded_sampling_identical_with_and_without_overlap(engines):
    prompts = random_prompts(10, 5, 40, seed=1)
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_k=50, seed=7 + i, ignore_eos=True)
              for i in range(10)]
    expected, got = run_both(engines, prompts, params)
    assert token_ids(got) == token_ids(expected)


def test_stop_token_resolved_one_step_late_drops_the_extra_token(engines):
    prompts = random_prompts(6, 10, 30, seed=2)
    free_run = token_ids(engines[0].generate(prompts, GREEDY, use_tqdm=False))
    stops = [run[5] for run in free_run]  # each request stops on its own sixth token (or earlier repeat)
    params = [SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[t]) for t in stops]
    expected, got = run_both(engines, prompts, params)
    assert token_ids(got) == token_ids(expected)
    assert all(out.outputs[0].finish_reason == "stop" for out in got)
    assert all(len(t) <= 6 for t in token_ids(got))


def test_abort_while_a_step_is_in_flight(engines):
    _, overlapped = engines
    engine = overlapped.engine
    prompts = random_prompts(4, 10, 20, seed=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    finished = {}
    for _ in range(4):
        for out in engine.step():
            finished[out.request_id] = out
    assert engine._in_flight is not None
    engine.abort_request(["abort-1"])
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert finished["abort-1"].outputs[0].finish_reason == "abort"
    expected = token_ids(engines[0].generate([prompts[0], prompts[2], prompts[3]],
                                             SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                                             use_tqdm=False))
    assert [finished[f"abort-{i}"].outputs[0].token_ids for i in (0, 2, 3)] == expected
    assert_drained(overlapped)


def test_preemption_with_tokens_in_flight(tiny_llama_dir, engines):
    prompts = random_prompts(8, 20, 60, seed=4)
    expected = token_ids(engines[0].generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(str(tiny_llama_dir), async_scheduling=True, num_kv_blocks=12, block_size=16, max_model_len=128,
              dtype="float32")
    got = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert got == expected
    assert_drained(llm)


def test_penalties_and_min_tokens_match_the_synchronous_engine(engines):
    prompts = random_prompts(6, 5, 30, seed=5)
    params = [SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(max_tokens=16, temperature=0.0, min_tokens=10, stop_token_ids=[1, 2, 3, 4, 5]),
              ] * 3
    expected, got = run_both(engines, prompts, params)
    assert token_ids(got) == token_ids(expected)


def test_logprobs_identical_with_and_without_overlap(engines):
    prompts = random_prompts(4, 5, 30, seed=6)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    expected, got = run_both(engines, prompts, params)
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-5 for t in pa)


def test_ten_thousand_requests_leave_nothing_behind(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), async_scheduling=True, max_num_seqs=256, max_num_batched_tokens=1024)
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randrange(1, 6))]}
               for _ in range(10_000)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 4), temperature=0.0, ignore_eos=True)
              for _ in range(10_000)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert_drained(llm)
    assert len(llm.engine.runner._last_rows) <= 256
