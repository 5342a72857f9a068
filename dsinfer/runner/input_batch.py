"""Turn a SchedulerOutput into a ForwardBatch and a SamplingBatch (vectorized with numpy, one packed copy to the
device each)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.sampling.sampler import Penalties, SamplingBatch
from dsinfer.scheduler.scheduler import ScheduledRequest


@dataclass
class PromptLogprobRows:
    """Rows of this step's logits that score prompt tokens for one request."""

    item: ScheduledRequest
    first_row: int  # row in the logits tensor
    target_ids: list[int]  # the prompt tokens these rows predict, in order


@dataclass
class HostInputs:
    """The step's batch as host arrays (what ``ForwardBatch`` holds on the device), for the CUDA-graph path."""

    input_ids: np.ndarray  # [T] int64; placeholder rows hold 0 until filled on the device
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32


@dataclass
class StepInputs:
    batch: ForwardBatch
    sample_items: list[ScheduledRequest]  # requests that sample, in sampling-row order
    sample_rows: torch.Tensor  # [S]: rows of the logits tensor to sample from
    prompt_rows: list[PromptLogprobRows]
    host: HostInputs | None = None
    # Async scheduling: token rows whose id was sampled by the step in flight (not yet on the host), and the
    # request each belongs to; the runner copies them from that step's sampled-token tensor on the device.
    placeholder_rows: list[int] = field(default_factory=list)
    placeholder_requests: list[str] = field(default_factory=list)


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


def _token_ids(items: list[ScheduledRequest], num_tokens: int) -> tuple[np.ndarray, list[int], list[str]]:
    """Input ids of every scheduled chunk; a chunk reaching past the known tokens ends in a placeholder (0)."""
    ids = np.zeros(num_tokens, dtype=np.int64)
    rows: list[int] = []
    owners: list[str] = []
    row = 0
    for s in items:
        known = s.request.all_token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens]
        ids[row:row + len(known)] = known
        for missing in range(len(known), s.num_new_tokens):
            rows.append(row + missing)
            owners.append(s.request.request_id)
        row += s.num_new_tokens
    return ids, rows, owners


def build_step_inputs(items: list[ScheduledRequest], block_size: int, device: torch.device) -> StepInputs:
    """Flat batch of every scheduled chunk; logits rows: prompt-logprob rows first, then one row per sampler."""
    q_lens = np.fromiter((s.num_new_tokens for s in items), dtype=np.int64, count=len(items))
    starts = np.fromiter((s.num_computed_tokens for s in items), dtype=np.int64, count=len(items))
    cu = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    input_ids, placeholder_rows, placeholder_requests = _token_ids(items, num_tokens)
    row = np.repeat(np.arange(len(items)), q_lens)
    positions = np.arange(num_tokens) - cu[:-1][row] + starts[row]
    tables = np.zeros((len(items), max(len(s.request.blocks) for s in items)), dtype=np.int32)
    for i, s in enumerate(items):
        blocks = s.request.blocks
        tables[i, :len(blocks)] = np.fromiter((b.block_id for b in blocks), dtype=np.int32, count=len(blocks))
    slots = tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size

    prompt_rows, logits_rows = _prompt_logprob_rows(items, cu)
    sample_idx = [i for i, s in enumerate(items) if s.samples]
    logits_rows.extend(int(cu[i + 1]) - 1 for i in sample_idx)
    seq_lens = (starts + q_lens).astype(np.int32)
    host = HostInputs(input_ids, positions, slots, tables, cu.astype(np.int32), seq_lens)

    num_prompt_rows = len(logits_rows) - len(sample_idx)
    ids_d, pos_d, slots_d, tables_d, qsl_d, lens_d, logits_d, sample_d = to_device_packed(
        [input_ids, positions, slots, tables, host.query_start_loc, seq_lens, np.asarray(logits_rows, np.int64),
         np.arange(num_prompt_rows, len(logits_rows), dtype=np.int64)], device)
    batch = ForwardBatch(
        input_ids=ids_d, positions=pos_d, slot_mapping=slots_d, block_tables=tables_d, query_start_loc=qsl_d,
        seq_lens=lens_d, logits_indices=logits_d, max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()),
    )
    return StepInputs(batch, [items[i] for i in sample_idx], sample_d, prompt_rows, host, placeholder_rows,
                      placeholder_requests)


def _prompt_logprob_rows(items: list[ScheduledRequest], cu: np.ndarray) -> tuple[list[PromptLogprobRows], list[int]]:
    prompt_rows: list[PromptLogprobRows] = []
    logits_rows: list[int] = []
    for i, s in enumerate(items):
        req = s.request
        if not req.needs_prompt_logprobs:
            continue
        # logits at position p score prompt token p + 1; positions already scored (a resumed request) are skipped
        first = max(s.num_computed_tokens, len(req.prompt_logprobs) - 1)
        last = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
        if first < last:
            prompt_rows.append(PromptLogprobRows(s, len(logits_rows), req.prompt_token_ids[first + 1:last + 1]))
            base = int(cu[i]) - s.num_computed_tokens
            logits_rows.extend(range(base + first, base + last))
    return prompt_rows, logits_rows


def build_sampling_batch(items: list[ScheduledRequest], vocab_size: int, device: torch.device,
                         token_bitmask: torch.Tensor | None = None) -> SamplingBatch:
    params = [s.request.params for s in items]
    temperature = [0.0 if p.greedy else p.temperature for p in params]
    top_k = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    logprobs = [p.logprobs for p in params if p.logprobs is not None]

    f32, i64 = np.float32, np.int64
    greedy_all = all(t == 0 for t in temperature)
    arrays = [np.asarray(temperature, f32), np.asarray(top_k, i64), np.asarray(top_p, f32), np.asarray(min_p, f32),
              np.fromiter((s.request.seed for s in items), i64, len(items)),
              # the sampled token's position: after the known tokens and any still in flight (async scheduling)
              np.fromiter((s.request.num_tokens + s.request.num_pending for s in items), i64, len(items))]
    if token_bitmask is not None:
        arrays.append(token_bitmask.numpy())
    temperature_d, top_k_d, top_p_d, min_p_d, seeds_d, positions_d, *bitmask_d = to_device_packed(arrays, device)
    return SamplingBatch(
        temperature=temperature_d, top_k=top_k_d, top_p=top_p_d, min_p=min_p_d, seeds=seeds_d, positions=positions_d,
        all_greedy=greedy_all,
        use_top_k=not greedy_all and any(k < vocab_size for k in top_k),
        max_top_k=max(top_k),
        use_top_p=not greedy_all and any(p < 1.0 for p in top_p),
        use_min_p=not greedy_all and any(p > 0.0 for p in min_p),
        penalties=_penalties(items, vocab_size, device) if any(p.uses_penalties for p in params) else None,
        logit_bias=_logit_bias(items, vocab_size, device) if any(p.logit_bias for p in params) else None,
        banned=_banned(items, vocab_size, device),
        num_logprobs=max(logprobs) if logprobs else None,
        token_bitmask=bitmask_d[0] if bitmask_d else None,
    )


def _penalties(items: list[ScheduledRequest], vocab_size: int, device: torch.device) -> Penalties:
    counts = torch.zeros(len(items), vocab_size, dtype=torch.float32)
    prompt_mask = torch.zeros(len(items), vocab_size, dtype=torch.bool)
    for i, s in enumerate(items):
        out = s.request.output_token_ids
        if out:
            counts[i].index_add_(0, torch.tensor(out), torch.ones(len(out)))
        prompt_mask[i, torch.tensor(s.request.prompt_token_ids)] = True
    params = [s.request.params for s in items]
    return Penalties(
        repetition=torch.tensor([p.repetition_penalty for p in params], device=device),
        presence=torch.tensor([p.presence_penalty for p in params], device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
        output_counts=counts.to(device), prompt_mask=prompt_mask.to(device),
    )


def _logit_bias(items: list[ScheduledRequest], vocab_size: int, device: torch.device) -> torch.Tensor:
    bias = torch.zeros(len(items), vocab_size, dtype=torch.float32)
    for i, s in enumerate(items):
        for tid, value in (s.request.params.logit_bias or {}).items():
            bias[i, int(tid)] = float(value)
    return bias.to(device)


def _banned(items: list[ScheduledRequest], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """Tokens a request must not sample now: its stop tokens while it has fewer than min_tokens outputs, every
    token outside ``allowed_token_ids``, and its bad words' last tokens where the output ends with the rest."""
    rows = {i: tokens for i, s in enumerate(items) if (tokens := _banned_tokens(s.request))}
    allowed = {i: s.request.params.allowed_token_ids for i, s in enumerate(items) if s.request.params.allowed_token_ids}
    if not rows and not allowed:
        return None
    banned = torch.zeros(len(items), vocab_size, dtype=torch.bool)
    for i, ids in allowed.items():
        banned[i] = True
        banned[i, torch.tensor(ids)] = False
    for i, tokens in rows.items():
        banned[i, torch.tensor(sorted(tokens))] = True
    return banned.to(device)


def _banned_tokens(req) -> set[int]:
    params, banned = req.params, set()
    if req.num_output_tokens + req.num_pending < params.min_tokens:
        # every stop id, the EOS ids with ignore_eos too (vLLM's all_stop_token_ids)
        banned |= set(params.stop_token_ids) | req.eos_token_ids
    for ids in req.bad_word_ids:
        if len(ids) == 1:
            banned.add(ids[0])
            continue
        # the engine steps such a request synchronously (its outputs are all on the host)
        assert not req.num_pending, "bad words longer than a token need the request's outputs on the host"
        prefix = list(ids[:-1])
        if req.output_token_ids[-len(prefix):] == prefix:
            banned.add(ids[-1])
    return banned
