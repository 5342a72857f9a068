"""Shared pieces of the KV store's engine tests: prompts with a common prefix, a cold reference, the helpers."""

from __future__ import annotations

import random

import pytest

from dsinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
GRAIN = 32  # two 16-token blocks: a 100-token prompt stores 3 grains (the last token is always computed)


def make_prompts(seed: int = 0, n: int = 3, prefix: int = 70, tail: int = 30) -> list[dict]:
    rng = random.Random(seed)
    head = [rng.randrange(3, 256) for _ in range(prefix)]
    return [{"prompt_token_ids": head + [rng.randrange(3, 256) for _ in range(tail)]} for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(llm: LLM, prompts, params=GREEDY, **kwargs):
    return llm.generate(prompts, params, use_tqdm=False, **kwargs)


def evict_gpu_cache(llm: LLM) -> None:
    """Wait for the saves, then drop every GPU prefix-cache entry, so the next hit can only be the store's."""
    llm.engine.flush_kv_store()
    assert llm.engine.kv_manager.reset_prefix_cache()


def assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    assert not llm.engine.scheduler.loading


@pytest.fixture(scope="session")
def model_dirs(tiny_llama_dir, tiny_deepseek_dir):
    return {"llama": tiny_llama_dir, "deepseek": tiny_deepseek_dir}


@pytest.fixture(scope="session")
def cold(model_dirs):
    """Greedy outputs without any cache, per model: what every store hit must reproduce."""
    cache = {}

    def get(model: str, prompts) -> list[list[int]]:
        key = (model, str(prompts))
        if key not in cache:
            cache[key] = token_ids(run(LLM(str(model_dirs[model]), enable_prefix_caching=False), prompts))
        return cache[key]

    return get
