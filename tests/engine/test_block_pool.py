"""BlockPool: reference counts, the LRU free list, the prefix-cache index and the null block."""

from __future__ import annotations

import pytest

from dsinfer.kvcache.block_pool import NONE_HASH, BlockPool, hash_block


def test_null_block_is_never_handed_out():
    pool = BlockPool(num_blocks=8, enable_caching=True)
    blocks = pool.allocate(7)
    assert sorted(b.block_id for b in blocks) == list(range(1, 8))
    assert pool.null_block.block_id == 0 and pool.null_block not in blocks
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks with 0 free"):
        pool.allocate(1)


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2 blocks, got 1"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_ref_counts_follow_touch_and_release():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.allocate(1)
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.release([block])
    assert block.ref_cnt == 1 and block.block_id not in pool.free
    pool.release([block])
    assert block.ref_cnt == 0 and pool.free[block.block_id] is block
    assert pool.num_free_blocks == 3 and pool.usage == 0.0
    with pytest.raises(AssertionError, match="released twice"):
        pool.release([block])


def test_allocation_takes_least_recently_freed_block():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    a, b, c, d = pool.allocate(4)
    pool.release([c, a, d])
    assert [blk.block_id for blk in pool.allocate(3)] == [c.block_id, a.block_id, d.block_id]


def test_freed_cached_block_is_revived_by_touch():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.allocate(1)
    h = hash_block(NONE_HASH, [1, 2, 3, 4])
    pool.cache_block(block, h)
    pool.release([block])
    assert pool.get_cached(h) is block and pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 1 and block.block_id not in pool.free and pool.num_free_blocks == 2


def test_reallocated_block_loses_its_hash_lru_first():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    old, new = pool.allocate(2)
    h_old, h_new = hash_block(NONE_HASH, [1]), hash_block(NONE_HASH, [2])
    pool.cache_block(old, h_old)
    pool.cache_block(new, h_new)
    pool.release([old, new])
    pool.allocate(1)  # the never-used block 3 was freed before both: taken first
    (reused,) = pool.allocate(1)
    assert reused is old and reused.block_hash is None
    assert pool.get_cached(h_old) is None and pool.get_cached(h_new) is new


def test_cache_block_first_writer_wins():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    first, second = pool.allocate(2)
    h = hash_block(NONE_HASH, [7, 7])
    pool.cache_block(first, h)
    pool.cache_block(second, h)
    assert pool.get_cached(h) is first and second.block_hash is None


def test_caching_disabled_finds_nothing():
    pool = BlockPool(num_blocks=4, enable_caching=False)
    (block,) = pool.allocate(1)
    h = hash_block(NONE_HASH, [1, 2])
    pool.cache_block(block, h)
    assert pool.get_cached(h) is None and block.block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.allocate(1)
    h = hash_block(NONE_HASH, [5])
    pool.cache_block(block, h)
    assert not pool.reset_prefix_cache()
    pool.release([block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached(h) is None and block.block_hash is None


def test_hash_chain_depends_on_tokens_and_every_earlier_block():
    first = hash_block(NONE_HASH, list(range(16)))
    assert first == hash_block(NONE_HASH, tuple(range(16)))
    assert len(first) == 16
    second = hash_block(first, list(range(16, 32)))
    other_first = hash_block(NONE_HASH, [99] + list(range(1, 16)))
    assert hash_block(other_first, list(range(16, 32))) != second
    assert hash_block(first, list(range(16, 32))) == second
    assert hash_block(NONE_HASH, [1, 2]) != hash_block(NONE_HASH, [2, 1])
    assert hash_block(NONE_HASH, [1]) != hash_block(NONE_HASH, [1, 0])  # length is hashed
