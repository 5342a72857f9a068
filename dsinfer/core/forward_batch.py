"""ForwardBatch: everything one forward pass needs, built once per step and passed explicitly to every layer."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass
class ForwardBatch:
    """A flat varlen batch of B sequences and T tokens (tokens of a sequence are contiguous, in order).

    Invariants: ``query_start_loc[0] == 0``, ``query_start_loc[B] == T``; ``seq_lens[b]`` counts the context of
    sequence b including this step's tokens; ``slot_mapping[t]`` is where token t's KV is stored
    (``block * block_size + offset``; negative = padding, not stored); ``block_tables`` rows are padded with 0.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    logits_indices: torch.Tensor  # [S] int64: token rows whose logits are computed
    max_query_len: int  # host-side, known when the batch is built
    max_seq_len: int
    # KV cache groups after the first (``core.kv_cache_spec.kv_cache_groups``): each one's (block tables
    # [B, max_blocks] int32, slot mapping [T] int64), read through ``kv_tables``; empty for one-group models
    group_tables: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # [B] int64: each sequence's state slot (models whose layers keep per-sequence state: ``StateSlotSpec``)
    state_slots: torch.Tensor | None = None
    # this forward is captured into a CUDA graph or warms such a capture up: layers take the paths the capture
    # will (the side stream, ``layers.streams``); set by whoever captures
    graphed: bool = False
    # while a piecewise prefill graph is captured: what cuts it at each attention layer (``layers.graph_pieces``)
    pieces: Any = field(default=None, repr=False, compare=False)
    # values the layers derive from the batch once per step and share (e.g. ``MLAMetadata``), by key (``derive``)
    derived: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)

    def derive(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()``, made once per step and key: the first layer that asks builds it, later ones share it."""
        value = self.derived.get(key)
        if value is None:
            value = self.derived[key] = build()
        return value

    def kv_tables(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables, slot mapping) of KV cache group ``group`` (0: ``block_tables``, ``slot_mapping``)."""
        if group == 0:
            return self.block_tables, self.slot_mapping
        return self.group_tables[group - 1]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
