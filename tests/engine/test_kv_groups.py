"""KV cache groups: how layers split by layout, and the grouped manager (a block list per group from one pool;
sliding groups give back what falls behind the window; per-group prefix hits; rollback and preemption)."""

from __future__ import annotations

import pytest
import torch

from dsinfer.core.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    MLASpec,
    SlidingWindowSpec,
    bytes_per_block,
    kv_cache_groups,
)
from dsinfer.core.request import Request
from dsinfer.engine.sampling_params import SamplingParams
from dsinfer.kvcache.grouped_manager import GroupedKVCacheManager, kv_cache_manager
from dsinfer.kvcache.manager import KVCacheManager
from dsinfer.scheduler.scheduler import PlanWriter, ScheduledRequest

BS = 4
W = 8  # window: a query sees itself and the 7 positions before it


def full(bs=BS):
    return FullAttentionSpec(bs, 2, 8, torch.float32)


def sliding(window=W, bs=BS):
    return SlidingWindowSpec(bs, 2, 8, torch.float32, window)


def make_request(tokens, rid: str = "r") -> Request:
    return Request(rid, list(tokens), SamplingParams(), seed=0, max_tokens=64)


def step(kv, request: Request, num_new: int) -> None:
    assert kv.allocate_slots(request, num_new)
    request.num_computed_tokens += num_new


def compute_all(kv, request: Request) -> int:
    computed, num_cached = kv.get_computed_blocks(request)
    request.num_computed_tokens = num_cached
    assert kv.allocate_slots(request, request.num_tokens - num_cached, computed)
    request.num_computed_tokens = request.num_tokens
    return num_cached


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_groups_split_layers_by_layout():
    assert kv_cache_groups([full(), full()]) == [KVCacheGroup(None, (0, 1))]
    mistral = kv_cache_groups([sliding(), sliding()])
    assert [(g.sliding_window, g.layers) for g in mistral] == [(W, (0, 1))]
    gpt_oss = kv_cache_groups([sliding(), full(), sliding(), full()])
    assert [(g.sliding_window, g.layers) for g in gpt_oss] == [(None, (1, 3)), (W, (0, 2))]
    assert [g.sliding_window for g in kv_cache_groups([MLASpec(BS, 16, 4, torch.float32)])] == [None]


def test_groups_share_tensors_so_a_block_costs_one_group_of_layers():
    specs = [sliding(), full(), sliding(), full()]
    assert bytes_per_block(specs, kv_cache_groups(specs)) == 2 * full().bytes_per_block
    assert bytes_per_block([full()] * 3, kv_cache_groups([full()] * 3)) == 3 * full().bytes_per_block


def test_one_full_group_keeps_the_plain_manager():
    assert type(kv_cache_manager(16, BS, True)) is KVCacheManager
    assert isinstance(kv_cache_manager(16, BS, True, sliding_windows=(W,)), GroupedKVCacheManager)


def test_sliding_group_frees_blocks_behind_the_window_and_usage_stays_bounded():
    kv = GroupedKVCacheManager(64, BS, False, 0, (None, W))
    request = make_request(range(4))
    step(kv, request, 4)
    held = []
    for i in range(60):  # decode 60 tokens
        request.append_token(i)
        step(kv, request, 1)
        full_blocks, window_blocks = request.blocks, request.group_blocks[0]
        assert len(full_blocks) == len(window_blocks) == -(-request.num_computed_tokens // BS)
        held.append(sum(b.block_id != 0 for b in window_blocks))
        # every position a query at num_computed - 1 sees is in a live block
        first_seen = max(0, request.num_computed_tokens - 1 - W + 1)
        assert all(b.block_id != 0 for b in window_blocks[first_seen // BS:])
    assert max(held) <= W // BS + 2
    assert kv.num_free_blocks == 63 - len(request.blocks) - held[-1]


def test_drafts_keep_the_window_for_a_rollback():
    kv = GroupedKVCacheManager(64, BS, False, 0, (W,), max_draft_tokens=3)
    request = make_request(range(30))
    step(kv, request, 30)
    request.append_token(1)
    step(kv, request, 1 + 3)  # one token and three drafts
    kv.trim(request, 31)  # all three rejected
    request.num_computed_tokens = 31
    first_seen = 31 - W + 1  # the next query (position 31) sees from here
    assert all(b.block_id != 0 for b in request.blocks[first_seen // BS:])
    assert len(request.blocks) == 8
    request.append_token(2)
    step(kv, request, 1)
    assert all(b.block_id != 0 for b in request.blocks[(32 - W + 1 - 3) // BS:])


def test_prefix_hit_needs_only_the_window_in_a_sliding_group():
    kv = GroupedKVCacheManager(64, BS, True, 0, (None, W))
    tokens = list(range(40))
    first = make_request(tokens, "a")
    compute_all(kv, first)
    second = make_request(tokens + [99], "b")
    assert compute_all(kv, second) == 40
    assert ids(second.blocks[:10]) == ids(first.blocks)  # the full group shares every block
    window = second.group_blocks[0]
    needed = (40 - W + 1) // BS
    assert all(b.block_id == 0 for b in window[:needed]) and ids(window[needed:10]) == ids(first.group_blocks[0][
        needed:10])
    assert window[10].block_id not in ids(first.group_blocks[0])


def test_prefix_hit_is_cut_where_a_sliding_group_lost_its_window():
    kv = GroupedKVCacheManager(64, BS, True, 0, (None, W))
    first = make_request(range(8), "a")
    compute_all(kv, first)
    for i in range(32):  # grows to 40 tokens: its sliding blocks 0-7 go back (free, still cached)
        first.append_token(100 + i)
        step(kv, first, 1)
    assert [b.block_id == 0 for b in first.group_blocks[0]] == [True] * 8 + [False] * 2
    full_ids = ids(first.blocks)
    kv.free(first)
    hit = make_request(first.all_token_ids + [7], "b")
    assert compute_all(kv, hit) == 40  # the window at 40: sliding blocks 8-9
    kv.free(hit)
    # the sliding group's block 9 is evicted: at 40 its window is gone, at 36 (blocks 7-8) it is whole
    kv.pool.cached.pop(first.block_hashes[9] + bytes([1]))
    again = make_request(first.all_token_ids + [7], "c")
    assert compute_all(kv, again) == 36
    assert ids(again.blocks[:9]) == full_ids[:9]
    assert [b.block_id == 0 for b in again.group_blocks[0][:9]] == [True] * 7 + [False] * 2


def test_blocks_of_one_group_are_never_a_hit_for_another():
    kv = GroupedKVCacheManager(64, BS, True, 0, (None, W))
    a = make_request(range(20), "a")
    compute_all(kv, a)
    hits, n = kv.get_computed_blocks(make_request(list(range(20)) + [5], "b"))
    assert n == 20 and not set(ids(hits[0])) & set(ids(b for b in hits[1] if b.block_id))


def test_free_and_preemption_release_every_group():
    kv = GroupedKVCacheManager(32, BS, True, 0, (None, W))
    request = make_request(range(30))
    step(kv, request, 30)
    assert kv.num_free_blocks == 31 - 2 * 8
    kv.free(request)
    assert kv.num_free_blocks == 31 and request.blocks == [] and request.group_blocks == [[]]
    request.num_computed_tokens = 0
    step(kv, request, 10)  # recomputed after a preemption: both groups again
    assert len(request.blocks) == len(request.group_blocks[0]) == 3


def test_allocation_fails_without_side_effects_when_the_groups_do_not_fit():
    kv = GroupedKVCacheManager(8, BS, False, 0, (None, W))
    request = make_request(range(16))
    assert not kv.allocate_slots(request, 16)  # 4 blocks in each group: 8 of 7
    assert request.blocks == [] and kv.num_free_blocks == 7


def test_plan_carries_new_block_ids_per_group():
    kv = GroupedKVCacheManager(32, BS, False, 0, (None, W))
    writer = PlanWriter(2)
    request = make_request(range(6))
    assert kv.allocate_slots(request, 6)
    plan = writer.write([ScheduledRequest(request, 6, 0)], [])
    assert plan.new_requests[0].block_ids == [ids(request.blocks), ids(request.group_blocks[0])]
    request.num_computed_tokens = 6
    request.append_token(1)
    request.append_token(2)
    request.append_token(3)
    assert kv.allocate_slots(request, 3)
    plan = writer.write([ScheduledRequest(request, 3, 6)], [])
    cached = plan.cached_requests
    assert cached.new_block_ids == [[ids(request.blocks[2:])], [ids(request.group_blocks[0][2:])]]
    assert cached.num_kept_blocks == [[2], [2]]


@pytest.mark.parametrize("windows", [(W,), (None, W)])
def test_grouped_manager_never_leaks(windows):
    kv = GroupedKVCacheManager(80, BS, True, 0, windows, max_draft_tokens=2)
    requests = [make_request(range(k * 3, k * 3 + 5 + 3 * k), f"r{k}") for k in range(4)]
    for request in requests:
        compute_all(kv, request)
    for i in range(20):
        for request in requests:
            request.append_token(i)
            step(kv, request, 1)
    for request in requests:
        kv.free(request)
    assert kv.num_free_blocks == 79
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:])
