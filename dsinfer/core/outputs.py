"""What a worker returns for one step, as plain data (``RunnerOutput``).

Invariants: ``sampled_token_ids[r]`` holds 1 + (accepted drafts) tokens for a request that sampled this step,
in order (the last one is the model's own token after the accepted drafts); a request that did not reach its last
known token this step (a prompt chunk) is absent. ``logprobs[r]``, when asked for, has one entry per sampled token.
``prompt_logprobs[r]`` has one entry per prompt position scored this step, in order.
``draft_token_ids[r]`` (MTP drafting) are the drafts the worker proposes to follow the request's tokens after this
step's ``sampled_token_ids[r]``, ``draft_confidence[r]`` the drafter's probability of each (same length).
``kv_loads_done[r]``: request ``r``'s store load finished this step (its blocks hold that many tokens' KV).
``expert_load`` (EPLB, when the plan asked: ``StepPlan.want_expert_load``): the expert-load counters, tokens
routed to each physical expert of each MoE layer over the load window, [layer][physical expert] (physical ids
rank-major: rank r holds [r P / R, (r + 1) P / R)).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprob data of one position: candidate ids (scored token first), their logprobs, the scored token's rank."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_confidence: dict[str, list[float]] = field(default_factory=dict)
    # the KV store: tokens each finished load filled (its leading grains; fewer than asked: recompute the rest)
    kv_loads_done: dict[str, int] = field(default_factory=dict)
    kv_host_events: list[list] = field(default_factory=list)  # [key, present] changes of the host tier, in order
    kv_store_counters: dict[str, float] = field(default_factory=dict)  # the worker's totals (``kvstore.counters``)
    expert_load: list[list[float]] | None = None  # EPLB's window of expert-load counters (see the module doc)
    eplb_stats: dict[str, int] | None = None  # with it, rank 0's rebalance totals (``eplb.balancer.RebalanceStats``)
