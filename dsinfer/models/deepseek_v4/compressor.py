"""The compressors: every ``rate`` source tokens pooled into one compressed KV entry (CSA: rate 4, HCA: 128).

Entry w pools window w (tokens w*rate .. w*rate + rate - 1) by a softmax gate per channel:
``sum_j softmax_j(Z_j + B_j) * C_j`` with ``C = x W_kv``, ``Z = x W_gate``, ``B`` a learned bias per offset in the
window (``ape``), then RMSNorm and RoPE at the window's first position. CSA overlaps windows: its projections are
two series of ``dim`` channels, and entry w pools window w-1's first series with window w's second one, over 2*rate
slots (window -1 does not exist: weight 0). An entry exists once its window's last token is known; a query at
position t sees entries w < (t + 1) // rate.

Across steps a compressor keeps its source rows not yet pooled in the sequence's state slot: a ring of
``rate`` (HCA) or ``2 * rate`` (CSA, the previous window too) rows of [kv | gate], plus the largest draft count so
that a rejected draft never overwrote a row still needed.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.core.kv_cache_spec import BoundaryStates
from dsinfer.layers.linear import Linear
from dsinfer.layers.norm import RMSNorm
from dsinfer.models.deepseek_v4.rope import V4Rope, apply_rope
from dsinfer.models.deepseek_v4.step import SeqStep, V4Step, capture_boundaries, read_ring, write_ring


class Compressor(nn.Module):
    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, rope: V4Rope, eps: float):
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = (2 if overlap else 1) * dim
        self.wkv = Linear(hidden, width)
        self.wgate = Linear(hidden, width)
        self.ape = nn.Parameter(torch.empty(rate, width, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(dim, eps)
        self.rope = rope

    @property
    def ring_rows(self) -> int:
        """Source rows a slot must hold between steps (before drafts): the partial window, and for CSA the last
        full window before it."""
        return (2 if self.overlap else 1) * self.rate

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> each token's source row [T, 2 * width]: kv then gate (the bias is added when pooled)."""
        return torch.cat((self.wkv(x), self.wgate(x)), dim=-1)

    def pool(self, source: torch.Tensor, first_window: int, has_prev: bool) -> torch.Tensor:
        """Entries [W, dim] of windows first_window .. first_window + W - 1 from their source rows
        ([W * rate, 2 * width], window-aligned), preceded for CSA by window first_window - 1's rows when
        ``has_prev``."""
        rate, width = self.rate, source.shape[-1] // 2
        kv, gate = source[:, :width], source[:, width:]
        windows = kv.shape[0] // rate - (1 if has_prev else 0)
        kv = kv.reshape(-1, rate, width)
        gate = gate.reshape(-1, rate, width) + self.ape
        if self.overlap:
            if not has_prev:  # window -1: zero rows of zero weight
                kv = torch.cat((kv.new_zeros(1, rate, width), kv))
                gate = torch.cat((gate.new_full((1, rate, width), float("-inf")), gate))
            d = self.dim
            kv = torch.cat((kv[:-1, :, :d], kv[1:, :, d:]), dim=1)
            gate = torch.cat((gate[:-1, :, :d], gate[1:, :, d:]), dim=1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        entries = self.norm(pooled)
        positions = (torch.arange(windows, device=source.device) + first_window) * rate
        cos, sin = self.rope.angles(positions)
        return apply_rope(entries, cos, sin)

    def step(self, source: torch.Tensor, step: V4Step, ring: torch.Tensor, entries: torch.Tensor,
             boundary: BoundaryStates | None = None, name: str = "", max_draft_tokens: int = 0) -> None:
        """Pool every window the step's tokens close into ``entries`` (a paged cache [blocks, per block, dim]) and
        keep the step's source rows (``project``'s, [T, 2 * width]) in each sequence's ring (and, with
        ``boundary``, the ring ``name``'s rows at each block end the ring will not hold: ``capture_boundaries``)."""
        per_block = entries.shape[1]
        flat = entries.view(-1, entries.shape[-1])
        for seq in step.seqs:
            first, end = seq.num_computed // self.rate, seq.end // self.rate
            if end > first:
                has_prev = self.overlap and first > 0
                start = (first - (1 if has_prev else 0)) * self.rate
                rows = source[seq.first_row:seq.first_row + end * self.rate - seq.num_computed]
                old = read_ring(ring, seq.slot, range(start, seq.num_computed)).to(source.dtype)
                new = self.pool(torch.cat((old, rows)), first, has_prev)
                flat[step.entry_addresses(seq, first, end, per_block)] = new.to(flat.dtype)
            capture_boundaries(boundary, name, ring, step, seq, source[seq.rows], max_draft_tokens)
            write_ring(ring, seq.slot, seq, source[seq.rows])

    def gather(self, step: V4Step, seq: SeqStep, entries: torch.Tensor) -> torch.Tensor:
        """The sequence's entries known after this step: [(end // rate), dim]."""
        flat = entries.view(-1, entries.shape[-1])
        return flat[step.entry_addresses(seq, 0, seq.end // self.rate, entries.shape[1])]
