"""Request: one sequence's scheduling state as the engine, the scheduler and the KV cache manager share it.

It lives on the engine's side only: the worker never sees a ``Request``, it gets the plain-data step plan
(``core.plan``) and keeps its own table of what it needs. Who writes what:
- the engine creates it and appends sampled tokens (``append_token``), sets ``status`` on stops and aborts;
- the scheduler moves ``num_computed_tokens`` and ``status`` (waiting / running / preempted), and
  ``num_tokens_sent`` (how many of ``all_token_ids`` the worker has been sent);
- the KV cache manager owns ``blocks``, ``group_blocks``, ``num_freed_blocks``, ``block_hashes`` and
  ``state_slot``; the scheduler's store side the ``store_*`` fields and ``num_stored_grains``.
Invariants: ``all_token_ids == prompt_token_ids + output_token_ids``;
``num_computed_tokens <= num_tokens + num_pending + len(draft_token_ids)``; ``num_tokens_sent <= num_tokens``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from dsinfer.core.plan import RequestSampling


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted with blocks, its KV being read from the KV store; not scheduled until done
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                               RequestStatus.FINISHED_ABORTED})


@dataclass(eq=False)
class Request:
    """``num_computed_tokens`` chases ``num_tokens`` (prompt + outputs); the scheduler closes the gap each step.

    A request samples in a step whose scheduled chunk reaches ``num_tokens`` (plus its pending tokens): one token,
    or 1 + k when the step also verifies its k ``draft_token_ids``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: Any  # the user's engine.SamplingParams: stops, detokenizing, output kind (the engine reads it)
    seed: int  # effective sampling seed (the user's, or one drawn at arrival): noise is keyed by (seed, position)
    max_tokens: int  # effective limit on output tokens
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    parent_id: str | None = None  # n > 1: the user's request id, this is sample ``index``
    index: int = 0
    priority: int = 0  # the "priority" scheduling policy's key: lower is admitted first, preempted last
    # what the worker samples with, sent once in the plan that first schedules it (None: made from ``params``)
    sampling: RequestSampling | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0  # tokens sampled by steps still in flight (async scheduling), not yet in all_token_ids
    num_tokens_sent: int = 0  # all_token_ids[:num_tokens_sent] are in the worker's table (0: it has no entry)
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not yet scheduled)
    num_preemptions: int = 0
    # draft tokens to verify in the next step (a drafter's proposal); the step that schedules them clears this
    draft_token_ids: list[int] = field(default_factory=list)
    # per draft, its predicted acceptance given every draft before it is kept (confidence scheduling reads it)
    draft_confidence: list[float] = field(default_factory=list)
    blocks: list[Any] = field(default_factory=list)  # kvcache.KVCacheBlock, in token order (the manager's)
    # KV cache groups after the first (models whose layers keep several layouts, e.g. GPT-OSS's sliding layers):
    # one list per group, each as long as ``blocks``; a sliding group's entries behind its window are the null block
    group_blocks: list[list[Any]] = field(default_factory=list)
    num_freed_blocks: list[int] = field(default_factory=list)  # per group: leading entries given back (sliding)
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of the full blocks of all_token_ids
    state_slot: int = -1  # the per-sequence state slot it holds while running (-1: none; ``StateSlotSpec``)
    num_offered_blocks: int = 0  # blocks[:n] were offered to the prefix cache (each once; reset when freed)
    stop_reason: int | str | None = None
    logprobs: list[Any] = field(default_factory=list)  # engine.outputs.PositionLogprobs, one per output token
    prompt_logprobs: list[Any] = field(default_factory=list)  # the same per prompt token (first: None)
    cumulative_logprob: float = 0.0
    first_scheduled_time: float | None = None  # time.monotonic(), as every request time
    first_token_time: float | None = None
    grammar: Any = None  # structured outputs: a dsinfer.structured.matcher.RequestGrammar (None: unconstrained)
    # the KV store (``kvstore``): its traffic class's TTL, its grain keys so far, the grains stored or sent to be
    # saved, and whether the store is asked at admission (not again after a load came back short)
    kv_ttl_s: float = 0.0
    store_keys: list[bytes] = field(default_factory=list)
    num_stored_grains: int = 0
    store_lookup: bool = True

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if self.sampling is None:
            self.sampling = RequestSampling.of(self.params, self.seed, self.eos_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """prompt_logprobs asked for: no prefix-cache hit (every prompt position is scored)."""
        return self.sampling.prompt_logprobs is not None

    @property
    def waits_for_grammar(self) -> bool:
        """Its grammar is still compiling (or failed to and is about to be aborted): not admitted yet."""
        return self.grammar is not None and (not self.grammar.ready or self.grammar.error is not None)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
