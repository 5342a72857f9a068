"""State slots beside KV blocks: admitted together or not at all, freed together, carried to the worker."""

from __future__ import annotations

import pytest

from dsinfer.config import SchedulerConfig
from dsinfer.core.request import Request
from dsinfer.engine.sampling_params import SamplingParams
from dsinfer.kvcache.manager import KVCacheManager
from dsinfer.kvcache.state_slots import StateSlotPool
from dsinfer.scheduler.scheduler import Scheduler


def make_request(n: int, rid: str) -> Request:
    return Request(rid, list(range(n)), SamplingParams(), seed=0, max_tokens=4)


def test_no_free_slot_admits_nothing_and_takes_no_block():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False, num_state_slots=1)
    first, second = make_request(6, "a"), make_request(6, "b")
    assert kv.allocate_slots(first, 6) and first.state_slot == 0
    free = kv.num_free_blocks
    assert not kv.allocate_slots(second, 6)
    assert second.state_slot == -1 and not second.blocks and kv.num_free_blocks == free
    kv.free(first)
    assert first.state_slot == -1 and kv.allocate_slots(second, 6) and second.state_slot == 0


def test_no_free_block_takes_no_slot():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False, num_state_slots=2)
    assert not kv.allocate_slots(make_request(12, "a"), 12)  # 3 blocks, 2 allocatable
    assert kv.slots.num_free == 2


def test_a_running_request_keeps_its_slot_while_it_grows():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False, num_state_slots=2)
    request = make_request(4, "a")
    assert kv.allocate_slots(request, 4)
    request.num_computed_tokens = 4
    assert kv.allocate_slots(request, 3) and request.state_slot == 0 and kv.slots.num_free == 1


def test_state_model_blocks_join_the_prefix_cache_once_computed():
    """Offered after the step that fills them (a request admitted in that step would restore its slot from a
    block end the forward has not written yet), and at the latest when the request is freed."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True, num_state_slots=2)
    first = make_request(12, "a")
    assert kv.allocate_slots(first, 12)
    assert kv.get_computed_blocks(make_request(12, "b")) == ([], 0)
    first.num_computed_tokens = 12
    kv.free(first)
    hits, num_cached = kv.get_computed_blocks(make_request(12, "c"))
    assert num_cached == 8 and [b.block_id for b in hits] == [b.block_id for b in kv.pool.blocks[1:3]]


def test_a_load_takes_its_slot_with_its_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True, num_state_slots=1)
    loading, other = make_request(12, "a"), make_request(4, "b")
    assert kv.allocate_for_load(loading, 8) and loading.state_slot == 0 and len(loading.blocks) == 2
    assert kv.window_block_ids(loading, 8) == [loading.blocks[1].block_id]  # the block that keeps the state at 8
    assert not kv.allocate_slots(other, 4) and not other.blocks


def test_preemption_frees_the_slot_and_resume_resends_it():
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_caching=False, num_state_slots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), kv, max_model_len=64)
    a, b = make_request(8, "a"), make_request(5, "b")  # 2 blocks each: all 4 allocatable ones
    scheduler.add_request(a)
    scheduler.add_request(b)
    plan = scheduler.schedule().plan
    assert [r.state_slot for r in plan.new_requests] == [0, 1]
    for request in (a, b):
        request.append_token(1)
    out = scheduler.schedule()  # a grows into a third block: none is left, so b is preempted
    assert out.preempted == [b] and b.state_slot == -1 and kv.slots.num_free == 1
    for _ in range(3):  # a finishes (max_tokens 4), then b is admitted again: a slot and its tokens resent
        a.append_token(1)
        out = scheduler.schedule()
    scheduler.finish(a, a.status.FINISHED_LENGTH)
    plan = scheduler.schedule().plan
    assert [(r.request_id, r.state_slot) for r in plan.new_requests] == [("b", 0)]


def test_slot_pool_refuses_double_release():
    pool = StateSlotPool(2)
    slot = pool.allocate()
    pool.release(slot)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(slot)
