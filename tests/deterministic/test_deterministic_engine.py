"""Deterministic mode end to end: a seeded (T=0.8) and a greedy request give the same token ids and logprobs
alone, among 1..64 random companions, with chunked prefill on or off, and on a prefix-cache hit."""

from __future__ import annotations

import random

import pytest
import torch

from dsinfer import LLM, SamplingParams

TARGET_LEN = 40


def _fingerprint(output):
    c = output.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in pos.items())) for pos in c.logprobs)


def _run_with_companions(llm, target, num_companions, rng, vocab):
    companions = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randrange(1, 90))]}
                  for _ in range(num_companions)]
    companion_params = [SamplingParams(temperature=1.0, max_tokens=rng.randrange(1, 24), ignore_eos=True)
                        for _ in range(num_companions)]
    ours = [SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)]
    split = rng.randrange(num_companions + 1)  # our requests land anywhere in the batch
    prompts = companions[:split] + [{"prompt_token_ids": target}] * 2 + companions[split:]
    params = companion_params[:split] + ours + companion_params[split:]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return _fingerprint(outputs[split]), _fingerprint(outputs[split + 1])


@pytest.mark.parametrize("chunked", [True, False])
def test_outputs_identical_alone_and_in_batches(tiny_llama_dir, chunked):
    kwargs = dict(max_num_batched_tokens=48) if chunked else dict(enable_chunked_prefill=False)
    llm = LLM(str(tiny_llama_dir), dtype="float32", deterministic=True, **kwargs)
    rng = random.Random(0)
    target = [rng.randrange(256) for _ in range(TARGET_LEN)]
    results = {_run_with_companions(llm, target, k, rng, 256) for k in (0, 1, 7, 64)}
    assert len(results) == 1
    # prefix-cache hit: the target prompt is cached by now
    hit = llm.generate([{"prompt_token_ids": target}], SamplingParams(temperature=0.0, max_tokens=20,
                                                                      ignore_eos=True, logprobs=3), use_tqdm=False)
    assert hit[0].num_cached_tokens > 0
    assert _fingerprint(hit[0]) == next(iter(results))[1]


def test_chunked_and_unchunked_engines_agree(tiny_llama_dir):
    rng = random.Random(1)
    target = [rng.randrange(256) for _ in range(TARGET_LEN)]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, logprobs=2)
    results = []
    for kwargs in (dict(max_num_batched_tokens=16), dict(enable_chunked_prefill=False),
                   dict(enable_prefix_caching=False)):
        llm = LLM(str(tiny_llama_dir), dtype="float32", deterministic=True, **kwargs)
        results.append(_fingerprint(llm.generate([{"prompt_token_ids": target}], params, use_tqdm=False)[0]))
    assert len(set(results)) == 1


def test_real_model_deterministic_alone_and_batched():
    llm = LLM(dtype="float32", deterministic=True, max_num_batched_tokens=64)
    tok = llm.get_tokenizer()
    rng = random.Random(2)
    target = tok.encode("The three most important inventions of the last century are")
    vocab = llm.engine.model_config.vocab_size
    results = {_run_with_companions(llm, target, k, rng, vocab) for k in (0, 6)}
    assert len(results) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_hundred_runs_with_random_companions_one_output(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", deterministic=True, device="cuda")
    rng = random.Random(3)
    target = [rng.randrange(256) for _ in range(TARGET_LEN)]
    results = {_run_with_companions(llm, target, rng.randrange(0, 65), rng, 256) for _ in range(100)}
    assert len(results) == 1
