"""The engine's view of the store: how many tokens of a prefix it holds, from metadata only.

The host tier lives in the worker; the index mirrors its keys from the (key, present) events each
``RunnerOutput`` carries. The directory tier is asked directly: a stat and a header read per grain, never the KV.
Either may be out of date by the time the worker loads (an entry evicted, a file removed by another engine's GC):
a load then comes back short and the request recomputes the rest, so a stale answer costs time, never tokens.

Sliding-window models (``windows``: each KV cache group's window, None for a full group): a grain's entry holds
the full groups' blocks of the grain (none for a model without a full group, so no such entry), and a second
entry (``window_key``) the sliding groups' bounded window state at the grain's end. A hit ends at a boundary
whose window state is stored: the longest run of full grains, backed off to the last such boundary in it.
Models with per-sequence state (``boundary_states``: DeepSeek-V4) have both: a grain's entry holds its compressed
blocks (entries, indexer keys), its ``window_key`` entry the state slot's rows at the grain's end.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from dsinfer.config import KVStoreConfig
from dsinfer.kvstore.counters import Counters
from dsinfer.kvstore.directory import is_stored
from dsinfer.kvstore.keys import grain_keys


class StoreIndex:
    def __init__(self, config: KVStoreConfig, fingerprint: bytes, block_size: int,
                 windows: tuple[int | None, ...] = (None,), boundary_states: bool = False):
        """``boundary_states``: the model keeps per-sequence state, saved at each grain's end."""
        self.config = config
        self.has_full = None in windows  # grains have a full groups' entry
        # boundaries have a window state entry
        self.has_windows = boundary_states or any(w is not None for w in windows)
        self.fingerprint = fingerprint
        self.grain = config.grain
        self.blocks_per_grain = config.grain // block_size
        self.model_dir = None if config.dir is None else Path(config.dir) / fingerprint.hex()
        self.host_keys: set[bytes] = set()
        self.counters = Counters()  # the engine's share: lookups, expiries seen at lookup

    def keys(self, block_hashes: list[bytes], known: list[bytes]) -> list[bytes]:
        """``known`` (a request's grain keys so far) extended to every full grain of ``block_hashes``."""
        known.extend(grain_keys(block_hashes, self.blocks_per_grain, self.fingerprint, len(known)))
        return known

    @staticmethod
    def window_key(key: bytes) -> bytes:
        """The key of the window state at the end of the grain of ``key``."""
        return hashlib.blake2b(key + b"window", digest_size=16).digest()

    def lookup(self, keys: list[bytes], min_grains: int = 0) -> int:
        """How many of ``keys`` (a prefix's grains, in order) the store serves, counting from the first; with
        sliding groups, backed off to the last boundary past ``min_grains`` whose window state is stored."""
        now = time.time()
        n = next((i for i, key in enumerate(keys) if not self._present(key, now)), len(keys)) if self.has_full \
            else len(keys)
        if self.has_windows:
            while n > min_grains and not self._present(self.window_key(keys[n - 1]), now):
                n -= 1
        return n

    def _present(self, key: bytes, now: float) -> bool:
        self.counters.add("lookups")
        if key in self.host_keys:
            return True
        found = False if self.model_dir is None else is_stored(self.model_dir, key, self.fingerprint, now)
        if found is None:
            self.counters.add("expiries")
        return bool(found)

    def apply(self, events: list[tuple[bytes, bool]]) -> None:
        """The worker's host-tier changes, in order."""
        for key, present in events:
            if present:
                self.host_keys.add(key)
            else:
                self.host_keys.discard(key)
