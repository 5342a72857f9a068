"""The store's counters, shared by its threads (``add`` under a lock) and read whole (``snapshot``).

Names (Prometheus exports them as ``dsinfer_kv_store_<name>_total``): ``lookups`` (grains asked for at
admission), ``hit_tokens_host`` / ``hit_tokens_dir`` (tokens loaded from each tier), ``bytes_loaded`` /
``bytes_saved``, ``loads`` and ``load_seconds`` (their sum: the mean load latency), ``queue_drops`` (saves dropped
by a full write-behind queue), ``save_errors`` (saves that failed: a write the file system refused (full, quota)
or an unexpected error), ``load_errors`` (loads cut short by an unexpected error), ``evictions_host`` /
``evictions_dir`` (LRU under the watermark), ``expiries`` (entries past their TTL), ``corrupt_files`` (foreign,
truncated or corrupt files removed).
"""

from __future__ import annotations

import threading

NAMES = ("lookups", "hit_tokens_host", "hit_tokens_dir", "bytes_loaded", "bytes_saved", "loads", "load_seconds",
         "queue_drops", "save_errors", "load_errors", "evictions_host", "evictions_dir", "expiries", "corrupt_files")


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(NAMES, 0.0)

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)
