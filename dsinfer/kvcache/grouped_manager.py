"""KV cache groups: one block table per layout (``core.kv_cache_spec.kv_cache_groups``), blocks from one pool.

A model whose layers all keep the whole context (Llama, DeepSeek) has one full group and the plain
``KVCacheManager``. Any sliding-window group (a Mistral with every layer sliding: one group; GPT-OSS: a full group
and a sliding one) takes this manager, with the same interface and invariants, plus:
- every group's list (``request.blocks`` for group 0, ``request.group_blocks`` for the rest) covers the same
  tokens, so all are as long as ``request.blocks``; a step allocates the same number of new blocks in each;
- a sliding group of window W gives back, as the sequence grows, the blocks wholly before position
  ``num_computed - W + 1 - max_draft_tokens`` (no query from then on sees them, even after every draft of a step
  is rolled back); their entries become the null block (block 0), so blocks in use per sequence are bounded by
  the window, not the context;
- prefix hits: a full group needs every block of the hit, a sliding group only those inside its window at the hit
  point (the ones before are left out: null entries); the hit is the longest length every group can serve;
- KV store loads (``allocate_for_load``): every group's blocks up to the load's end, a sliding group's only from
  the first its window at that end needs (null entries before); ``window_block_ids`` names a sliding group's
  window blocks at a grain boundary, what the store saves and loads as the bounded window state;
- each group registers its full blocks under its own key (the token hash chain, tagged with the group), so a
  block cached by one group is never handed to another as a hit; ``free`` and ``trim`` release every group's.
"""

from __future__ import annotations

from dsinfer.core.kv_cache_spec import window_blocks
from dsinfer.core.request import Request
from dsinfer.kvcache.block_pool import BlockHash, KVCacheBlock
from dsinfer.kvcache.manager import KVCacheManager


def kv_cache_manager(num_blocks: int, block_size: int, enable_caching: bool, num_state_slots: int = 0,
                     sliding_windows: tuple[int | None, ...] = (None,), max_draft_tokens: int = 0) -> KVCacheManager:
    """The manager for a model's groups (``sliding_windows``: one entry per group, None for a full one)."""
    if tuple(sliding_windows) == (None,):
        return KVCacheManager(num_blocks, block_size, enable_caching, num_state_slots)
    return GroupedKVCacheManager(num_blocks, block_size, enable_caching, num_state_slots, sliding_windows,
                                 max_draft_tokens)


class GroupedKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, num_state_slots: int,
                 sliding_windows: tuple[int | None, ...], max_draft_tokens: int = 0):
        """``max_draft_tokens``: the most drafts one step verifies (a sliding group keeps that many more tokens)."""
        super().__init__(num_blocks, block_size, enable_caching, num_state_slots)
        if not sliding_windows or any(w is not None and w < 1 for w in sliding_windows):
            raise ValueError(f"sliding_windows must list each group's window (>= 1, or None), got {sliding_windows}")
        self.windows = tuple(sliding_windows)
        self.max_draft_tokens = max_draft_tokens
        self.null = self.pool.null_block

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def _lists(self, request: Request) -> list[list[KVCacheBlock]]:
        if len(request.num_freed_blocks) != self.num_groups:
            request.group_blocks = [[] for _ in range(self.num_groups - 1)]
            request.num_freed_blocks = [0] * self.num_groups
        return [request.blocks, *request.group_blocks]

    def _key(self, group: int, block_hash: BlockHash) -> BlockHash:
        return block_hash if group == 0 else block_hash + bytes([group])

    def _first_needed(self, group: int, num_tokens: int, margin: int = 0) -> int:
        """The first block a query at position ``num_tokens`` (or ``margin`` positions before) can see."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_tokens - window + 1 - margin) // self.block_size

    # prefix hits

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Per group, the blocks of the longest prefix every group can serve (null entries where a sliding group
        needs none), and the tokens they cover; ([], 0) without a hit."""
        if not self.enable_caching or request.needs_prompt_logprobs or self.slots is not None:
            return [], 0  # no model keeps both sliding groups and state slots
        self.update_hashes(request)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        cached = [[self.pool.get_cached(self._key(g, h)) for h in hashes] for g in range(self.num_groups)]
        n = len(hashes)
        for g, window in enumerate(self.windows):  # full groups: the longest cached prefix
            if window is None:
                n = next((i for i, block in enumerate(cached[g][:n]) if block is None), n)
        changed = True
        while changed:  # sliding groups: the longest length <= n whose window is cached (not monotone in n)
            changed = False
            for g, window in enumerate(self.windows):
                if window is not None:
                    m = n
                    while m and any(b is None for b in cached[g][self._first_needed(g, m * self.block_size):m]):
                        m -= 1
                    changed, n = changed or m < n, m
        self.prefix_queries += request.num_tokens
        self.prefix_hits += n * self.block_size
        if not n:
            return [], 0
        hits = [[self.null] * self._first_needed(g, n * self.block_size) for g in range(self.num_groups)]
        for g, blocks in enumerate(hits):
            blocks.extend(cached[g][len(blocks):n])
        return hits, n * self.block_size

    # allocation

    def _free_behind_windows(self, request: Request, lists: list[list[KVCacheBlock]]) -> None:
        freed = request.num_freed_blocks
        for g, blocks in enumerate(lists):
            if self.windows[g] is None:
                continue
            end = min(self._first_needed(g, request.num_computed_tokens, self.max_draft_tokens), len(blocks))
            if end <= freed[g]:
                continue
            gone = [b for b in blocks[freed[g]:end] if b is not self.null]
            blocks[freed[g]:end] = [self.null] * (end - freed[g])
            self.pool.release(gone)
            freed[g] = end

    def can_allocate(self, request: Request, num_new_tokens: int, computed: list[list[KVCacheBlock]] = ()) -> bool:
        # free-but-cached hits count as free blocks; touching them takes them off the free list
        revived = sum(1 for blocks in computed for b in blocks if b.ref_cnt == 0)
        needed = self.num_blocks_needed(request, num_new_tokens, len(computed[0]) if computed else 0)
        if self.slots is not None and request.state_slot < 0 and not self.slots.num_free:
            return False
        return needed * self.num_groups + revived <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, computed: list[list[KVCacheBlock]] = ()
                       ) -> bool:
        """As ``KVCacheManager.allocate_slots``, in every group; first gives back what fell behind the windows."""
        self._free_behind_windows(request, self._lists(request))
        return super().allocate_slots(request, num_new_tokens, computed)

    def _take_blocks(self, request: Request, num_new_tokens: int, computed) -> None:
        """Every group: its hit's blocks (the null entries of a hit count as given back), then fresh ones."""
        lists = self._lists(request)
        for blocks, hits in zip(lists, computed):
            self.pool.touch([b for b in hits if b is not self.null])
            blocks.extend(hits)
        if computed:
            request.num_freed_blocks = [sum(1 for b in hits if b is self.null) for hits in computed]
        count = self.num_blocks_needed(request, num_new_tokens)
        for blocks in lists:
            blocks.extend(self.pool.allocate(count))

    def allocate_for_load(self, request: Request, num_new_tokens: int, computed: list[list[KVCacheBlock]] = ()
                          ) -> bool:
        """As ``KVCacheManager.allocate_for_load`` in every group; a sliding group keeps only the blocks its window
        needs at the load's end (the GPU hit's earlier ones go back), so no block without valid KV is held."""
        if not super().allocate_for_load(request, num_new_tokens, computed):
            return False
        lists = self._lists(request)
        end_token = request.num_computed_tokens + num_new_tokens
        for g, blocks in enumerate(lists):
            if self.windows[g] is not None:
                end = self._first_needed(g, end_token)
                self.pool.release([b for b in reversed(blocks[:end]) if b is not self.null])
                blocks[:end] = [self.null] * end
                request.num_freed_blocks[g] = end
        return True

    def num_held(self, computed: list[list[KVCacheBlock]]) -> int:
        return len(computed[0]) if computed else 0

    def window_block_ids(self, request: Request, num_tokens: int, num_held: int = 0) -> list[int] | None:
        """Each sliding group's blocks its window needs at ``num_tokens`` (block-aligned), padded with -1 to
        ``window_blocks`` per group, -1 also for the first ``num_held`` blocks; None when one was given back."""
        ids: list[int] = []
        for g, blocks in enumerate(self._lists(request)):
            window = self.windows[g]
            if window is None:
                continue
            first, end = self._first_needed(g, num_tokens), num_tokens // self.block_size
            if end > len(blocks) or any(b is self.null for b in blocks[max(first, num_held):end]):
                return None
            group = [blocks[j].block_id if j >= num_held else -1 for j in range(first, end)]
            ids += group + [-1] * (window_blocks(window, self.block_size) - len(group))
        return ids

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        self.update_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for g, blocks in enumerate(self._lists(request)):
            for i in range(request.num_offered_blocks, num_full):
                if blocks[i] is not self.null:
                    self.pool.cache_block(blocks[i], self._key(g, request.block_hashes[i]))
        request.num_offered_blocks = max(request.num_offered_blocks, num_full)

    def trim(self, request: Request, num_tokens: int) -> int:
        keep = -(-num_tokens // self.block_size)
        for g, blocks in enumerate(self._lists(request)):
            if keep < len(blocks):
                self.pool.release([b for b in reversed(blocks[keep:]) if b is not self.null])
                del blocks[keep:]
            request.num_freed_blocks[g] = min(request.num_freed_blocks[g], keep)
        request.num_offered_blocks = min(request.num_offered_blocks, len(request.blocks))
        return len(request.blocks)

    def free(self, request: Request) -> None:
        for blocks in self._lists(request)[1:]:
            self.pool.release([b for b in reversed(blocks) if b is not self.null])
            blocks.clear()
        request.blocks = [b for b in request.blocks if b is not self.null]  # a sliding group 0's null entries
        request.num_freed_blocks = [0] * self.num_groups
        super().free(request)
