"""The engine's view of the store: how many tokens of a prefix it holds, from metadata only.

The host tier lives in the worker; the index mirrors its keys from the (key, present) events each
``RunnerOutput`` carries. The directory tier is asked directly: a stat and a header read per grain, never the KV.
Either may be out of date by the time the worker loads (an entry evicted, a file removed by another engine's GC):
a load then comes back short and the request recomputes the rest, so a stale answer costs time, never tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

from dsinfer.config import KVStoreConfig
from dsinfer.kvstore.counters import Counters
from dsinfer.kvstore.directory import is_stored
from dsinfer.kvstore.keys import grain_keys


class StoreIndex:
    def __init__(self, config: KVStoreConfig, fingerprint: bytes, block_size: int):
        self.config = config
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

    def lookup(self, keys: list[bytes]) -> int:
        """How many of ``keys`` (a prefix's grains, in order) are stored, counting from the first."""
        now = time.time()
        for n, key in enumerate(keys):
            self.counters.add("lookups")
            if key in self.host_keys:
                continue
            found = False if self.model_dir is None else is_stored(self.model_dir, key, self.fingerprint, now)
            if found is None:
                self.counters.add("expiries")
            if not found:
                return n
        return len(keys)

    def apply(self, events: list[tuple[bytes, bool]]) -> None:
        """The worker's host-tier changes, in order."""
        for key, present in events:
            if present:
                self.host_keys.add(key)
            else:
                self.host_keys.discard(key)
