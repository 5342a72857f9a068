"""N-gram speculation under async (overlap) scheduling: drafts proposed one token ahead of a step in flight are
verified after its placeholder, a step that verified drafts is waited for, and the tokens are those of the
synchronous engine and of decoding without speculation: greedy, seeded (exact acceptance), with confidence
scheduling, stops and max_tokens."""

from __future__ import annotations

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.core.step_latency import StepLatencyCurve
from tests.spec_decode.test_spec_composition import ALLOWED, BIAS, SPEC, repetitive_prompts, run

AFFINE_CURVE = {1: 1.5, 4: 3.0, 16: 9.0, 64: 33.0}


def make(tiny_llama_dir, tmp_path, overlap: bool, spec=SPEC) -> LLM:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=4, max_num_seqs=8, dtype="float32",
              async_scheduling=overlap, step_latency_dir=str(tmp_path), speculative_config=spec)
    if llm.engine.scheduler.confidence is not None:
        llm.engine.scheduler.confidence.curve = StepLatencyCurve(AFFINE_CURVE)
    return llm


def spy_launches(llm: LLM) -> list[tuple[bool, bool]]:
    """(a step was in flight, the plan verifies drafts) for each launch."""
    engine, seen = llm.engine, []
    launch = engine.executor.launch

    def recording(plan):
        seen.append((engine._in_flight is not None, bool(plan.draft_token_ids)))
        return launch(plan)

    engine.executor.launch = recording
    return seen


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, tmp_path_factory):
    return make(tiny_llama_dir, tmp_path_factory.mktemp("plain"), overlap=False, spec=None)


@pytest.mark.parametrize("confidence", [False, True])
def test_greedy_outputs_identical_with_overlap_on_or_off_and_without_speculation(tiny_llama_dir, tmp_path, plain,
                                                                               confidence):
    spec = {**SPEC, "confidence_scheduling": confidence}
    prompts = repetitive_prompts(6, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 16, 20, 24, 5)]
    want = run(plain, prompts, params)
    sync = make(tiny_llama_dir, tmp_path, overlap=False, spec=spec)
    overlapped = make(tiny_llama_dir, tmp_path, overlap=True, spec=spec)
    launches = spy_launches(overlapped)
    assert run(sync, prompts, params) == want
    assert run(overlapped, prompts, params) == want
    stats = overlapped.engine.get_stats()["spec_decode"]
    assert stats["num_accepted_tokens"] > 0
    # drafts verified in a step launched while the step before it ran (proposed one token ahead)
    assert (True, True) in launches
    assert overlapped.engine.kv_manager.num_free_blocks == overlapped.engine.runner.num_blocks - 1


def test_seeded_exact_acceptance_identical_under_overlap(tiny_llama_dir, tmp_path, plain):
    prompts = repetitive_prompts(5, seed=4)
    params = [SamplingParams(max_tokens=18, seed=30 + i, temperature=0.5, top_k=3, allowed_token_ids=ALLOWED,
                             logit_bias=BIAS) for i in range(len(prompts))]
    overlapped = make(tiny_llama_dir, tmp_path, overlap=True)
    assert run(overlapped, prompts, params) == run(plain, prompts, params)
    assert overlapped.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0


def test_stops_inside_an_accepted_run_under_overlap(tiny_llama_dir, tmp_path, plain):
    prompts = repetitive_prompts(4, seed=5)
    free = run(plain, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[out[6]]) for out in free]
    overlapped = make(tiny_llama_dir, tmp_path, overlap=True)
    outs = overlapped.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == run(plain, prompts, params)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_a_worker_process_runs_drafts_ahead_under_overlap(tiny_llama_dir, tmp_path, plain):
    """distributed_executor_backend="mp": the placeholder the drafts follow is filled in the worker process."""
    prompts = repetitive_prompts(3, seed=6)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=4, max_num_seqs=8, dtype="float32",
              async_scheduling=True, distributed_executor_backend="mp", speculative_config=SPEC)
    try:
        launches = spy_launches(llm)
        assert run(llm, prompts, params) == run(plain, prompts, params)
        assert (True, True) in launches
        assert llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
    finally:
        llm.engine.shutdown()


def test_padded_steps_of_mixed_draft_counts_keep_the_tokens_under_overlap(tiny_llama_dir, tmp_path, plain):
    """Steps whose requests verify different draft counts, padded to the longest (forced on CPU, where no graph
    replays them: ``runner.decode_padding``), placeholders of the step in flight included, give the tokens of
    decoding without speculation."""
    prompts = repetitive_prompts(6, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 16, 20, 24, 5)]
    overlapped = make(tiny_llama_dir, tmp_path, overlap=True, spec={**SPEC, "confidence_scheduling": True})
    runner = overlapped.engine.runner
    runner.force_decode_padding = True
    padded_steps = []  # per padded step: whether it filled placeholders of the step in flight
    forward_padded = runner._forward_padded

    def recording(inputs, padded):
        padded_steps.append(bool(inputs.placeholder_rows))
        return forward_padded(inputs, padded)

    runner._forward_padded = recording
    assert run(overlapped, prompts, params) == run(plain, prompts, params)
    assert True in padded_steps
    assert overlapped.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
