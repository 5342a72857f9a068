"""The step plan: what the engine tells a worker to compute in one step, as plain data.

The scheduler builds one ``StepPlan`` per step; an executor hands it to the worker in this process or sends it
(``core.wire``: msgpack, never pickle) to worker processes. The worker keeps its own table of per-request state
(``runner.request_table``) and updates it from the plan alone, so a plan never refers to engine objects.

Invariants:
- a request appears in ``new_requests`` the first time it is scheduled and again after every preemption (its
  worker entry was dropped); otherwise, while it runs, in ``cached_requests``; never in both;
- ``num_scheduled_tokens`` gives every scheduled request its tokens this step, in batch order (new and cached
  requests interleave in the order the scheduler picked them); a request's tokens are its known tokens from
  ``num_computed_tokens`` on, then placeholders for tokens sampled by a step still in flight, then its
  ``draft_token_ids`` (the last ``len(drafts)`` of its scheduled tokens);
- token ids the worker is sent are appended to its copy of the request's tokens: a request's copy is always a
  prefix of the engine's ``all_token_ids``;
- block ids are per KV cache group (one list per group; every model has one group today);
- ``finished_req_ids`` and ``preempted_req_ids`` name requests whose worker entry is dropped before the step;
- ``kv_loads`` fill blocks of requests that are not scheduled until their load is reported done; ``kv_saves``
  copy blocks after the step's forward, so they see its KV, and before any later step's writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class SamplingRules:
    """What the user's SamplingParams and the worker's RequestSampling derive alike from their fields."""

    temperature: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class RequestSampling(SamplingRules):
    """How the worker samples one request (a plain copy of what it needs from the user's SamplingParams)."""

    temperature: float  # below 1e-5: greedy
    top_k: int  # -1: off
    top_p: float
    min_p: float
    seed: int  # sampling noise is keyed by (seed, position)
    logprobs: int | None = None  # top logprobs per sampled token (None: none)
    prompt_logprobs: int | None = None  # top logprobs per prompt token (None: none)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[list[float]] = field(default_factory=list)  # [token id, bias] pairs
    allowed_token_ids: list[int] = field(default_factory=list)  # empty: every token
    min_tokens: int = 0
    min_tokens_banned: list[int] = field(default_factory=list)  # stop and EOS ids, banned until min_tokens outputs
    bad_word_ids: list[list[int]] = field(default_factory=list)  # token sequences whose last token is banned

    @classmethod
    def of(cls, params: Any, seed: int, eos_token_ids: frozenset[int] | set[int] = frozenset(),
           bad_word_ids: tuple[tuple[int, ...], ...] = ()) -> RequestSampling:
        """From a SamplingParams (read by attribute: core imports nothing of the engine)."""
        return cls(
            temperature=float(params.temperature), top_k=int(params.top_k), top_p=float(params.top_p),
            min_p=float(params.min_p), seed=seed, logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
            repetition_penalty=float(params.repetition_penalty), presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            logit_bias=[[int(t), float(b)] for t, b in (params.logit_bias or {}).items()],
            allowed_token_ids=list(params.allowed_token_ids or ()), min_tokens=int(params.min_tokens),
            # every stop id, the EOS ids with ignore_eos too (vLLM's all_stop_token_ids)
            min_tokens_banned=sorted(set(params.stop_token_ids) | set(eos_token_ids)) if params.min_tokens else [],
            bad_word_ids=[list(ids) for ids in bad_word_ids],
        )


@dataclass
class NewRequestData:
    """A request the worker has no entry for: everything it needs, once."""

    request_id: str
    token_ids: list[int]  # prompt + the outputs known so far (a resumed request's too)
    num_prompt_tokens: int
    sampling: RequestSampling
    block_ids: list[list[int]]  # per KV cache group, in token order
    num_computed_tokens: int  # tokens whose KV is already cached (a prefix-cache hit), before this step
    num_prompt_logprobs_done: int = 0  # prompt positions already scored (a resumed request's)
    state_slot: int = -1  # its state slot, held until it finishes or is preempted (-1: the model keeps no state)


@dataclass
class CachedRequestData:
    """The requests the worker already has, column-wise (row ``i`` of every list is ``request_ids[i]``): only what
    changed since each one's last plan. Columns rather than an object per request, as vLLM's: a B=256 decode step
    then appends to five lists instead of building 256 objects (and msgpack sends five arrays)."""

    request_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # tokens learned since its tokens were last sent
    # per KV cache group, per row: block ids appended after the first ``num_kept_blocks[g][i]`` of the worker's
    new_block_ids: list[list[list[int]]] = field(default_factory=lambda: [[]])
    num_kept_blocks: list[list[int]] = field(default_factory=lambda: [[]])  # fewer than sent after a rollback
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step (rolled back after rejections)

    def __len__(self) -> int:
        return len(self.request_ids)

    def append(self, request_id: str, new_token_ids: list[int], new_block_ids: list[list[int]],
               num_kept_blocks: list[int], num_computed_tokens: int) -> None:
        """One request's row (``new_block_ids`` / ``num_kept_blocks``: one entry per group)."""
        self.request_ids.append(request_id)
        self.new_token_ids.append(new_token_ids)
        for column, ids in zip(self.new_block_ids, new_block_ids, strict=True):
            column.append(ids)
        for column, kept in zip(self.num_kept_blocks, num_kept_blocks, strict=True):
            column.append(kept)
        self.num_computed_tokens.append(num_computed_tokens)


@dataclass
class KVLoad:
    """Read a request's stored grains into its blocks (``kvstore``): grain ``i`` of ``keys`` fills
    ``block_ids[i * blocks_per_grain:(i + 1) * blocks_per_grain]``, -1 for a block it already holds (a GPU prefix
    hit). The worker reports how many leading grains it filled (``RunnerOutput.kv_loads_done``).

    Sliding-window groups: ``window_key`` names the bounded window state at the load's last boundary, read after
    the grains into ``window_block_ids`` (each sliding group's window blocks, ``kv_cache_spec.window_blocks`` of
    them, -1 for one already held or past the state); without it the load fills nothing (reported as 0 tokens)."""

    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    window_key: bytes | None = None
    window_block_ids: list[int] = field(default_factory=list)
    window_tokens: int = 0  # with a window key: the tokens the whole load serves (reported when it all came back)


@dataclass
class KVSave:
    """After this step's forward, copy full grains out of their blocks into the store (write-behind): grain
    ``i`` of ``keys`` is ``block_ids[i * blocks_per_grain:(i + 1) * blocks_per_grain]``."""

    keys: list[bytes]
    block_ids: list[int]
    ttl_s: float  # the request's traffic class's TTL
    # sliding-window groups: per grain boundary saved, its window state's key and each sliding group's window
    # blocks (-1 padding); plain lists, as they cross the wire
    window_keys: list[bytes] = field(default_factory=list)
    window_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class StepPlan:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # batch order; drafts included
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # per request with drafts to verify
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Structured outputs: packed int32 token bitmask [rows, ceil(V / 32)], one row per sampled position of the
    # step in batch order (-1 rows: unconstrained); None when no sampled row is constrained
    grammar_bitmask: np.ndarray | None = None
    kv_loads: list[KVLoad] = field(default_factory=list)  # started this step (the KV store's loads)
    kv_saves: list[KVSave] = field(default_factory=list)  # grains this step or an earlier one filled
    # a step with nothing to compute still runs to report loads done; the worker then waits this long for one
    kv_poll_s: float = 0.0
    # EPLB: the worker returns its expert load window (``RunnerOutput.expert_load``) with this step's output
    want_expert_load: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
