"""The KV store on sliding-window models: full grains plus the bounded window state, and bounded replay."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dsinfer import LLM
from dsinfer.kvcache.block_pool import NONE_HASH, hash_block
from dsinfer.kvstore.directory import entry_path
from dsinfer.kvstore.entry import HEADER_BYTES
from dsinfer.kvstore.keys import grain_keys
from tests.kvstore.conftest import assert_no_leak, evict_gpu_cache, make_prompts, run, token_ids

BS = 16  # the engine's default KV block size
WINDOW = 24  # not a block multiple: a window state is ceil(23 / 16) = 2 blocks per layer
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": WINDOW}


def prompt(num_tokens: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, 256) for _ in range(num_tokens)]}


def mistral(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), hf_overrides=MISTRAL, **kwargs)


def window_file(llm: LLM, ids: list[int], grain: int, boundary: int) -> Path:
    """The directory entry of the window state at the end of grain ``boundary`` (1-based) of ``ids``."""
    hashes = []
    for start in range(0, len(ids) // BS * BS, BS):
        hashes.append(hash_block(hashes[-1] if hashes else NONE_HASH, ids[start:start + BS]))
    index = llm.engine.store_index
    key = grain_keys(hashes, grain // BS, index.fingerprint)[boundary - 1]
    return entry_path(index.model_dir, index.window_key(key))


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_gpt_oss_store")
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=2, num_experts_per_tok=1, sliding_window=WINDOW,
        max_position_embeddings=256)
    transformers.GptOssForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("tier", ["host", "dir"])
def test_mistral_store_hit_gives_cold_tokens_from_window_states_only(tiny_llama_dir, tier, tmp_path):
    prompts = make_prompts(1)
    cold = token_ids(run(mistral(tiny_llama_dir, enable_prefix_caching=False), prompts))
    store = {"host_gb": 0.01} if tier == "host" else {"dir": str(tmp_path)}
    llm = mistral(tiny_llama_dir, kv_store={**store, "grain": 32})
    first = run(llm, prompts)
    evict_gpu_cache(llm)
    second = run(llm, prompts)
    assert token_ids(first) == token_ids(second) == cold
    assert [o.num_cached_tokens for o in second] == [96, 96, 96]  # 3 grains: the state at the third boundary
    transfer = llm.engine.runner.kv_transfer
    assert transfer.bytes_per_grain == 0  # every layer slides: no full-attention entry at all
    # a window state: 2 layers x K,V x 2 blocks x 16 tokens x 2 heads x 16 dims x 4 bytes
    assert transfer.bytes_per_window == 2 * 2 * 2 * 16 * 2 * 16 * 4
    stats = llm.engine.kv_store_stats()
    assert stats[f"hit_tokens_{tier}"] == 3 * 96
    assert stats["bytes_loaded"] == 3 * transfer.bytes_per_window  # one state per request, nothing else
    if tier == "dir":
        sizes = {p.stat().st_size - HEADER_BYTES - len(transfer.layout) for p in tmp_path.rglob("*.kv")}
        assert sizes == {transfer.bytes_per_window}
    assert_no_leak(llm)
    llm.engine.shutdown()


def test_gpt_oss_store_hit_loads_full_grains_and_the_window_state(gpt_oss_dir, tmp_path):
    prompts = make_prompts(2)
    cold = token_ids(run(LLM(str(gpt_oss_dir), enable_prefix_caching=False), prompts))
    llm = LLM(str(gpt_oss_dir), kv_store={"dir": str(tmp_path), "grain": 32})
    first = run(llm, prompts)
    evict_gpu_cache(llm)
    second = run(llm, prompts)
    assert token_ids(first) == token_ids(second) == cold
    assert [o.num_cached_tokens for o in second] == [96, 96, 96]
    transfer = llm.engine.runner.kv_transfer
    # one full layer's grain (2 blocks) beside one sliding layer's window (2 blocks): the same bytes here
    assert transfer.bytes_per_grain == transfer.bytes_per_window == 2 * 2 * 16 * 1 * 16 * 4
    # each request read its 3 grains and the state at the last boundary; the common 2-grain prefix was
    # saved once per request (the lookups came before any write), its window states too
    assert llm.engine.kv_store_stats()["bytes_loaded"] == 3 * (3 * transfer.bytes_per_grain
                                                               + transfer.bytes_per_window)
    assert_no_leak(llm)
    llm.engine.shutdown()


def recomputed(llm: LLM, prompts) -> list[int]:
    """Prompt tokens computed (not served from a cache) on a run after the GPU cache was emptied."""
    evict_gpu_cache(llm)
    return [len(p["prompt_token_ids"]) - o.num_cached_tokens for p, o in zip(prompts, run(llm, prompts))]


def test_replay_after_a_hit_does_not_grow_with_the_context(tiny_llama_dir, tmp_path):
    grain = 16
    prompts = [prompt(4 * grain + 5, seed=1), prompt(16 * grain + 5, seed=2)]
    cold = token_ids(run(mistral(tiny_llama_dir, enable_prefix_caching=False), prompts))
    llm = mistral(tiny_llama_dir, kv_store={"dir": str(tmp_path), "grain": grain})
    assert token_ids(run(llm, prompts)) == cold
    assert recomputed(llm, prompts) == [5, 5]  # the state at the last boundary (4 and 16 grains) was loaded
    for p, boundary in zip(prompts, (4, 16)):  # lose the last state: the hit backs off one grain
        window_file(llm, p["prompt_token_ids"], grain, boundary).unlink()
    assert recomputed(llm, prompts) == [grain + 5, grain + 5]
    assert token_ids(run(llm, prompts)) == cold  # (a GPU hit now) and the backed-off run's saves were right
    evict_gpu_cache(llm)
    assert token_ids(run(llm, prompts)) == cold
    assert_no_leak(llm)
    llm.engine.shutdown()


def test_a_load_without_its_window_state_recomputes_and_gives_cold_tokens(tiny_llama_dir, tmp_path, monkeypatch):
    prompts = [prompt(4 * 16 + 5, seed=3)]
    cold = token_ids(run(mistral(tiny_llama_dir, enable_prefix_caching=False), prompts))
    llm = mistral(tiny_llama_dir, kv_store={"dir": str(tmp_path), "grain": 16})
    run(llm, prompts)
    evict_gpu_cache(llm)
    store = llm.engine.runner.kv_transfer.store
    monkeypatch.setattr(store, "_read", lambda key: None)  # the index saw the files; the reads miss
    out = run(llm, prompts)
    assert token_ids(out) == cold and out[0].num_cached_tokens == 0
    assert_no_leak(llm)
    llm.engine.shutdown()


def test_gpt_oss_store_extends_a_shorter_gpu_hit(gpt_oss_dir, tmp_path):
    whole = make_prompts(6, n=1)
    head = [{"prompt_token_ids": whole[0]["prompt_token_ids"][:50] + [7] * 10}]
    cold = token_ids(run(LLM(str(gpt_oss_dir), enable_prefix_caching=False), whole))
    llm = LLM(str(gpt_oss_dir), kv_store={"dir": str(tmp_path), "grain": 32})
    run(llm, whole)
    evict_gpu_cache(llm)
    run(llm, head)  # one grain from the store; the GPU cache then holds the first 3 blocks of `whole`
    before = llm.engine.kv_store_stats()["hit_tokens_dir"]
    out = run(llm, whole)
    assert token_ids(out) == cold and out[0].num_cached_tokens == 96
    assert llm.engine.kv_store_stats()["hit_tokens_dir"] - before == 64  # grains 2 and 3: the first is on the GPU
    assert_no_leak(llm)
    llm.engine.shutdown()
