"""DeepSeek-V4 in the KV store: each grain's compressed entries and indexer keys, plus the state at its end.

The tiny checkpoint of ``tests.models.v4_fixture`` (sliding, CSA rate 4 + indexer, HCA rate 16; window 8) with
16-token blocks. A grain's entry holds every compressed layer's rows of its blocks; its window entry the state
slot's rows at its end (``BoundaryStateSpec``), which a hit restores into the request's slot: the hit computes
only the tokens after it, whatever the prefix, and gives the cold run's tokens. Damaged, truncated, deleted and
foreign files are misses that cost recomputation, never a token.
"""

from __future__ import annotations

import random

import pytest

from dsinfer import LLM
from dsinfer.kvcache.hashing import block_hash_chain
from dsinfer.kvstore.directory import entry_path
from dsinfer.kvstore.entry import read_entry, write_entry
from dsinfer.kvstore.keys import grain_keys
from tests.kvstore.conftest import assert_no_leak, evict_gpu_cache, run, token_ids

transformers = pytest.importorskip("transformers")

BS = 16


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    from tests.models.v4_fixture import write_checkpoint

    path = tmp_path_factory.mktemp("tiny_v4_store")
    write_checkpoint(transformers, path)
    return path


def prompts(seed: int, n: int, prefix: int, tail: int) -> list[dict]:
    rng = random.Random(seed)
    head = [rng.randrange(2, 128) for _ in range(prefix)]
    return [{"prompt_token_ids": head + [rng.randrange(2, 128) for _ in range(tail)]} for _ in range(n)]


def v4(path, **kwargs) -> LLM:
    return LLM(str(path), block_size=BS, **kwargs)


def store_files(llm: LLM, ids: list[int], grain: int, boundary: int):
    """(grain file, window-state file) of grain ``boundary`` (1-based) of ``ids``."""
    index = llm.engine.store_index
    key = grain_keys(block_hash_chain(ids, BS), grain // BS, index.fingerprint)[boundary - 1]
    return entry_path(index.model_dir, key), entry_path(index.model_dir, index.window_key(key))


def assert_slots_free(llm: LLM) -> None:
    assert_no_leak(llm)
    slots = llm.engine.kv_manager.slots
    assert slots.num_free == slots.num_slots


@pytest.mark.parametrize("tier", ["host", "dir", "dir without a GPU prefix cache"])
def test_v4_store_hit_loads_compressed_grains_and_the_boundary_state(v4_dir, tier, tmp_path):
    batch = prompts(0, 3, 70, 30)
    cold = token_ids(run(v4(v4_dir, enable_prefix_caching=False), batch))
    store = {"host_gb": 0.01} if tier == "host" else {"dir": str(tmp_path)}
    llm = v4(v4_dir, kv_store={**store, "grain": 32}, enable_prefix_caching=not tier.endswith("cache"))
    tier = tier.split()[0]
    first = run(llm, batch)
    evict_gpu_cache(llm)
    second = run(llm, batch)
    assert token_ids(first) == token_ids(second) == cold
    assert [o.num_cached_tokens for o in second] == [96, 96, 96]
    transfer = llm.engine.runner.kv_transfer
    # per block: 2 CSA layers x 4 entries x (16 KV + 16 indexer-key values) + 1 HCA layer x 1 entry x 16, fp32
    assert transfer.bytes_per_grain == 2 * (2 * 4 * 32 + 16) * 4
    # the state at a grain's end: 4 layers x 7 window rows x 16, + 2 CSA layers x 2 compressors x 4 rows x 64
    assert transfer.bytes_per_window == (4 * 7 * 16 + 2 * 2 * 4 * 64) * 4
    stats = llm.engine.kv_store_stats()
    assert stats[f"hit_tokens_{tier}"] == 3 * 96
    assert stats["bytes_loaded"] == 3 * (3 * transfer.bytes_per_grain + transfer.bytes_per_window)
    assert_slots_free(llm)
    llm.engine.shutdown()


def recomputed(llm: LLM, batch) -> list[int]:
    """Prompt tokens computed (not served from a cache) on a run after the GPU cache was emptied."""
    evict_gpu_cache(llm)
    return [len(p["prompt_token_ids"]) - o.num_cached_tokens for p, o in zip(batch, run(llm, batch))]


def test_v4_replay_after_a_store_hit_does_not_grow_with_the_context(v4_dir, tmp_path):
    """Prefixes of 4 and 14 grains: a hit computes the 5-token tail only; with the last boundary state lost it
    backs off one grain (a grain + the tail), never more."""
    grain = 16
    batch = [prompts(1, 1, 4 * grain + 5, 0)[0], prompts(2, 1, 14 * grain + 5, 0)[0]]
    cold = token_ids(run(v4(v4_dir, enable_prefix_caching=False), batch))
    llm = v4(v4_dir, kv_store={"dir": str(tmp_path), "grain": grain})
    assert token_ids(run(llm, batch)) == cold
    assert recomputed(llm, batch) == [5, 5]
    for p, boundary in zip(batch, (4, 14)):
        store_files(llm, p["prompt_token_ids"], grain, boundary)[1].unlink()
    assert recomputed(llm, batch) == [grain + 5, grain + 5]
    evict_gpu_cache(llm)
    assert token_ids(run(llm, batch)) == cold
    assert_slots_free(llm)
    llm.engine.shutdown()


def test_v4_damaged_truncated_deleted_and_foreign_files_are_misses(v4_dir, tmp_path, monkeypatch):
    """Five requests without a shared prefix, each loading 2 grains and the state at the second's end; while they
    run, one file of each load breaks just before it is read: the boundary state garbled, truncated, deleted or
    bit-rotten, or the first grain replaced by another model's valid entry. Every such load fills nothing: the
    request is computed from its first token, the cold run's tokens; the bad files are counted and removed."""
    batch = [p for seed in range(10, 15) for p in prompts(seed, 1, 70, 0)]
    cold = token_ids(run(v4(v4_dir, enable_prefix_caching=False), batch))
    writer = v4(v4_dir, kv_store={"dir": str(tmp_path), "grain": 32})
    run(writer, batch)
    writer.engine.flush_kv_store()
    writer.engine.shutdown()
    assert len(list(tmp_path.rglob("*.kv"))) == 5 * 4  # 2 grains + 2 boundary states each
    # one loader thread: the damage below picks files by the order they are read
    llm = v4(v4_dir, kv_store={"dir": str(tmp_path), "grain": 32, "load_threads": 1})
    tier = llm.engine.runner.kv_transfer.store.dir
    read, seen = tier.read, []

    def damaging_read(key, now=None):
        load, part = divmod(len(seen), 3)
        seen.append(key)
        path = tier.path(key)
        if load < 4 and part == 2:  # the boundary state
            raw = path.read_bytes()
            if load == 0:
                path.write_bytes(bytes(b ^ 0xFF for b in raw))
            elif load == 1:
                path.write_bytes(raw[:len(raw) // 2])
            elif load == 2:
                path.unlink()
            else:
                path.write_bytes(raw[:-50] + bytes(b ^ 0x5A for b in raw[-50:]))
        elif load == 4 and part == 0:  # another model's entry under this key, valid for that model
            with path.open("rb") as f:
                payload, ttl_s = read_entry(f, tier.fingerprint, tier.layout, tier.num_tokens)
            with path.open("wb") as f:
                write_entry(f, bytes(16), tier.layout, tier.num_tokens, ttl_s, payload)
        return read(key, now)

    monkeypatch.setattr(tier, "read", damaging_read)
    out = run(llm, batch)
    assert token_ids(out) == cold
    assert [o.num_cached_tokens for o in out] == [0] * 5
    assert llm.engine.kv_store_stats()["corrupt_files"] == 4  # garbled, truncated, bit rot, foreign
    assert len(seen) == 4 * 3 + 1  # the foreign grain ends its load at once
    assert_slots_free(llm)
    llm.engine.flush_kv_store()  # recomputed, and the missing entries saved again, whole
    monkeypatch.setattr(tier, "read", read)
    assert len(list(tmp_path.rglob("*.kv"))) == 5 * 4
    evict_gpu_cache(llm)
    out = run(llm, batch)
    assert token_ids(out) == cold and [o.num_cached_tokens for o in out] == [64] * 5
    llm.engine.shutdown()


def test_blocks_a_load_filled_before_its_boundary_are_no_gpu_hit(v4_dir, tmp_path):
    """A load brings the state at its last grain's end only: the blocks before it join the GPU prefix cache (a
    longer prompt passes through them), but a prompt that ends among them cannot resume there from the GPU; it
    loads the shorter prefix from the store (its grains' own boundary states) and gives the cold tokens. Those
    blocks then replace the first load's as the GPU's, so a third prompt on that prefix is a GPU hit; and the
    requests that hit those blocks never save a boundary state they do not hold."""
    whole = prompts(30, 1, 100, 0)
    head, other = ({"prompt_token_ids": whole[0]["prompt_token_ids"][:64] + p["prompt_token_ids"]}
                   for p in prompts(31, 2, 0, 20))
    cold = token_ids(run(v4(v4_dir, enable_prefix_caching=False), whole + [head, other]))
    llm = v4(v4_dir, kv_store={"dir": str(tmp_path), "grain": 32})
    run(llm, whole)
    evict_gpu_cache(llm)
    assert run(llm, whole)[0].num_cached_tokens == 96  # from the store: 6 blocks, the state at 96
    before = llm.engine.kv_store_stats()["hit_tokens_dir"]
    out = run(llm, [head])
    assert token_ids(out) == cold[1:2] and out[0].num_cached_tokens == 64
    assert llm.engine.kv_store_stats()["hit_tokens_dir"] - before == 64
    llm.engine.flush_kv_store()
    grain1, lost = store_files(llm, whole[0]["prompt_token_ids"], 32, 1)  # the state at 32: in no GPU block now
    grain1.unlink()  # so the store holds none of the prefix: the hits below save it all again
    lost.unlink()
    out = run(llm, [whole[0], other])  # GPU hits only
    assert token_ids(out) == [cold[0], cold[2]] and [o.num_cached_tokens for o in out] == [96, 64]
    assert llm.engine.kv_store_stats()["hit_tokens_dir"] - before == 64
    llm.engine.flush_kv_store()
    assert grain1.exists() and not lost.exists()  # their saves skip the boundaries whose block holds no state
    assert_slots_free(llm)
    llm.engine.shutdown()
