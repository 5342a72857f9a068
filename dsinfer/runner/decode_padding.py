"""Pad a step whose sequences have different query lengths to one length, so that it replays a decode graph.

A decode graph runs ``n`` sequences of ``Q`` tokens each (``cuda_graphs``). Confidence-scheduled verification gives
the requests of one step different draft counts, so their query lengths ``q_i = 1 + drafts`` differ, and such a
step would run eagerly. ``pad_step`` lays it out as ``n`` sequences of its longest ``Q``: sequence i's
``Q - q_i`` padding tokens go *before* its real ones, at the positions just before them
(``start_i - pad_i .. start_i - 1``, ``start_i = seq_len_i - q_i``), so that

- its seq_len stays ``start_i + q_i`` and its query row j sits at ``seq_len_i - Q + j`` (the attention contract,
  ``ops.attention``): every real token keeps its own position, and sees the keys it sees unpadded;
- padding tokens store nothing (slot -1): the cache keeps the KV that earlier steps wrote at those positions and
  the real tokens read it there. A padding token attends only to positions up to its own, all before the step's
  tokens and in blocks the sequence holds, so no read or write goes past a sequence's blocks, wherever its tokens
  end against the block size (a right-padded layout would read the block after a sequence's last one);
- padding tokens' input ids are 0 and nothing reads their logits: ``rows`` maps each real token to its row in the
  padded batch, and the logits rows, the placeholder rows of async scheduling and the hidden states map back
  through it, so sampling and verification see exactly the rows of the unpadded step.

A sequence with fewer tokens before the step than its padding (a one-token prompt's first drafts beside longer
ones) cannot be laid out so: ``pad_step`` returns None and the step runs as it is. One KV cache group only (the
padded layout carries one slot mapping), and no per-sequence state (DeepSeek-V4's rings: the runner keeps those
models' steps as they are).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.runner.input_batch import HostInputs, to_device_packed


@dataclass
class PaddedStep:
    """A step laid out as ``len(host.seq_lens)`` sequences of ``query_len`` tokens each."""

    host: HostInputs  # the padded batch (``logits_indices``: the unpadded logits rows, mapped through ``rows``)
    query_len: int
    rows: np.ndarray  # [T] int64: each token of the unpadded step, its row in the padded batch

    def to_device(self, device: torch.device, max_seq_len: int) -> tuple[ForwardBatch, torch.Tensor]:
        """The padded batch on ``device`` (eager steps: tests force padding without graphs) and ``rows`` there."""
        h = self.host
        ids, positions, slots, tables, qsl, seq_lens, logits, rows = to_device_packed(
            [h.input_ids, h.positions, h.slot_mapping, h.block_tables, h.query_start_loc, h.seq_lens,
             h.logits_indices, self.rows], device)
        batch = ForwardBatch(input_ids=ids, positions=positions, slot_mapping=slots, block_tables=tables,
                             query_start_loc=qsl, seq_lens=seq_lens, logits_indices=logits,
                             max_query_len=self.query_len, max_seq_len=max_seq_len)
        return batch, rows


def pad_step(host: HostInputs, query_len: int) -> PaddedStep | None:
    """``host`` (one KV cache group, no state slots) with every sequence left-padded to ``query_len`` tokens;
    None when a sequence is longer than that or has fewer tokens before it than its padding."""
    if host.state_slots is not None:
        raise ValueError("pad_step: a model with per-sequence state slots cannot be padded (its padding tokens "
                         "would advance the state)")
    cu = host.query_start_loc.astype(np.int64)
    q_lens = np.diff(cu)
    pads = query_len - q_lens
    if (pads < 0).any() or (host.seq_lens - q_lens < pads).any():
        return None
    num_seqs, total = len(q_lens), len(q_lens) * query_len
    # sequence i's real tokens end its block of rows: they move by (i + 1) * Q - cu[i + 1]
    shift = np.arange(1, num_seqs + 1, dtype=np.int64) * query_len - cu[1:]
    rows = np.arange(int(cu[-1]), dtype=np.int64) + np.repeat(shift, q_lens)
    input_ids = np.zeros(total, dtype=np.int64)
    input_ids[rows] = host.input_ids
    slot_mapping = np.full(total, -1, dtype=np.int64)
    slot_mapping[rows] = host.slot_mapping
    positions = (np.repeat(host.seq_lens.astype(np.int64) - query_len, query_len)
                 + np.tile(np.arange(query_len, dtype=np.int64), num_seqs))
    logits = None if host.logits_indices is None else rows[host.logits_indices]
    padded = HostInputs(input_ids, positions, slot_mapping, host.block_tables,
                        (np.arange(num_seqs + 1) * query_len).astype(np.int32), host.seq_lens, None, logits)
    return PaddedStep(padded, query_len, rows)
