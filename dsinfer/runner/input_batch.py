"""Turn a step plan and the worker's request table into a ForwardBatch and a SamplingBatch (vectorized with numpy,
one packed copy to the device each)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.core.plan import StepPlan
from dsinfer.runner.request_table import RequestState
from dsinfer.sampling.sampler import Penalties, SamplingBatch


@dataclass
class PromptLogprobRows:
    """Rows of this step's logits that score prompt tokens for one request."""

    request_id: str
    first_row: int  # row in the logits tensor
    target_ids: list[int]  # the prompt tokens these rows predict, in order
    num_logprobs: int  # top logprobs per position


@dataclass
class SampleRow:
    """One position that samples: a request's last token of the step, or one of its drafts' positions before it.

    The tokens before the sampled one are the request's tokens up to ``position - len(drafts)``, then ``drafts``
    (the drafts this row follows); ``position`` is the sampled token's index (the noise key).
    """

    state: RequestState
    position: int
    drafts: list[int]
    draft: int | None  # the draft token this row verifies (None: the last row of its request)

    @property
    def num_outputs(self) -> int:
        """Output tokens before the sampled one (what min_tokens counts)."""
        return self.position - self.state.num_prompt_tokens

    def output_ids(self) -> list[int]:
        """The output tokens before the sampled one; only for requests stepped synchronously (penalties, bad
        words), whose every token is on the host."""
        known = self.state.token_ids[self.state.num_prompt_tokens:self.position - len(self.drafts)]
        assert len(known) + len(self.drafts) == self.num_outputs, "a sampled row's output tokens are not all known"
        return known + self.drafts
@dataclass
class HostInputs:
    """The step's batch as host arrays (what ``ForwardBatch`` holds on the device), for the CUDA-graph path."""

    input_ids: np.ndarray  # [T] int64; placeholder rows hold 0 until filled on the device
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    state_slots: np.ndarray | None = None  # [B] int64: each sequence's state slot (models with per-sequence state)
    logits_indices: np.ndarray | None = None  # [S] int64: token rows whose logits are computed


@dataclass
class StepInputs:
    batch: ForwardBatch
    sample_rows: list[SampleRow]  # positions that sample, in batch order (a request's rows are adjacent)
    sample_logits_rows: torch.Tensor  # [S]: rows of the logits tensor to sample from
    prompt_rows: list[PromptLogprobRows]
    host: HostInputs | None = None
    # Async scheduling: token rows whose id was sampled by the step in flight (not yet on the host), and the
    # request each belongs to; the runner copies them from that step's sampled-token tensor on the device.
    placeholder_rows: list[int] = field(default_factory=list)
    placeholder_requests: list[str] = field(default_factory=list)
    states: list[RequestState] = field(default_factory=list)  # the scheduled requests, in batch order


_ALIGN = 16  # bytes: every packed array starts aligned for any element type


def to_device_packed(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several host arrays to the device in one copy: packed into one pinned byte buffer (each at a 16-byte aligned
    offset), copied non-blocking, and handed back as views of the device buffer with their own dtypes and shapes.
    A step's dozen small arrays then cost one copy instead of a dozen (each ~2 us of the GPU's stream, plus a
    pinned staging buffer and a copy call on the host). On CPU: the arrays themselves, as tensors."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    raw = host.numpy()
    for a, off in zip(arrays, offsets):
        raw[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
    packed = host.to(device, non_blocking=True)
    return [packed[off:off + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape)
            for a, off in zip(arrays, offsets)]


def _step_tokens(states: list[RequestState], plan: StepPlan, num_tokens: int
                 ) -> tuple[np.ndarray, list[int], list[str], list[list[SampleRow]]]:
    """Input ids of every scheduled chunk: its known tokens, placeholders (0) for the tokens a step in flight
    sampled, then its drafts; the placeholder rows and their requests; each request's sample rows (none for a
    prompt chunk that does not reach the end of the known tokens)."""
    ids: list[int] = []  # one conversion to an array at the end: a numpy store per request costs more
    rows: list[int] = []
    owners: list[str] = []
    samples: list[list[SampleRow]] = []
    all_drafts = plan.draft_token_ids
    for state, n in zip(states, plan.num_scheduled_tokens.values()):
        drafts = all_drafts.get(state.request_id, []) if all_drafts else []
        start, end = state.num_computed_tokens, state.num_computed_tokens + n - len(drafts)
        tokens = state.token_ids
        known = tokens[start:end]
        ids += known
        if len(known) < end - start:  # tokens a step in flight sampled
            for _ in range(len(known), end - start):
                rows.append(len(ids))
                owners.append(state.request_id)
                ids.append(0)
        ids += drafts
        if end >= len(tokens):  # reaches the last token (known or in flight): samples
            if drafts:
                samples.append([SampleRow(state, end + j, drafts[:j], drafts[j] if j < len(drafts) else None)
                                for j in range(len(drafts) + 1)])
            else:
                samples.append([SampleRow(state, end, [], None)])
        else:
            samples.append([])
    assert len(ids) == num_tokens, "the plan's token counts do not match its requests"
    return np.array(ids, dtype=np.int64), rows, owners, samples


def build_step_inputs(states: list[RequestState], plan: StepPlan, block_size: int, device: torch.device
                      ) -> StepInputs:
    """Flat batch of every scheduled chunk (``states``: the plan's requests, in its order); logits rows:
    prompt-logprob rows first, then one row per sampled position."""
    q_lens = np.fromiter((plan.num_scheduled_tokens[s.request_id] for s in states), dtype=np.int64,
                         count=len(states))
    starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
    cu = np.zeros(len(states) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    input_ids, placeholder_rows, placeholder_requests, samples = _step_tokens(states, plan, num_tokens)
    row = np.repeat(np.arange(len(states)), q_lens)
    positions = np.arange(num_tokens) - cu[:-1][row] + starts[row]
    tables, slots = _block_tables(states, 0, row, positions, block_size)

    prompt_rows, logits_rows = _prompt_logprob_rows(states, cu)
    sample_rows: list[SampleRow] = []
    for i, rows in enumerate(samples):
        logits_rows.extend(range(int(cu[i + 1]) - len(rows), int(cu[i + 1])))
        sample_rows.extend(rows)
    seq_lens = (starts + q_lens).astype(np.int32)
    state_slots = np.fromiter((s.state_slot for s in states), dtype=np.int64, count=len(states))
    has_slots = bool(state_slots.size and state_slots[0] >= 0)
    logits_indices = np.asarray(logits_rows, np.int64)
    host = HostInputs(input_ids, positions, slots, tables, cu.astype(np.int32), seq_lens,
                      state_slots if has_slots else None, logits_indices)

    num_prompt_rows = len(logits_rows) - len(sample_rows)
    # KV cache groups after the first (GPT-OSS's sliding layers): their tables and slots, in the same copy
    groups = [a for g in range(1, len(states[0].block_ids)) for a in _block_tables(states, g, row, positions,
                                                                                   block_size)]
    ids_d, pos_d, slots_d, tables_d, qsl_d, lens_d, logits_d, sample_d, state_d, *groups_d = to_device_packed(
        [input_ids, positions, slots, tables, host.query_start_loc, seq_lens, logits_indices,
         np.arange(num_prompt_rows, len(logits_rows), dtype=np.int64), state_slots, *groups], device)
    batch = ForwardBatch(
        input_ids=ids_d, positions=pos_d, slot_mapping=slots_d, block_tables=tables_d, query_start_loc=qsl_d,
        seq_lens=lens_d, logits_indices=logits_d, max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()),
        state_slots=state_d if has_slots else None,
        group_tables=list(zip(groups_d[0::2], groups_d[1::2])),
    )
    return StepInputs(batch, sample_rows, sample_d, prompt_rows, host, placeholder_rows, placeholder_requests,
                      states)


def _block_tables(states: list[RequestState], group: int, row: np.ndarray, positions: np.ndarray,
                  block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """KV cache group ``group``'s block tables [B, max_blocks] int32 (every request's block ids in one conversion,
    placed row by row through a mask: row-major, as they come) and the step's slot mapping [T] int64."""
    num_blocks = np.fromiter((len(s.block_ids[group]) for s in states), dtype=np.int64, count=len(states))
    tables = np.zeros((len(states), int(num_blocks.max())), dtype=np.int32)
    tables[np.arange(tables.shape[1]) < num_blocks[:, None]] = np.fromiter(
        itertools.chain.from_iterable(s.block_ids[group] for s in states), dtype=np.int32,
        count=int(num_blocks.sum()))
    slots = tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return tables, slots


def _prompt_logprob_rows(states: list[RequestState], cu: np.ndarray) -> tuple[list[PromptLogprobRows], list[int]]:
    prompt_rows: list[PromptLogprobRows] = []
    logits_rows: list[int] = []
    for i, state in enumerate(states):
        if not state.needs_prompt_logprobs:
            continue
        # logits at position p score prompt token p + 1; positions already scored (a resumed request) are skipped
        computed, n = state.num_computed_tokens, int(cu[i + 1] - cu[i])
        first = max(computed, state.num_prompt_logprobs_done)
        last = min(computed + n, state.num_prompt_tokens - 1)
        if first < last:
            prompt_rows.append(PromptLogprobRows(state.request_id, len(logits_rows),
                                                 state.token_ids[first + 1:last + 1], state.sampling.prompt_logprobs))
            base = int(cu[i]) - computed
            logits_rows.extend(range(base + first, base + last))
            state.num_prompt_logprobs_done = last
    return prompt_rows, logits_rows


def build_sampling_batch(rows: list[SampleRow], vocab_size: int, device: torch.device,
                         token_bitmask: np.ndarray | None = None, rejection: bool = False) -> SamplingBatch:
    """``rejection``: rows that verify a draft do so by rejection sampling (``SamplingBatch.draft_ids``) rather
    than by comparing it with their own sample."""
    params = [r.state.sampling for r in rows]
    temperature = [0.0 if p.greedy else p.temperature for p in params]
    top_k = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    logprobs = [p.logprobs for p in params if p.logprobs is not None]

    f32, i64 = np.float32, np.int64
    greedy_all = all(t == 0 for t in temperature)
    arrays = [np.asarray(temperature, f32), np.asarray(top_k, i64), np.asarray(top_p, f32), np.asarray(min_p, f32),
              np.fromiter((p.seed for p in params), i64, len(rows)),
              # the sampled token's position: after the known tokens and any still in flight (async scheduling)
              np.fromiter((r.position for r in rows), i64, len(rows))]
    rejection = rejection and not greedy_all and any(r.draft is not None for r in rows)
    if rejection:
        arrays.append(np.fromiter((-1 if r.draft is None else r.draft for r in rows), i64, len(rows)))
    if token_bitmask is not None:
        arrays.append(token_bitmask)
    temperature_d, top_k_d, top_p_d, min_p_d, seeds_d, positions_d, *rest = to_device_packed(arrays, device)
    drafts_d = rest.pop(0) if rejection else None
    bitmask_d = rest
    return SamplingBatch(
        temperature=temperature_d, top_k=top_k_d, top_p=top_p_d, min_p=min_p_d, seeds=seeds_d, positions=positions_d,
        all_greedy=greedy_all,
        use_top_k=not greedy_all and any(k < vocab_size for k in top_k),
        max_top_k=max(top_k),
        use_top_p=not greedy_all and any(p < 1.0 for p in top_p),
        use_min_p=not greedy_all and any(p > 0.0 for p in min_p),
        penalties=_penalties(rows, vocab_size, device) if any(p.uses_penalties for p in params) else None,
        logit_bias=_logit_bias(rows, vocab_size, device) if any(p.logit_bias for p in params) else None,
        banned=_banned(rows, vocab_size, device),
        num_logprobs=max(logprobs) if logprobs else None,
        token_bitmask=bitmask_d[0] if bitmask_d else None,
        draft_ids=drafts_d,
    )


def _penalties(rows: list[SampleRow], vocab_size: int, device: torch.device) -> Penalties:
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32)
    prompt_mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r.state.sampling.uses_penalties:
            out = r.output_ids()
            if out:
                counts[i].index_add_(0, torch.tensor(out), torch.ones(len(out)))
        prompt_mask[i, torch.tensor(r.state.prompt_token_ids)] = True
    params = [r.state.sampling for r in rows]
    return Penalties(
        repetition=torch.tensor([p.repetition_penalty for p in params], device=device),
        presence=torch.tensor([p.presence_penalty for p in params], device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
        output_counts=counts.to(device), prompt_mask=prompt_mask.to(device),
    )


def _logit_bias(rows: list[SampleRow], vocab_size: int, device: torch.device) -> torch.Tensor:
    bias = torch.zeros(len(rows), vocab_size, dtype=torch.float32)
    for i, r in enumerate(rows):
        for tid, value in r.state.sampling.logit_bias:
            bias[i, int(tid)] = float(value)
    return bias.to(device)


def _banned(rows: list[SampleRow], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """Tokens a row must not sample: its request's stop tokens while it has fewer than min_tokens outputs, every
    token outside ``allowed_token_ids``, and its bad words' last tokens where the output ends with the rest."""
    if not any(p.min_tokens_banned or p.bad_word_ids or p.allowed_token_ids for p in (r.state.sampling for r in rows)):
        return None  # most steps: nothing to build a row of
    banned_ids = {i: tokens for i, r in enumerate(rows) if (tokens := _banned_tokens(r))}
    allowed = {i: r.state.sampling.allowed_token_ids for i, r in enumerate(rows) if r.state.sampling.allowed_token_ids}
    if not banned_ids and not allowed:
        return None
    banned = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for i, ids in allowed.items():
        banned[i] = True
        banned[i, torch.tensor(ids)] = False
    for i, tokens in banned_ids.items():
        banned[i, torch.tensor(sorted(tokens))] = True
    return banned.to(device)


def _banned_tokens(row: SampleRow) -> set[int]:
    sampling, banned = row.state.sampling, set()
    if row.num_outputs < sampling.min_tokens:
        banned |= set(sampling.min_tokens_banned)
    for ids in sampling.bad_word_ids:
        if len(ids) == 1:
            banned.add(ids[0])
            continue
        # the engine steps such a request synchronously (its outputs are all on the host)
        prefix = list(ids[:-1])
        if row.output_ids()[-len(prefix):] == prefix:
            banned.add(ids[-1])
    return banned
