"""Scheduler unit tests with fake requests and no model: budgets, chunking, preemption, finishing."""

from __future__ import annotations

from dsinfer.config import SchedulerConfig
from dsinfer.core.request import Request, RequestStatus
from dsinfer.engine.sampling_params import SamplingParams
from dsinfer.kvcache.manager import KVCacheManager
from dsinfer.scheduler.scheduler import Scheduler, SchedulerOutput

BS = 4


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 16, max_num_batched_tokens: int = 64,
                   chunked: bool = True, caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked), kv, max_model_len=256)


def make_request(rid: str, num_prompt: int, first_token: int = 0) -> Request:
    tokens = [(first_token + i) % 200 for i in range(num_prompt)]
    return Request(rid, tokens, SamplingParams(max_tokens=32), seed=0, max_tokens=32)


def fake_step(sched: Scheduler) -> SchedulerOutput:
    """Schedule once and append a token to every request that samples (what the engine does)."""
    out = sched.schedule()
    sampling = [item.request for item in out.scheduled if item.samples]
    for request in sampling:
        request.append_token(7)
    return out


def tokens_of(out: SchedulerOutput) -> dict[str, int]:
    return {item.request.request_id: item.num_new_tokens for item in out.scheduled}


def sampled_of(out: SchedulerOutput) -> list[bool]:
    """Which scheduled requests sampled (read after fake_step appended their token)."""
    return [item.num_computed_tokens + item.num_new_tokens == item.request.num_tokens - 1
            for item in out.scheduled]


def test_token_budget_caps_a_step():
    sched = make_scheduler(max_num_batched_tokens=64)
    for rid in "abc":
        sched.add_request(make_request(rid, 30, first_token=ord(rid)))
    out = fake_step(sched)
    assert tokens_of(out) == {"a": 30, "b": 30, "c": 4}
    assert out.num_batched_tokens == 64
    assert sampled_of(out) == [True, True, False]
    assert tokens_of(fake_step(sched)) == {"a": 1, "b": 1, "c": 26}


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 5, first_token=ord(rid)))
    out = fake_step(sched)
    assert tokens_of(out) == {"a": 5, "b": 5}
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert len(sched.running) == 2


def test_chunked_prefill_splits_a_long_prompt():
    sched = make_scheduler(max_num_batched_tokens=16)
    request = make_request("a", 40)
    sched.add_request(request)
    chunks = []
    for _ in range(3):
        out = fake_step(sched)
        item = out.scheduled[0]
        chunks.append((item.num_computed_tokens, item.num_new_tokens, *sampled_of(out)))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert request.num_computed_tokens == 40 and request.num_output_tokens == 1


def test_without_chunked_prefill_a_long_prompt_waits_for_a_fresh_budget():
    sched = make_scheduler(max_num_batched_tokens=32, chunked=False)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 20, first_token=50))
    assert tokens_of(fake_step(sched)) == {"a": 20}
    assert tokens_of(fake_step(sched)) == {"a": 1, "b": 20}


def test_decodes_run_alongside_a_prefill_chunk():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 8))
    fake_step(sched)
    sched.add_request(make_request("b", 40, first_token=100))
    out = fake_step(sched)
    assert tokens_of(out) == {"a": 1, "b": 15}
    assert sampled_of(out) == [True, False]


def test_preemption_takes_the_latest_request_back_to_the_front_of_waiting():
    sched = make_scheduler(num_blocks=7, max_num_batched_tokens=64)  # 6 usable blocks of 4 tokens
    requests = [make_request(rid, 8, first_token=20 * i) for i, rid in enumerate("abc")]
    for request in requests:
        sched.add_request(request)
    late = make_request("d", 4, first_token=150)
    fake_step(sched)
    sched.add_request(late)
    assert sched.kv.num_free_blocks == 0
    out = fake_step(sched)  # each of a, b, c now needs a third block
    a, b, c = requests
    assert out.preempted == [c]
    assert tokens_of(out) == {"a": 1, "b": 1}
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.blocks == []
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [c, late]  # nothing is admitted in a step that preempted
    assert sched.running == [a, b] and c.output_token_ids == [7]


def test_preempted_request_resumes_with_its_output_tokens():
    sched = make_scheduler(num_blocks=7, max_num_batched_tokens=64)
    requests = [make_request(rid, 8, first_token=20 * i) for i, rid in enumerate("abc")]
    for request in requests:
        sched.add_request(request)
    fake_step(sched)
    fake_step(sched)  # preempts c
    for request in requests[:2]:
        sched.finish(request, RequestStatus.FINISHED_LENGTH)
    out = fake_step(sched)
    c = requests[2]
    assert out.scheduled[0].request is c and c.status == RequestStatus.RUNNING
    # a and b took c's freed blocks for their third block, so c recomputes prompt + its first output token
    assert out.scheduled[0].num_computed_tokens == 0 and out.scheduled[0].num_new_tokens == 9
    assert c.num_computed_tokens == 9 and c.num_output_tokens == 2


def test_prefix_hit_allocates_blocks_for_every_new_token():
    sched = make_scheduler(max_num_batched_tokens=64)
    first = make_request("a", 16)
    sched.add_request(first)
    fake_step(sched)
    second = make_request("b", 17)  # same 16 tokens + 1 more
    sched.add_request(second)
    out = fake_step(sched)
    item = next(i for i in out.scheduled if i.request is second)
    assert (item.num_computed_tokens, item.num_new_tokens) == (16, 1)
    assert second.num_cached_tokens == 16
    assert len(second.blocks) == 5 and second.blocks[:4] == first.blocks[:4]


def test_finish_frees_blocks_of_running_and_waiting_requests():
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    running, waiting = make_request("a", 10), make_request("b", 10, first_token=100)
    sched.add_request(running)
    sched.add_request(waiting)
    fake_step(sched)
    assert sched.kv.num_free_blocks == 15 - 3
    sched.finish(running, RequestStatus.FINISHED_ABORTED)
    sched.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert sched.num_unfinished == 0 and sched.kv.num_free_blocks == 15
    assert running.blocks == [] and running.status == RequestStatus.FINISHED_ABORTED
    assert fake_step(sched).is_empty


def test_everything_finishes_without_leaking_blocks():
    sched = make_scheduler(num_blocks=9, max_num_batched_tokens=12, max_num_seqs=3)
    requests = [make_request(str(i), 5 + 3 * i, first_token=i % 2) for i in range(6)]
    for request in requests:
        sched.add_request(request)
    for _ in range(200):
        fake_step(sched)
        for request in list(sched.running):
            if request.num_output_tokens >= 6:
                sched.finish(request, RequestStatus.FINISHED_LENGTH)
        if not sched.num_unfinished:
            break
    assert all(r.num_output_tokens == 6 for r in requests)
    assert sched.num_preemptions > 0
    assert sched.kv.num_free_blocks == 8
