"""Speculative decoding with the n-gram drafter, composed with the engine's features, on a tiny random Llama:
greedy and seeded ("exact" acceptance) outputs are token for token those without speculation, whatever the
sampling rules, stops, n, logprobs, preemption, prefix caching or aborts; rejected drafts give their blocks back.

A random model's next-token distribution is nearly flat over its 256 tokens, so sampled requests here choose
among a few allowed tokens shaped by logit biases: their outputs repeat, and the n-gram drafter's drafts are
often kept."""

from __future__ import annotations

import random

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.core.step_latency import StepLatencyCurve

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ALLOWED = list(range(30, 38))
BIAS = {30: 3.0, 31: 2.5, 32: 2.0, 33: 1.0}


def repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Each a random phrase said a few times, then its start (so a copy would continue it)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        phrase = [rng.randrange(3, 256) for _ in range(rng.randrange(3, 8))]
        out.append(phrase * rng.randrange(2, 4) + phrase[:2])
    return out


def run(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def accepted(llm: LLM) -> int:
    return llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=4)


@pytest.fixture
def spec(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=4, speculative_config=SPEC)


def all_blocks_free(llm: LLM) -> bool:
    return llm.engine.kv_manager.num_free_blocks == llm.engine.runner.num_blocks - 1


def test_greedy_ngram_outputs_are_those_without_speculation(plain, spec):
    prompts = repetitive_prompts(6)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert run(spec, prompts, params) == run(plain, prompts, params)
    stats = spec.engine.get_stats()["spec_decode"]
    assert stats["num_accepted_tokens"] > 0 and stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert stats["mean_acceptance_length"] > 1.0
    assert all_blocks_free(spec)  # rejected drafts' blocks came back


SAMPLED = {
    "penalties": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.4,
                      presence_penalty=0.3, min_tokens=6, stop_token_ids=[31]),
    "filters": dict(temperature=0.5, top_k=3, min_p=0.05),
}


@pytest.mark.parametrize("rules", sorted(SAMPLED))
def test_exact_acceptance_gives_seeded_outputs_token_for_token(plain, spec, rules):
    prompts = repetitive_prompts(5, seed=1)
    params = [SamplingParams(max_tokens=20, seed=50 + i, allowed_token_ids=ALLOWED, logit_bias=BIAS,
                             ignore_eos=True, **SAMPLED[rules]) for i in range(len(prompts))]
    assert run(spec, prompts, params) == run(plain, prompts, params)
    assert accepted(spec) > 0


def test_n_samples_and_their_logprobs_are_those_without_speculation(plain, spec):
    prompt = {"prompt_token_ids": repetitive_prompts(1, seed=2)[0]}
    params = SamplingParams(n=3, max_tokens=14, temperature=0.7, seed=9, allowed_token_ids=ALLOWED,
                            logit_bias=BIAS, logprobs=2)
    (want,), (got,) = plain.generate(prompt, params, use_tqdm=False), spec.generate(prompt, params, use_tqdm=False)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    for a, b in zip(got.outputs, want.outputs):
        assert len(a.logprobs) == len(b.logprobs) == 14
        for pa, pb in zip(a.logprobs, b.logprobs):
            assert pa.keys() == pb.keys()
            assert all(pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-5) for t in pa)
    assert accepted(spec) > 0


def test_greedy_logprobs_of_accepted_tokens_are_the_plain_ones(plain, spec):
    prompts = repetitive_prompts(3, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: round(p.logprob, 4) for t, p in pa.items()} == {t: round(p.logprob, 4) for t, p in pb.items()}
    assert accepted(spec) > 0


def test_stops_and_max_tokens_inside_an_accepted_run(plain, spec):
    prompts = repetitive_prompts(4, seed=4)
    free = run(plain, prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[free[0][9]]),
              SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, min_tokens=12, stop_token_ids=[free[3][2]])]
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert (a.outputs[0].token_ids, a.outputs[0].finish_reason, a.outputs[0].stop_reason) == \
               (b.outputs[0].token_ids, b.outputs[0].finish_reason, b.outputs[0].stop_reason)
    assert accepted(spec) > 0 and all_blocks_free(spec)


def test_preempted_requests_resume_to_the_same_tokens(tiny_llama_dir, plain):
    prompts = repetitive_prompts(4, seed=5)
    params = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)
    small = LLM(str(tiny_llama_dir), num_kv_blocks=24, block_size=4, speculative_config=SPEC)
    assert run(small, prompts, params) == run(plain, prompts, params)
    assert small.engine.scheduler.num_preemptions > 0 and accepted(small) > 0
    assert all_blocks_free(small)


def test_prefix_cache_never_serves_a_rejected_drafts_kv(tiny_llama_dir, spec):
    """A second request whose prompt is the first one's prompt and output hits the blocks the first one
    cached while its drafts were being verified and rejected: its tokens must be those of a cold run."""
    (prompt,) = repetitive_prompts(1, seed=6)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    (first,) = run(spec, [prompt], params)
    stats = spec.engine.get_stats()["spec_decode"]
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # some drafts were rejected
    follow = prompt + first[:26]
    hits_before = spec.engine.kv_manager.prefix_hits
    (warm,) = run(spec, [follow], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert spec.engine.kv_manager.prefix_hits - hits_before >= 16
    cold = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=4, enable_prefix_caching=False)
    assert warm == run(cold, [follow], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]


def test_abort_mid_run_leaves_the_others_untouched(plain, spec):
    prompts = repetitive_prompts(3, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = run(plain, prompts, params)
    engine = spec.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    for _ in range(3):
        engine.step()
    engine.abort_request(["1"])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert done["0"].token_ids == want[0] and done["2"].token_ids == want[2]
    assert done["1"].finish_reason == "abort" and done["1"].token_ids == want[1][:len(done["1"].token_ids)]
    assert accepted(spec) > 0 and all_blocks_free(spec)


# a step costs 1 + t / 2 units for t tokens: a draft pays for its half token only if it is likely enough kept
AFFINE_CURVE = {1: 1.5, 4: 3.0, 16: 9.0, 64: 33.0}


def test_confidence_scheduling_verifies_fewer_drafts_and_changes_no_token(tiny_llama_dir, plain, tmp_path):
    prompts = repetitive_prompts(4, seed=8)
    params = [SamplingParams(max_tokens=20, seed=70 + i, allowed_token_ids=ALLOWED, logit_bias=BIAS,
                             **SAMPLED["filters"]) for i in range(len(prompts))]
    scheduled = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=4, max_num_seqs=8,
                    step_latency_dir=str(tmp_path), speculative_config={**SPEC, "confidence_scheduling": True})
    scheduled.engine.scheduler.confidence.curve = StepLatencyCurve(AFFINE_CURVE)
    assert run(scheduled, prompts, params) == run(plain, prompts, params)
    stats = scheduled.engine.get_stats()["spec_decode"]
    # a fresh drafter's confidence is 0.5 a position: the later drafts (survival 1/8, 1/16) are not verified
    # until the requests' own rates say they pay
    assert 0 < stats["num_draft_tokens"] < stats["num_proposed_tokens"]
    assert stats["num_accepted_tokens"] > 0
    assert stats["verified_per_proposal"] < SPEC["num_speculative_tokens"]


def test_deterministic_mode_same_tokens_alone_batched_and_speculation_on_or_off(tiny_llama_dir, tmp_path):
    """Batch-invariant kernels: a seeded request's tokens are one sequence whether it runs alone or among others,
    without speculation, with it, and with confidence scheduling choosing how many drafts to verify."""
    prompts = repetitive_prompts(4, seed=9)
    params = [SamplingParams(max_tokens=16, seed=90 + i, allowed_token_ids=ALLOWED, logit_bias=BIAS,
                             **SAMPLED["filters"]) for i in range(len(prompts))]
    outputs = []
    for spec in (None, SPEC, {**SPEC, "confidence_scheduling": True}):
        llm = LLM(str(tiny_llama_dir), dtype="float32", deterministic=True, block_size=4, num_kv_blocks=256,
                  max_num_seqs=8, step_latency_dir=str(tmp_path), speculative_config=spec)
        if llm.engine.scheduler.confidence is not None:
            llm.engine.scheduler.confidence.curve = StepLatencyCurve(AFFINE_CURVE)
        outputs.append(run(llm, prompts, params))
        outputs.append(run(llm, prompts[:1], params[:1]) + run(llm, prompts[1:], params[1:]))
        if spec is not None:
            assert accepted(llm) > 0
    assert all(out == outputs[0] for out in outputs)


def test_a_worker_process_verifies_drafts_as_the_engine_process(tiny_llama_dir, plain):
    """distributed_executor_backend="mp": drafts travel in the msgpack plan, the worker verifies them with the
    config's acceptance rule (rejection here: a greedy request keeps a draft only where it is the argmax)."""
    prompts = repetitive_prompts(3, seed=10)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=4, distributed_executor_backend="mp",
              speculative_config={**SPEC, "acceptance": "rejection"})
    try:
        assert run(llm, prompts, params) == run(plain, prompts, params)
        assert accepted(llm) > 0
    finally:
        llm.engine.shutdown()
