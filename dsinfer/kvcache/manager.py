"""KVCacheManager: gives requests blocks for the tokens they are about to compute, with prefix caching.

``get_computed_blocks`` finds the longest cached prefix (whole blocks, always leaving at least one token to compute);
``allocate_slots`` takes those blocks and enough new ones for ``num_computed + num_new`` tokens, then registers the
blocks that the step will fill completely with known tokens (never a draft's); ``trim`` gives back the blocks
past a length (rejected drafts); ``free`` returns a request's blocks, tail first, so the least useful blocks are
evicted first.

Models with per-sequence state (``StateSlotSpec``, DeepSeek-V4's windows and compressor rows) also need a state
slot per running request: ``allocate_slots`` (and ``allocate_for_load``) gives a request without one its slot
together with its blocks, or neither (a request is admitted only if both fit), and ``free`` returns both. With
prefix caching on, the worker keeps in every block the slot's rows at the block's end (``BoundaryStateSpec``), so
a hit of n blocks is exact: the worker restores the slot from the n-th block (``runner.boundary_states``), and the
KV store saves that block's rows as each grain's boundary state (``window_block_ids``); a load brings only its
last block's rows, so the blocks before it are cached but no hit ends on them (``KVCacheBlock.resumable``).
Their blocks are offered
to the prefix cache only once computed (by an earlier step, or when the request is freed), never by the step
that fills them: a request admitted in that same step would restore its slot before the forward wrote the rows.
"""

from __future__ import annotations

from dsinfer.core.request import Request
from dsinfer.kvcache.block_pool import NONE_HASH, BlockPool, KVCacheBlock, hash_block
from dsinfer.kvcache.state_slots import StateSlotPool


class KVCacheManager:
    num_groups = 1  # KV cache groups (``kvcache.grouped_manager`` for models with more, or a sliding one)

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, num_state_slots: int = 0):
        """``num_state_slots``: per-sequence state slots the worker holds (0: the model keeps no such state)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.slots = StateSlotPool(num_state_slots) if num_state_slots else None
        self.enable_caching = enable_caching
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there

    def update_hashes(self, request: Request) -> None:
        """Extend the request's block hash chain to its full blocks of known tokens."""
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            hashes.append(hash_block(hashes[-1] if hashes else NONE_HASH, tokens[start:start + bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks covering a prefix of the request, and how many tokens they hold."""
        if not self.enable_caching or request.needs_prompt_logprobs:
            return [], 0
        self.update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        while hits and not hits[-1].resumable:  # (state models) the hit ends where the state is kept
            hits.pop()
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(request.blocks) - num_computed_blocks)

    def can_allocate(self, request: Request, num_new_tokens: int, computed: list[KVCacheBlock] = ()) -> bool:
        # Free-but-cached hits are counted as free blocks; touching them removes them from the free list.
        revived = sum(1 for b in computed if b.ref_cnt == 0)
        needed = self.num_blocks_needed(request, num_new_tokens, len(computed))
        if self.slots is not None and request.state_slot < 0 and not self.slots.num_free:
            return False
        return needed + revived <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, computed: list[KVCacheBlock] = ()) -> bool:
        """Give the request room for ``num_new_tokens`` more tokens (and its state slot, if it has none yet);
        False (and no change) if blocks or slots run out."""
        end = request.num_computed_tokens + num_new_tokens
        offer = end if self.slots is None else request.num_computed_tokens
        has_slot = self.slots is None or request.state_slot >= 0
        if not computed and has_slot and end <= len(request.blocks) * self.block_size:
            # most decode steps: the tokens fit the last block; only a block filled by them is offered
            if self.enable_caching and offer // self.block_size > request.num_offered_blocks:
                self._cache_full_blocks(request, offer)
            return True
        if not self.can_allocate(request, num_new_tokens, computed):
            return False
        if self.slots is not None and request.state_slot < 0:
            request.state_slot = self.slots.allocate()
        self._take_blocks(request, num_new_tokens, computed)
        self._cache_full_blocks(request, offer)
        return True

    def _take_blocks(self, request: Request, num_new_tokens: int, computed) -> None:
        """Append the prefix hit's blocks and fresh ones for ``num_new_tokens`` (room already checked)."""
        if computed:
            self.pool.touch(list(computed))
            request.blocks.extend(computed)
        request.blocks.extend(self.pool.allocate(self.num_blocks_needed(request, num_new_tokens)))

    def allocate_for_load(self, request: Request, num_new_tokens: int, computed: list[KVCacheBlock] = ()) -> bool:
        """Blocks for ``num_new_tokens`` tokens past ``request.num_computed_tokens`` that a KV store load will fill:
        as ``allocate_slots``, but none joins the prefix cache before its KV is there (``cache_loaded``)."""
        if not self.can_allocate(request, num_new_tokens, computed):
            return False
        if self.slots is not None and request.state_slot < 0:
            request.state_slot = self.slots.allocate()
        first = len(request.blocks) + len(computed)
        self._take_blocks(request, num_new_tokens, computed)
        if self.slots is not None:  # the load brings the state at its end only
            for block in request.blocks[first:-1]:
                block.resumable = False
        return True

    def num_held(self, computed: list[KVCacheBlock]) -> int:
        """Blocks of a prefix hit (``get_computed_blocks``' first value)."""
        return len(computed)

    def window_block_ids(self, request: Request, num_tokens: int, num_held: int = 0) -> list[int] | None:
        """A model with per-sequence state: the block whose end is ``num_tokens`` (block-aligned), which keeps
        the state slot's rows there: the KV store's boundary state of a grain (-1 when it is one of the first
        ``num_held``, already on the GPU; None without state, or when a load filled the block without it)."""
        j = num_tokens // self.block_size - 1
        if self.slots is None or not request.blocks[j].resumable:
            return None
        return [request.blocks[j].block_id if j >= num_held else -1]

    def cache_loaded(self, request: Request) -> None:
        """A load filled the request's blocks up to ``num_computed_tokens``: its full blocks join the prefix cache."""
        self._cache_full_blocks(request, request.num_computed_tokens)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        self.update_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        # from the first block not offered yet: a decode step offers at most its one newly full block, not every
        # block of the request again (18k calls a B=256 step: 20.7 -> 16.8 ms of host time on a 2-core CPU)
        for i in range(request.num_offered_blocks, num_full):
            self.pool.cache_block(request.blocks[i], request.block_hashes[i])
        request.num_offered_blocks = max(request.num_offered_blocks, num_full)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Keep only the blocks the first ``num_tokens`` tokens need (rejected drafts' blocks go back, tail
        first); -> the blocks kept. A block past ``num_tokens`` holds no hashed token, so nothing cached goes."""
        keep = -(-num_tokens // self.block_size)
        if keep < len(request.blocks):
            self.pool.release(list(reversed(request.blocks[keep:])))
            del request.blocks[keep:]
        request.num_offered_blocks = min(request.num_offered_blocks, len(request.blocks))
        return len(request.blocks)

    def free(self, request: Request) -> None:
        if self.slots is not None:  # the blocks its last step filled (offered late: see allocate_slots)
            self._cache_full_blocks(request, request.num_computed_tokens)
        self.pool.release(list(reversed(request.blocks)))
        request.blocks = []
        if request.state_slot >= 0:
            self.slots.release(request.state_slot)
            request.state_slot = -1
        request.num_offered_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (False, and nothing forgotten, while a request holds blocks)."""
        return self.pool.reset_prefix_cache()

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
