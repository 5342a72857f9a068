"""The prefix cache's block hash chain, torch-free: the engine's KV manager and the router (``dsinfer.router``,
which must not import the engine) compute the same hashes for the same tokens.

A block's hash covers its ``block_size`` token ids and its parent's hash, so equal hashes mean equal prefixes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

BlockHash = bytes

NONE_HASH: BlockHash = b"\0" * 16  # the parent of a prompt's first block


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Stable 16-byte hash of a full block chained to its parent's hash (same across processes and runs)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    h.update(extra)
    return h.digest()


def block_hash_chain(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hashes of every full block of ``token_ids``, in order (a request's ``block_hashes`` at admission)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else NONE_HASH, token_ids[start:start + block_size]))
    return hashes
