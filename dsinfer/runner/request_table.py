"""The worker's table of requests: what it keeps of each one between steps, updated from the step plan alone.

An entry is made from a plan's ``NewRequestData`` (made again after a preemption) and dropped when a plan names
the request finished or preempted. Invariant: ``token_ids`` is a prefix of the engine's ``all_token_ids`` for that
request (tokens sampled by a step still in flight are missing until a later plan sends them).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsinfer.core.plan import RequestSampling, StepPlan


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: RequestSampling
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int  # before the step being built
    num_prompt_logprobs_done: int  # prompt positions already scored (each prompt position is scored once)
    state_slot: int = -1  # its state slot (models with per-sequence state)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.sampling.prompt_logprobs is not None


class RequestTable:
    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def apply(self, plan: StepPlan) -> list[RequestState]:
        """Update the table from ``plan``; -> the scheduled requests' states, in batch order."""
        for rid in plan.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in plan.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = RequestState(
                new.request_id, list(new.token_ids), new.num_prompt_tokens, new.sampling,
                [list(ids) for ids in new.block_ids], new.num_computed_tokens, new.num_prompt_logprobs_done,
                new.state_slot)
        cached = plan.cached_requests
        requests = self.requests
        for i, (rid, tokens, computed) in enumerate(zip(cached.request_ids, cached.new_token_ids,
                                                        cached.num_computed_tokens)):
            state = requests.get(rid)
            if state is None:
                raise ValueError(f"the plan updates request {rid!r}, which this worker has no entry for (it was "
                                 "never sent, or was dropped)")
            if tokens:
                state.token_ids += tokens
            for blocks, kept, new_ids in zip(state.block_ids, cached.num_kept_blocks, cached.new_block_ids):
                if kept[i] < len(blocks):
                    del blocks[kept[i]:]
                if new_ids[i]:
                    blocks += new_ids[i]
            state.num_computed_tokens = computed
        return [self.requests[rid] for rid in plan.num_scheduled_tokens]
