"""Store hits through the engine: the tokens of a cold run, the hit counted by tier, loads beside running steps."""

from __future__ import annotations

import threading

import pytest

from dsinfer import LLM
from dsinfer.core.request import RequestStatus
from tests.kvstore.conftest import GRAIN, GREEDY, assert_no_leak, evict_gpu_cache, make_prompts, run, token_ids


@pytest.mark.parametrize("model", ["llama", "deepseek"])
@pytest.mark.parametrize("tier", ["host", "dir"])
def test_store_hit_after_gpu_eviction_gives_cold_tokens(model, tier, model_dirs, cold, tmp_path):
    prompts = make_prompts()
    store = {"host_gb": 0.01} if tier == "host" else {"dir": str(tmp_path)}
    llm = LLM(str(model_dirs[model]), kv_store={**store, "grain": GRAIN})
    first = run(llm, prompts)
    evict_gpu_cache(llm)
    second = run(llm, prompts)
    assert token_ids(first) == token_ids(second) == cold(model, prompts)
    assert [o.num_cached_tokens for o in second] == [96, 96, 96]  # 3 grains each, all from the store
    stats = llm.engine.kv_store_stats()
    assert stats[f"hit_tokens_{tier}"] == 3 * 96 and stats["corrupt_files"] == 0
    # each request saved its 3 grains in the first run (their lookups came before any write) and loaded 3
    assert stats["bytes_loaded"] == stats["bytes_saved"] == 9 * llm.engine.runner.kv_transfer.bytes_per_grain
    assert_no_leak(llm)
    llm.engine.shutdown()


def test_directory_hit_is_promoted_to_the_host_tier(tiny_llama_dir, cold, tmp_path):
    prompts = make_prompts(1, n=2)
    writer = LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path), "grain": GRAIN})
    run(writer, prompts)
    writer.engine.flush_kv_store()
    # one loader thread: the two requests' loads run in order (with several, both may read the directory at once)
    llm = LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path), "host_gb": 0.01, "grain": GRAIN,
                                             "load_threads": 1})
    out = run(llm, prompts)
    assert token_ids(out) == cold("llama", prompts) and [o.num_cached_tokens for o in out] == [96, 96]
    stats = llm.engine.kv_store_stats()
    # the second request's shared grains come from the host tier the first one's load promoted them to
    from_dir, from_host = stats["hit_tokens_dir"], stats["hit_tokens_host"]
    assert (from_dir, from_host) == (128, 64)
    evict_gpu_cache(llm)
    for path in tmp_path.rglob("*.kv"):
        path.unlink()  # only the host tier has them now
    out = run(llm, prompts)
    assert token_ids(out) == cold("llama", prompts) and [o.num_cached_tokens for o in out] == [96, 96]
    stats = llm.engine.kv_store_stats()
    assert stats["hit_tokens_host"] == from_host + 2 * 96 and stats["hit_tokens_dir"] == from_dir


def test_a_loading_request_does_not_hold_up_running_ones(tiny_llama_dir, cold, monkeypatch):
    prompts = make_prompts(2, n=1) + make_prompts(5, n=1)  # no common prefix: only the first is stored
    llm = LLM(str(tiny_llama_dir), kv_store={"host_gb": 0.01, "grain": GRAIN})
    run(llm, prompts[:1])
    evict_gpu_cache(llm)
    engine = llm.engine
    store = engine.runner.kv_transfer.store
    gate = threading.Event()
    read = store._read
    monkeypatch.setattr(store, "_read", lambda key: gate.wait(10) and read(key))  # a slow disk
    engine.add_request("other", prompts[1], GREEDY)
    engine.step()  # "other" prefills
    engine.add_request("hit", prompts[0], GREEDY)
    for _ in range(3):  # "hit" loads; "other" decodes a token a step meanwhile
        assert [o.request_id for o in engine.step()] == ["other"]
        assert engine.scheduler.loading["hit"][0].status == RequestStatus.LOADING
    gate.set()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [list(done[r].outputs[0].token_ids) for r in ("hit", "other")] == cold("llama", prompts)
    assert done["hit"].num_cached_tokens == 96
    assert_no_leak(llm)


def test_abort_while_loading_frees_blocks_once_the_load_is_done(tiny_llama_dir, monkeypatch):
    prompts = make_prompts(3, n=1)
    llm = LLM(str(tiny_llama_dir), kv_store={"host_gb": 0.01, "grain": GRAIN})
    run(llm, prompts)
    evict_gpu_cache(llm)
    engine = llm.engine
    store = engine.runner.kv_transfer.store
    gate = threading.Event()
    read = store._read
    monkeypatch.setattr(store, "_read", lambda key: gate.wait(10) and read(key))
    engine.add_request("hit", prompts[0], GREEDY)
    engine.step()
    assert "hit" in engine.scheduler.loading
    engine.abort_request(["hit"])
    engine.step()
    held = engine.kv_manager.num_free_blocks
    assert "hit" in engine.scheduler.loading and held < engine.kv_manager.pool.num_blocks - 1  # still written to
    gate.set()
    for _ in range(100):
        if not engine.scheduler.loading:
            break
        engine.step()
    assert_no_leak(llm)
    assert token_ids(run(llm, prompts)) == token_ids(run(LLM(str(tiny_llama_dir)), prompts))


def test_num_cached_tokens_counts_gpu_and_store_hits(tiny_llama_dir, tmp_path):
    prompts = make_prompts(4, n=1, prefix=90, tail=10)
    llm = LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path), "grain": GRAIN})
    assert run(llm, prompts)[0].num_cached_tokens == 0
    assert run(llm, prompts)[0].num_cached_tokens == 96  # the GPU cache's 6 blocks (the store is not asked for)
    assert llm.engine.kv_store_stats()["loads"] == 0


def test_store_hits_under_async_scheduling(tiny_llama_dir, cold, tmp_path):
    """The overlapped step loop (CUDA's default): loads reported a step late, saves of steps still in flight."""
    prompts = make_prompts(6)
    llm = LLM(str(tiny_llama_dir), async_scheduling=True,
              kv_store={"host_gb": 0.01, "dir": str(tmp_path), "grain": GRAIN})
    first = run(llm, prompts)
    evict_gpu_cache(llm)
    second = run(llm, prompts)
    assert token_ids(first) == token_ids(second) == cold("llama", prompts)
    assert [o.num_cached_tokens for o in second] == [96, 96, 96]
    assert_no_leak(llm)
