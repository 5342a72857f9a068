"""vLLM's priority scheduling (``scheduling_policy="priority"``): the waiting queue in (priority, arrival) order,
the lowest-priority running request preempted first, and ``priority`` through the engine and the offline API;
under "fcfs" a priority other than 0 is an error, as in vLLM."""

from __future__ import annotations

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.config import SchedulerConfig
from dsinfer.core.request import RequestStatus
from dsinfer.engine.arg_utils import EngineArgs
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.kvcache.manager import KVCacheManager
from dsinfer.scheduler.scheduler import Scheduler

from .test_scheduler import BS, fake_step, make_request, tokens_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make_scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, 64, True, policy), KVCacheManager(num_blocks, BS, True),
                     max_model_len=256)


def with_priority(rid: str, num_prompt: int, priority: int, first_token: int = 0):
    request = make_request(rid, num_prompt, first_token)
    request.priority = priority
    return request


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = make_scheduler("priority", max_num_seqs=2)
    for rid, priority in [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", -1)]:
        sched.add_request(with_priority(rid, 4, priority, first_token=10 * ord(rid)))
    assert ids(sched.waiting) == ["e", "b", "d", "c", "a"]
    assert tokens_of(fake_step(sched)) == {"e": 4, "b": 4}
    assert ids(sched.waiting) == ["d", "c", "a"]


def test_fcfs_ignores_the_field_and_keeps_arrival_order():
    sched = make_scheduler("fcfs", max_num_seqs=2)
    for rid, priority in [("a", 2), ("b", 0), ("c", 1)]:
        sched.add_request(with_priority(rid, 4, priority, first_token=10 * ord(rid)))
    assert tokens_of(fake_step(sched)) == {"a": 4, "b": 4}


def low_then_high(sched: Scheduler):
    """a (priority 5) admitted and stepped once, then b (priority 0) added: (a, b)."""
    a = with_priority("a", 7, 5)
    sched.add_request(a)
    fake_step(sched)
    b = with_priority("b", 8, 0, first_token=50)
    sched.add_request(b)
    return a, b


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_picks_the_lowest_priority_even_when_it_was_scheduled_first(policy):
    """5 usable blocks of 4 tokens: a (priority 5) runs first, then b (priority 0); when both need a new block and
    one is left, fcfs preempts the latest (b, itself the one asking), priority preempts a, whose token this step
    is taken back so that b gets a's blocks."""
    sched = make_scheduler(policy, num_blocks=6)
    a, b = low_then_high(sched)
    assert tokens_of(fake_step(sched)) == {"a": 1, "b": 8}
    out = fake_step(sched)
    victim, kept = (b, a) if policy == "fcfs" else (a, b)
    assert out.preempted == [victim] and tokens_of(out) == {kept.request_id: 1}
    assert out.num_batched_tokens == 1
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0 and victim.blocks == []
    assert sched.running == [kept] and list(sched.waiting) == [victim]
    assert kept.num_computed_tokens == 9  # counted once: the step scheduled it once


def test_a_victim_passed_over_this_step_is_preempted_too():
    """a (priority 5) has its max_tokens pending (async scheduling), so the step passes it over; b then needs a
    block and none is free: a, before b in the running list but given nothing, is the victim."""
    sched = make_scheduler("priority", num_blocks=5)
    a, b = low_then_high(sched)
    fake_step(sched)
    a.max_tokens = a.num_output_tokens
    assert sched.kv.num_free_blocks == 0
    out = fake_step(sched)
    assert out.preempted == [a] and tokens_of(out) == {"b": 1}
    assert sched.running == [b] and list(sched.waiting) == [a]


def test_a_preempted_request_waits_at_its_priority_place_not_at_the_front():
    sched = make_scheduler("priority", num_blocks=6, max_num_seqs=2)
    a, b = low_then_high(sched)
    fake_step(sched)
    waiting = [with_priority("x", 4, 1, first_token=100), with_priority("y", 4, 9, first_token=150)]
    for request in waiting:
        sched.add_request(request)
    out = fake_step(sched)  # max_num_seqs=2 kept x and y waiting; now a is preempted
    assert out.preempted == [a]
    assert ids(sched.waiting) == ["x", "a", "y"]


def test_finished_requests_leave_no_arrival_record():
    sched = make_scheduler("priority")
    requests = [with_priority(rid, 4, 0, first_token=10 * i) for i, rid in enumerate("abc")]
    for request in requests:
        sched.add_request(request)
    fake_step(sched)
    sched.finish(requests[0], RequestStatus.FINISHED_STOPPED)
    sched.finish(requests[1], RequestStatus.FINISHED_ABORTED)
    assert len(sched._arrival) == 1


# ---- engine and offline API ----------


@pytest.fixture(scope="module")
def priority_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), scheduling_policy="priority", max_num_seqs=1)


def test_the_engine_runs_the_most_urgent_waiting_request_first(priority_llm):
    engine = priority_llm.engine
    for rid, priority in [("late", 3), ("urgent", -2), ("normal", 0)]:
        engine.add_request(rid, {"prompt_token_ids": [5, 6, 7]}, GREEDY, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    assert order == ["urgent", "normal", "late"]


def test_generate_takes_one_priority_per_prompt_and_answers_in_prompt_order(priority_llm, tiny_llama_dir):
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(3)]
    ranked = priority_llm.generate(prompts, GREEDY, use_tqdm=False, priority=[2, 0, 1])
    plain = priority_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in ranked] == [p["prompt_token_ids"] for p in prompts]
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("priority, match", [
    ([0, 1], "got 2 priorities for 3 prompts"),
    (5, "priority must be a list of integers"),
    ([0, True, 0], "priority must be an integer"),
    ([0, 1.5, 0], "priority must be an integer"),
    ([0, 1 << 31, 0], "priority must be an integer in"),
])
def test_bad_priorities_are_value_errors_before_any_request_runs(priority_llm, priority, match):
    prompts = [{"prompt_token_ids": [5, 6, 7]}] * 3
    with pytest.raises(ValueError, match=match):
        priority_llm.generate(prompts, GREEDY, use_tqdm=False, priority=priority)
    assert not priority_llm.engine.has_unfinished_requests()


def test_fcfs_rejects_a_priority_other_than_zero_as_vllm_does(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir))
    prompts = [{"prompt_token_ids": [5, 6, 7]}] * 2
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate(prompts, GREEDY, use_tqdm=False, priority=[0, 1])
    assert len(llm.generate(prompts, GREEDY, use_tqdm=False, priority=[0, 0])) == 2
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.engine.add_request("x", {"prompt_token_ids": [5]}, GREEDY, priority=-1)
    assert not llm.engine.has_unfinished_requests()


def test_an_unknown_policy_is_a_value_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineArgs(model=str(tiny_llama_dir), scheduling_policy="lifo").create_engine_config()
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), scheduling_policy="Priority"))


def test_lora_requests_are_refused_and_none_passes(tiny_llama_dir, priority_llm):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    assert priority_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=None)
    assert priority_llm.generate([prompt] * 2, GREEDY, use_tqdm=False, lora_request=[None, None])
    for lora in (object(), [None, "adapter"]):
        with pytest.raises(ValueError, match="serves no LoRA adapters"):
            priority_llm.generate([prompt] * 2, GREEDY, use_tqdm=False, lora_request=lora)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        priority_llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, lora_request="adapter")
