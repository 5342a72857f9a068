"""V4's batched decode path: every sequence of the step has the same ``q`` tokens (1, or 1 + drafts to verify).

The per-sequence path (``step.V4Step``) reads each sequence's bounds on the host. Here the step's T = B * q token
rows are viewed [B, q] and every bound lives on the device: sequence b's tokens are positions
``num_computed[b] .. num_computed[b] + q - 1`` with ``num_computed = seq_lens - q``. Shapes depend only on B, q
and the host-side bound ``max_seq_len`` (a fixed bound inside a CUDA graph), so a step can be captured.

- window: each sequence's last ``window - 1`` positions before the step from its ring, then the step's q rows
  (L = window - 1 + q keys per sequence, masked per query to t - window + 1 .. t);
- compressed entries: the first ``max_seq_len // rate`` entries by block table, masked per query to
  w < (t + 1) // rate (HCA); CSA scores the indexer's keys of those and gathers each query's top-k entries
  (``index_topk`` of them, a fixed shape, masked where the query sees fewer);
- compressors: the <= ceil(q / rate) windows a step can close, pooled from ring rows and step rows.

Padding rows (seq_len 0, or state slot -1, as a padded graph batch has) compute finite values from clamped
indices and write nothing (``ops.masked_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.models.deepseek_v4.rope import apply_rope
from dsinfer.ops.masked_rows import copy_rows_where


@dataclass(frozen=True)
class DecodeStep:
    q: int  # tokens per sequence
    max_seq_len: int  # host-side bound on every seq_len
    valid: torch.Tensor  # [B] bool: a real sequence (seq_len > 0 and a state slot)
    slots: torch.Tensor  # [B] int64 state slots, clamped to >= 0
    num_computed: torch.Tensor  # [B] int64 tokens before the step (0 for padding)
    block_tables: torch.Tensor  # [B, max_blocks] int64

    @classmethod
    def of(cls, batch: ForwardBatch) -> DecodeStep:
        return batch.derive("deepseek_v4_decode", lambda: cls.build(batch))

    @classmethod
    def build(cls, batch: ForwardBatch) -> DecodeStep:
        if batch.state_slots is None:
            raise ValueError("DeepSeek-V4 layers need the batch's state slots (ForwardBatch.state_slots)")
        q, seq_lens = batch.max_query_len, batch.seq_lens.long()
        valid = (seq_lens >= q) & (batch.state_slots >= 0)
        return cls(q, batch.max_seq_len, valid, batch.state_slots.long().clamp(min=0),
                   torch.where(valid, seq_lens - q, 0), batch.block_tables.long())

    @property
    def num_seqs(self) -> int:
        return self.valid.shape[0]

    def query_positions(self) -> torch.Tensor:
        """[B, q]: each query's position (padding: 0 .. q - 1)."""
        return self.num_computed.unsqueeze(-1) + torch.arange(self.q, device=self.valid.device)

    @property
    def entries_end(self) -> torch.Tensor:
        """[B]: tokens known after the step (0 for padding: it sees no compressed entry)."""
        return torch.where(self.valid, self.num_computed + self.q, 0)

    def entry_addresses(self, windows: torch.Tensor, per_block: int) -> torch.Tensor:
        """Flat rows (of a cache viewed [blocks * per_block, width]) of entries ``windows`` [B, K] (clamped to the
        block table)."""
        col = (windows.clamp(min=0) // per_block).clamp(max=self.block_tables.shape[1] - 1)
        return self.block_tables.gather(1, col) * per_block + windows.clamp(min=0) % per_block


def uniform_q(batch: ForwardBatch, ring_rows: int, window: int) -> bool:
    """Whether the step takes the batched path: every sequence has ``max_query_len`` rows (known from shapes on
    the host) and q rows fit the rings' draft allowance (``ring_rows - window``)."""
    q = batch.max_query_len
    return batch.num_tokens == batch.num_seqs * q and 1 <= q <= 1 + ring_rows - window


def read_rows(ring: torch.Tensor, step: DecodeStep, step_rows: torch.Tensor, positions: torch.Tensor
              ) -> torch.Tensor:
    """Source rows at ``positions`` [B, L]: before the step from the slot's ring [slots, R, width] (row p % R),
    from the step's rows [B, q, width] after -> [B, L, width] in ``step_rows``' dtype (any value where p < 0)."""
    nc = step.num_computed.unsqueeze(-1)
    ring_vals = ring[step.slots.unsqueeze(-1), positions % ring.shape[1]].to(step_rows.dtype)
    own = (positions - nc).clamp(0, step.q - 1)
    step_vals = step_rows.gather(1, own.unsqueeze(-1).expand(-1, -1, step_rows.shape[-1]))
    return torch.where((positions < nc).unsqueeze(-1), ring_vals, step_vals)


def write_rows(ring: torch.Tensor, step: DecodeStep, step_rows: torch.Tensor) -> None:
    """Keep the step's rows [B, q, width] at their positions' ring rows (padding writes nothing)."""
    rows = ring.shape[1]
    at = step.slots.unsqueeze(-1) * rows + step.query_positions() % rows
    keep = step.valid.unsqueeze(-1).expand(-1, step.q)
    copy_rows_where(ring.view(-1, ring.shape[-1]), at.flatten(), step_rows.flatten(0, 1), keep.flatten())


def window_keys(ring: torch.Tensor, step: DecodeStep, kv: torch.Tensor, window: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's window keys [B, L, D] (positions num_computed - window + 1 .. end - 1) and which each
    query sees [B, q, L]."""
    nc = step.num_computed.unsqueeze(-1)
    key_pos = nc + torch.arange(-(window - 1), step.q, device=kv.device)  # [B, L]
    keys = read_rows(ring, step, kv, key_pos)
    t = step.query_positions().unsqueeze(-1)
    kp = key_pos.unsqueeze(1)
    return keys, (kp >= 0) & (kp <= t) & (kp > t - window)


def gather_entries(entries: torch.Tensor, step: DecodeStep, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``max_seq_len // rate`` entries of each sequence [B, M, width] (zero where not yet known) and
    which each query may see [B, q, M] (w < (t + 1) // rate)."""
    m = max(step.max_seq_len // rate, 1)
    w = torch.arange(m, device=entries.device).expand(step.num_seqs, -1)
    flat = entries.view(-1, entries.shape[-1])
    known = w < (step.entries_end // rate).unsqueeze(-1)
    rows = torch.where(known.unsqueeze(-1), flat[step.entry_addresses(w, entries.shape[1])], 0)
    visible = w.unsqueeze(1) < ((step.query_positions() + 1) // rate).unsqueeze(-1)
    return rows, visible & known.unsqueeze(1)


def compress(comp, source: torch.Tensor, step: DecodeStep, ring: torch.Tensor, entries: torch.Tensor) -> None:
    """``Compressor.step`` batched: pool the windows the step closes into the paged ``entries`` and keep the
    step's source rows ([B * q, 2 * width]) in the rings."""
    rate, width = comp.rate, source.shape[-1] // 2
    src = source.view(step.num_seqs, step.q, -1)
    first = step.num_computed // rate
    windows = first.unsqueeze(-1) + torch.arange(-(-step.q // rate), device=source.device)  # [B, K]
    closed = step.valid.unsqueeze(-1) & (windows < (step.entries_end // rate).unsqueeze(-1))
    span = (2 if comp.overlap else 1) * rate
    start = (windows - 1) * rate if comp.overlap else windows * rate
    pos = start.unsqueeze(-1) + torch.arange(span, device=source.device)  # [B, K, S]
    b, k = windows.shape
    rows = read_rows(ring, step, src, pos.view(b, -1)).view(b, k, span, -1)
    kv, gate = rows[..., :width], rows[..., width:] + comp.ape.repeat(span // rate, 1)
    gate = gate.masked_fill((pos < 0).unsqueeze(-1), float("-inf"))
    if comp.overlap:  # rows of window w - 1 give the first series, those of window w the second
        d = comp.dim
        kv = torch.cat((kv[:, :, :rate, :d], kv[:, :, rate:, d:]), dim=2)
        gate = torch.cat((gate[:, :, :rate, :d], gate[:, :, rate:, d:]), dim=2)
    pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
    cos, sin = comp.rope.angles((windows * rate).flatten())
    new = apply_rope(comp.norm(pooled.flatten(0, 1)), cos, sin)
    at = step.entry_addresses(windows, entries.shape[1]).flatten()
    copy_rows_where(entries.view(-1, entries.shape[-1]), at, new, closed.flatten())
    write_rows(ring, step, src)


def select(indexer, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``Indexer.select`` batched: q [B, q, H, D], weights [B, q, H], keys [B, M, D], visible [B, q, M] -> the
    chosen entries of each query as indices [B, q, K] (K = min(index_topk, M): a fixed shape) and which of them
    count [B, q, K] (a query that sees fewer than K entries picks some it may not see)."""
    scores = torch.relu(torch.einsum("bnhd,bmd->bnhm", q.float(), keys.float())) * indexer.head_dim ** -0.5
    scores = (scores * weights.unsqueeze(-1)).sum(dim=2).masked_fill(~visible, float("-inf"))
    picked = scores.topk(min(indexer.topk, keys.shape[1]), dim=-1).indices
    return picked, visible.gather(-1, picked)


def chosen_entries(entries: torch.Tensor, step: DecodeStep, picked: torch.Tensor, counts: torch.Tensor
                   ) -> torch.Tensor:
    """The entries ``picked`` [B, q, K] (window indices) of each query from the paged cache -> [B, q, K, width],
    zero where they do not count (``counts`` [B, q, K]: rows never written may hold anything, and a zero
    probability times NaN is NaN)."""
    flat = entries.view(-1, entries.shape[-1])
    b, n, k = picked.shape
    rows = flat[step.entry_addresses(picked.view(b, n * k), entries.shape[1])].view(b, n, k, -1)
    return torch.where(counts.unsqueeze(-1), rows, 0)


def attend(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor, scale: float,
           chosen: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [B, q, H, D] over keys [B, L, D] (K is V) where ``visible`` [B, q, L], with a per-head sink logit [H]
    -> [B, q, H, D]. ``chosen``: each query's own entries [B, q, K, D] and which count [B, q, K] (CSA's top-k),
    in the same softmax."""
    scores = torch.einsum("bnhd,bld->bhnl", q, keys) * scale
    parts = [scores.masked_fill(~visible.unsqueeze(1), float("-inf"))]
    if chosen is not None:
        own = torch.einsum("bnhd,bnkd->bhnk", q, chosen[0]) * scale
        parts.append(own.masked_fill(~chosen[1].unsqueeze(1), float("-inf")))
    parts.append(sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1))
    logits = torch.cat(parts, dim=-1)
    probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1).to(keys.dtype)
    out = torch.einsum("bhnl,bld->bnhd", probs[..., :keys.shape[1]], keys)
    if chosen is not None:
        out = out + torch.einsum("bhnk,bnkd->bnhd", probs[..., keys.shape[1]:-1], chosen[0])
    return out
