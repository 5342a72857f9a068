"""Request: one sequence's state as the scheduler and engine see it (tokens, progress, KV blocks, status)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from dsinfer.engine.outputs import PositionLogprobs
from dsinfer.engine.sampling_params import SamplingParams
from dsinfer.kvcache.block_pool import BlockHash, KVCacheBlock


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """``num_computed_tokens`` chases ``num_tokens`` (prompt + outputs); the scheduler closes the gap each step.

    A request samples a token in a step whose scheduled chunk reaches ``num_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # effective sampling seed (the user's, or one drawn at arrival): noise is keyed by (seed, position)
    max_tokens: int  # effective limit on output tokens
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    parent_id: str | None = None  # n > 1: the user's request id, this is sample ``index``
    index: int = 0
    priority: int = 0  # the "priority" scheduling policy's key: lower is admitted first, preempted last

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0  # tokens sampled by steps still in flight (async scheduling), not yet in all_token_ids
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not yet scheduled)
    num_preemptions: int = 0
    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    grammar: Any = None  # structured outputs: a dsinfer.structured.matcher.RequestGrammar (None: unconstrained)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences (bad_word_token_ids)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

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
        return self.params.prompt_logprobs is not None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
