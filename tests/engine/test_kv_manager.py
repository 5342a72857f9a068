"""KVCacheManager: prefix hits by hash chain, block sizing, tail-first free, and no leaks."""

from __future__ import annotations

from dsinfer.core.request import Request
from dsinfer.engine.sampling_params import SamplingParams
from dsinfer.kvcache.manager import KVCacheManager

BS = 4


def make_request(tokens: list[int], rid: str = "r", **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params), seed=0, max_tokens=8)


def compute_all(kv: KVCacheManager, request: Request) -> None:
    """What the scheduler does for a new request that runs its whole prompt in one step."""
    computed, num_cached = kv.get_computed_blocks(request)
    request.num_computed_tokens = num_cached
    assert kv.allocate_slots(request, request.num_tokens - num_cached, computed)
    request.num_computed_tokens = request.num_tokens


def test_allocate_slots_gives_ceil_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    request = make_request(range(10))
    assert kv.allocate_slots(request, 10)
    assert len(request.blocks) == 3 and kv.num_free_blocks == 12
    request.num_computed_tokens = 10
    assert kv.allocate_slots(request, 2)  # 12 tokens still fit in 3 blocks
    assert len(request.blocks) == 3
    request.num_computed_tokens = 12
    assert kv.allocate_slots(request, 1)
    assert len(request.blocks) == 4


def test_allocate_slots_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_caching=True)
    request = make_request(range(12))
    assert not kv.allocate_slots(request, 12)
    assert request.blocks == [] and kv.num_free_blocks == 2


def test_same_prefix_gives_same_hashes_and_a_hit():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    first = make_request(list(range(8)) + [50, 51, 52], "a")
    compute_all(kv, first)
    second = make_request(list(range(8)) + [60, 61, 62, 63, 64], "b")
    hits, num_cached = kv.get_computed_blocks(second)
    assert second.block_hashes[:2] == first.block_hashes[:2]
    assert num_cached == 8 and hits == first.blocks[:2]
    assert kv.prefix_hits == 8 and kv.prefix_queries == 11 + 13


def test_different_earlier_block_changes_later_hashes():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    first = make_request([1, 2, 3, 4, 9, 9, 9, 9, 0], "a")
    compute_all(kv, first)
    second = make_request([1, 2, 3, 5, 9, 9, 9, 9, 0], "b")  # same second block, different first
    hits, num_cached = kv.get_computed_blocks(second)
    assert second.block_hashes[1] != first.block_hashes[1]
    assert hits == [] and num_cached == 0


def test_full_prefix_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    first = make_request(range(8), "a")
    compute_all(kv, first)
    kv.free(first)
    again = make_request(range(8), "b")  # every block cached, yet the last token must run to give logits
    hits, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 4 and len(hits) == 1


def test_prompt_logprobs_request_skips_prefix_cache():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    compute_all(kv, make_request(range(9), "a"))
    hits, num_cached = kv.get_computed_blocks(make_request(range(9), "b", prompt_logprobs=0))
    assert hits == [] and num_cached == 0


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
    compute_all(kv, make_request(range(9), "a"))
    assert kv.get_computed_blocks(make_request(range(9), "b")) == ([], 0)


def test_shared_blocks_are_ref_counted():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    first = make_request(range(9), "a")
    compute_all(kv, first)
    second = make_request(range(9), "b")
    compute_all(kv, second)
    assert second.blocks[:2] == first.blocks[:2]
    assert [b.ref_cnt for b in first.blocks] == [2, 2, 1]
    assert kv.num_free_blocks == 15 - 4
    kv.free(first)
    assert [b.ref_cnt for b in second.blocks] == [1, 1, 1]


def test_hit_on_freed_blocks_revives_them():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    first = make_request(range(9), "a")
    compute_all(kv, first)
    kept = first.blocks[:2]
    kv.free(first)
    assert kv.num_free_blocks == 15
    second = make_request(list(range(8)) + [100, 101], "b")
    compute_all(kv, second)
    assert second.blocks[:2] == kept and all(b.ref_cnt == 1 for b in second.blocks)
    assert kv.num_free_blocks == 15 - 3


def test_free_returns_blocks_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True)
    request = make_request(range(12))
    compute_all(kv, request)
    ids = [b.block_id for b in request.blocks]
    kv.free(request)
    assert list(kv.pool.free)[-3:] == ids[::-1]  # the first block is evicted last
    assert request.blocks == []


def test_cached_prefix_survives_while_other_blocks_are_evicted():
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=True)  # 4 usable blocks
    first = make_request(range(8), "a")
    compute_all(kv, first)
    kv.free(first)
    filler = make_request([200, 201, 202, 203, 204], "f")  # takes the 2 never-used blocks first
    compute_all(kv, filler)
    hits, num_cached = kv.get_computed_blocks(make_request(list(range(8)) + [1], "b"))
    assert num_cached == 8 and len(hits) == 2


def test_no_leak_after_many_requests_finish():
    kv = KVCacheManager(num_blocks=32, block_size=BS, enable_caching=True)
    requests = [make_request([i % 3] * 5 + list(range(i, i + 7)), str(i)) for i in range(6)]
    for request in requests:
        compute_all(kv, request)
    for request in requests:
        request.append_token(1)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    for request in requests:
        kv.free(request)
    assert kv.num_free_blocks == 31 and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:]) and kv.pool.null_block.ref_cnt == 1
