"""What V4's layers read of a step: each sequence's rows, context and state slot, and the paged entry addresses.

A V4 layer keeps two kinds of cache (``core.kv_cache_spec``): compressed entries in paged blocks (entry w of a
sequence at ``block_tables[b, w // entries_per_block]``, offset ``w % entries_per_block``) and rings in the
sequence's state slot (position p at row ``p % ring_rows``). Built once per step on the host, shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.core.kv_cache_spec import BoundaryStates, ring_keeps_boundary


@dataclass(frozen=True)
class SeqStep:
    index: int  # the sequence's row in the block tables
    first_row: int  # its first token row in the flat batch
    num_new: int  # tokens this step computes (positions num_computed .. num_computed + num_new - 1)
    num_computed: int  # tokens before this step
    slot: int  # its state slot

    @property
    def rows(self) -> slice:
        return slice(self.first_row, self.first_row + self.num_new)

    @property
    def end(self) -> int:
        return self.num_computed + self.num_new


@dataclass
class V4Step:
    seqs: list[SeqStep]
    block_tables: torch.Tensor

    @classmethod
    def of(cls, batch: ForwardBatch) -> V4Step:
        return batch.derive("deepseek_v4_step", lambda: cls.build(batch))

    @classmethod
    def build(cls, batch: ForwardBatch) -> V4Step:
        if batch.state_slots is None:
            raise ValueError("DeepSeek-V4 layers need the batch's state slots (ForwardBatch.state_slots)")
        starts = batch.query_start_loc.tolist()
        lens, slots = batch.seq_lens.tolist(), batch.state_slots.tolist()
        seqs = [SeqStep(b, starts[b], starts[b + 1] - starts[b], lens[b] - (starts[b + 1] - starts[b]), slots[b])
                for b in range(len(lens))]
        return cls(seqs, batch.block_tables)

    def entry_addresses(self, seq: SeqStep, first: int, end: int, entries_per_block: int) -> torch.Tensor:
        """Flat row indices (into a cache viewed [num_blocks * entries_per_block, width]) of entries first..end-1."""
        idx = torch.arange(first, end, device=self.block_tables.device)
        blocks = self.block_tables[seq.index, idx // entries_per_block].long()
        return blocks * entries_per_block + idx % entries_per_block


def ring_rows(positions: range, num_rows: int, device: torch.device) -> torch.Tensor:
    return torch.arange(positions.start, positions.stop, device=device) % num_rows


def read_ring(ring: torch.Tensor, slot: int, positions: range) -> torch.Tensor:
    """Rows of ``positions`` from a slot's ring [num_slots, R, width] (they must be the last R written)."""
    return ring[slot, ring_rows(positions, ring.shape[1], ring.device)]


def write_ring(ring: torch.Tensor, slot: int, seq: SeqStep, values: torch.Tensor) -> None:
    """Keep the step's newest rows (of its ``num_new`` ``values``) in the slot's ring: the last R positions."""
    keep = min(seq.num_new, ring.shape[1])
    positions = range(seq.end - keep, seq.end)
    ring[slot, ring_rows(positions, ring.shape[1], ring.device)] = values[seq.num_new - keep:].to(ring.dtype)


def capture_boundaries(states: BoundaryStates | None, name: str, ring: torch.Tensor, step: V4Step, seq: SeqStep,
                       values: torch.Tensor, max_draft_tokens: int) -> None:
    """Before the step's rows (``values`` [num_new, width]) go into ring ``name``: into every block whose end the
    step reaches and its ring will not hold after it (``ring_keeps_boundary``), the ring's rows at that end
    (``BoundaryStateSpec``: positions B - rows .. B - 1, from the ring before the step and from ``values``)."""
    if states is None or name not in states.rings:
        return
    bs, out = states.block_size, states.rings[name]
    rows = out.shape[1]
    for boundary in range((seq.num_computed // bs + 1) * bs, seq.end + 1, bs):
        if ring_keeps_boundary(seq.end, boundary, max_draft_tokens) or not rows:
            continue
        pos = torch.arange(boundary - rows, boundary, device=ring.device)
        old = ring[seq.slot, pos % ring.shape[1]].to(values.dtype)
        new = values[(pos - seq.num_computed).clamp(0, seq.num_new - 1)]
        block = step.block_tables[seq.index, boundary // bs - 1].long().view(1)
        out[block] = torch.where((pos < seq.num_computed).unsqueeze(-1), old, new).to(out.dtype).unsqueeze(0)
