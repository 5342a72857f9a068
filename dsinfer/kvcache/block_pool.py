"""The block pool: KV blocks with reference counts, an LRU free list, and the prefix-cache index.

Invariants:
- a block is in the free list iff its ref count is 0; block 0 is the null block (padding slots) and never handed out;
- a block with a hash is in ``cached`` under that hash; a free block keeps its hash (and its KV) until it is
  reused, so a later request with the same prefix can take it back (``touch``);
- allocation takes the least recently freed block first and drops its hash at that moment.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dsinfer.kvcache.hashing import NONE_HASH, BlockHash, hash_block

__all__ = ["NONE_HASH", "BlockHash", "BlockPool", "KVCacheBlock", "hash_block"]


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # a model with per-sequence state: the block keeps the state at its end (False: a KV store load filled it and
    # brought only a later block end's state), so a prefix hit may end here; reset when the block is reused
    resumable: bool = True


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        self.free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use by running requests."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take references on cached blocks (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[KVCacheBlock]:
        if count > len(self.free):
            raise RuntimeError(f"asked for {count} KV blocks with {len(self.free)} free")
        out = []
        for _ in range(count):
            _, block = self.free.popitem(last=False)
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            block.resumable = True
            out.append(block)
        return out

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free list's tail (most recently used last)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.block_id] = block
            assert block.ref_cnt >= 0, f"block {block.block_id} released twice"

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash (first writer wins; duplicates simply stay uncached, except that
        a resumable block takes the place of one that is not: a hit may then end there)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        held = self.cached.get(block_hash)
        if held is None or (block.resumable and not held.resumable):
            if held is not None:
                held.block_hash = None
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks[1:]:
            block.block_hash = None
        self.cached.clear()
        return True
