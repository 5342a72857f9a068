"""KVCacheSpec: what one attention layer stores per token, hence the bytes of a block and the cache's shape.

Layers of one layout share one block table (a block id indexes every such layer's cache). A model whose layers
keep different layouts (GPT-OSS: sliding-window and full layers) has one KV cache group per layout
(``kv_cache_groups``): each group has its own block table, drawn from one pool, and a sliding group gives back
the blocks that fell behind its window. The groups' layers share cache tensors (the k-th layer of every group
uses one tensor; a block id belongs to one group at a time), so the block count is the KV budget divided by the
sum of ``bytes_per_block`` over the largest group's worth of layers (``bytes_per_block`` of ``kv_cache_groups``).

Layers that compress their context (DeepSeek-V4) page their compressed entries (``CompressedSpec``: a block of
``block_size`` tokens holds ``block_size / rate`` entries, so one block id covers the same tokens in every layer)
and keep what is not paged in a fixed-size state slot per sequence (``StateSlotSpec``: the sliding-window ring, the
compressors' unpooled source rows). A sequence holds one slot while it runs; the slot count is fixed at start.
With prefix caching or the KV store, each block also keeps the slot's rows at the block's end
(``BoundaryStateSpec``), so a hit at a block boundary restores the slot exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class FullAttentionSpec:
    """K and V for every token: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def values_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.values_per_token * self.dtype.itemsize

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.cache_shape(num_blocks), dtype=self.dtype, device=device)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Full-attention layout; attention only looks back ``sliding_window`` tokens."""

    sliding_window: int = 0


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention: only the normalized latent + the rope key per token, never expanded K/V.

    Layout ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (576 values for DeepSeek-V2-Lite/V3).
    """

    block_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype

    @property
    def values_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.values_per_token * self.dtype.itemsize

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.values_per_token)

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.cache_shape(num_blocks), dtype=self.dtype, device=device)


class IndexedMLACache(NamedTuple):
    """The two caches of an ``IndexedMLASpec`` layer, indexed by the same block ids."""

    latent: torch.Tensor  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (``MLASpec``'s layout)
    index_keys: torch.Tensor  # [num_blocks, block_size, index_head_dim]


@dataclass(frozen=True)
class IndexedMLASpec(MLASpec):
    """MLA with a lightning indexer (DeepSeek-V3.2): per token the latent row (``MLASpec``) and the indexer's key.

    Both live in the pages of one block table (a block id indexes both), so a prefix-cache hit, a preemption and
    a freed block cover both at once; ``bytes_per_block`` counts both, so the block budget is right. The keys are
    kept apart from the latent rows (``IndexedMLACache``), each contiguous, so the MLA ops read the latent as
    they do for V2/V3. ``index_dtype``: the keys' element type (the model's: an FP8 latent cache does not
    quantize the indexer's keys, transformers scores them unquantized).
    """

    index_head_dim: int = 0
    index_dtype: torch.dtype = torch.float32

    @property
    def bytes_per_block(self) -> int:
        return super().bytes_per_block + self.block_size * self.index_head_dim * self.index_dtype.itemsize

    def allocate(self, num_blocks: int, device: torch.device) -> IndexedMLACache:
        index_shape = (num_blocks, self.block_size, self.index_head_dim)
        return IndexedMLACache(super().allocate(num_blocks, device),
                               torch.zeros(index_shape, dtype=self.index_dtype, device=device))


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLASpec | IndexedMLASpec


@dataclass(frozen=True)
class CompressedSpec:
    """Compressed entries, one per ``rate`` tokens: per entry a row of each width in ``widths`` (e.g. the KV entry
    and the indexer's key). Layout per width ``[num_blocks, block_size // rate, width]``."""

    block_size: int  # tokens a block covers (a multiple of rate)
    rate: int
    widths: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        if self.block_size % self.rate:
            raise ValueError(f"block_size ({self.block_size} tokens) must be a multiple of the compression rate "
                             f"({self.rate})")

    @property
    def entries_per_block(self) -> int:
        return self.block_size // self.rate

    @property
    def bytes_per_block(self) -> int:
        return self.entries_per_block * sum(self.widths) * self.dtype.itemsize

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        return [torch.zeros(num_blocks, self.entries_per_block, w, dtype=self.dtype, device=device)
                for w in self.widths]


@dataclass(frozen=True)
class StateSlotSpec:
    """Per-sequence state of fixed size: named rings of ``rows`` x ``width`` values, ``[num_slots, rows, width]``
    each (position p of a sequence at row p % rows)."""

    rings: tuple[tuple[str, int, int], ...]  # (name, rows, width)
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        return sum(rows * width for _, rows, width in self.rings) * self.dtype.itemsize

    def allocate(self, num_slots: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(num_slots, rows, width, dtype=self.dtype, device=device)
                for name, rows, width in self.rings}


@dataclass(frozen=True)
class BoundaryStateSpec:
    """What a state slot must hold to resume a sequence at a block's end, kept in that block (prefix caching and
    the KV store of a model with per-sequence state): per named ring of the slot (``StateSlotSpec``) ``rows``
    rows, ``[num_blocks, rows, width]`` each, row i of block b holding the ring's row of position
    ``B - rows + i`` at the block's end ``B = (b's index in the sequence + 1) * block_size`` (rows of negative
    positions hold anything). A cached block's rows are those of its tokens' prefix, so a prefix hit of n
    blocks restores the slot from the n-th block: nothing of the prefix is recomputed."""

    block_size: int
    rings: tuple[tuple[str, int, int], ...]  # (name of the slot's ring, rows, width)
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return sum(rows * width for _, rows, width in self.rings) * self.dtype.itemsize

    def allocate(self, num_blocks: int, device: torch.device) -> BoundaryStates:
        return BoundaryStates(self.block_size, {name: torch.zeros(num_blocks, rows, width, dtype=self.dtype,
                                                                  device=device)
                                                for name, rows, width in self.rings})


class BoundaryStates(NamedTuple):
    """A layer's ``BoundaryStateSpec`` tensors, by the name of the slot's ring they keep rows of."""

    block_size: int
    rings: dict[str, torch.Tensor]  # [num_blocks, rows, width] each


def ring_keeps_boundary(end: int, boundary: int, max_draft_tokens: int) -> bool:
    """Whether a step that ends at position ``end`` leaves in its sequence's rings every row the state at block
    boundary ``boundary`` (<= end) needs: a window ring holds window + drafts rows and the boundary needs
    window - 1 of them (a compressor's needs fewer of more). The runner copies those boundaries from the rings
    after the forward (``runner.boundary_states``); the layers capture the others during it."""
    return end - boundary <= max_draft_tokens + 1


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLASpec | CompressedSpec | BoundaryStateSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that keep one layout and so share a block table."""

    sliding_window: int | None  # attention looks back this many tokens (None: the whole context)
    layers: tuple[int, ...]  # indices into the spec list the group was made from, in order


def _window(spec: KVCacheSpec) -> int | None:
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) and spec.sliding_window else None


def kv_cache_groups(specs: list[KVCacheSpec]) -> list[KVCacheGroup]:
    """The layers split by layout: one group of the full-context layers (first), then one per sliding window
    (ascending). One layout (Llama, DeepSeek, a Mistral with every layer sliding) is one group."""
    by_window: dict[int | None, list[int]] = {}
    for i, spec in enumerate(specs):
        by_window.setdefault(_window(spec), []).append(i)
    order = sorted(by_window, key=lambda w: -1 if w is None else w)
    return [KVCacheGroup(w, tuple(by_window[w])) for w in order]


def max_blocks_held(windows: tuple[int | None, ...], num_tokens: int, block_size: int, reach: int) -> int:
    """Blocks a sequence of ``num_tokens`` holds at most over the groups of these ``windows``: all of its blocks
    in a full group; in a sliding one its window plus ``reach`` (a prompt chunk and the drafts) and one more."""
    full = -(-num_tokens // block_size)
    return sum(full if w is None else min(full, -(-(w + reach) // block_size) + 1) for w in windows)


def window_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding group needs at a block-aligned position L >= ``window`` (``[(L - window + 1) // bs, L //
    bs)``, the GPU prefix cache's rule): the bounded window state a KV store entry of the group holds (fewer when
    L < window)."""
    return -(-(window - 1) // block_size)


def shares_tensors(specs: list[KVCacheSpec], groups: list[KVCacheGroup]) -> bool:
    """The k-th layers of the groups can share one cache tensor: several groups, all of one cache shape."""
    return len(groups) > 1 and len({(s.cache_shape(1), s.dtype) for s in specs if hasattr(s, "cache_shape")
                                    }) == 1 and all(hasattr(s, "cache_shape") for s in specs)


def bytes_per_block(specs: list[KVCacheSpec], groups: list[KVCacheGroup]) -> int:
    """Bytes one block id costs over every layer's cache (shared tensors counted once)."""
    if shares_tensors(specs, groups):
        return max(len(g.layers) for g in groups) * specs[0].bytes_per_block
    return sum(spec.bytes_per_block for spec in specs)
