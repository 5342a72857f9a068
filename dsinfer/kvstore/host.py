"""The host-memory tier: grain payloads in (pinned, on CUDA) host memory under a byte budget.

LRU: a get moves an entry to the tail; when a put takes the bytes held past ``high`` x budget, entries go from the
head until at most ``low`` x budget remain. An entry unused for longer than its TTL is a miss (and removed).
Thread-safe (the store's writer and loader threads and the runner all call it). The keys added and removed since
the last ``take_events`` are kept, in order, for the engine's index (``index.StoreIndex``), which mirrors what is here.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import torch

from dsinfer.kvstore.counters import Counters


class HostTier:
    def __init__(self, capacity_bytes: int, counters: Counters, high: float = 0.95, low: float = 0.85,
                 pin: bool = False):
        self.capacity = capacity_bytes
        self.high, self.low = high * capacity_bytes, low * capacity_bytes
        self.pin = pin
        self.counters = counters
        self.used = 0
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, float, float]] = OrderedDict()  # payload, ttl, used at
        self._lock = threading.Lock()
        self._events: list[tuple[bytes, bool]] = []  # (key, now present), in order

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, now: float | None = None) -> torch.Tensor | None:
        now = time.time() if now is None else now
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            payload, ttl_s, last = entry
            if now - last > ttl_s:
                self._drop(key)
                self.counters.add("expiries")
                return None
            self._entries[key] = (payload, ttl_s, now)
            self._entries.move_to_end(key)
            return payload

    def put(self, key: bytes, payload: torch.Tensor, ttl_s: float, now: float | None = None) -> bool:
        """Keep ``payload`` (uint8, on the host; copied into pinned memory when the tier pins and it is not);
        False when it cannot fit at all."""
        now = time.time() if now is None else now
        size = payload.numel()
        if size > self.high:
            return False
        if self.pin and not payload.is_pinned():
            payload = payload.pin_memory()
        with self._lock:
            if key in self._entries:  # refreshed: the newest TTL, used now
                self.used -= self._entries[key][0].numel()
            else:
                self._events.append((key, True))
            self._entries[key] = (payload, ttl_s, now)
            self._entries.move_to_end(key)
            self.used += size
            if self.used > self.high:
                while self._entries and self.used > self.low:
                    self._drop(next(iter(self._entries)))
                    self.counters.add("evictions_host")
        return True

    def sweep(self, now: float | None = None) -> int:
        """Drop every expired entry; -> how many."""
        now = time.time() if now is None else now
        with self._lock:
            expired = [k for k, (_, ttl_s, last) in self._entries.items() if now - last > ttl_s]
            for key in expired:
                self._drop(key)
        self.counters.add("expiries", len(expired))
        return len(expired)

    def discard(self, key: bytes) -> None:
        with self._lock:
            if key in self._entries:
                self._drop(key)

    def take_events(self) -> list[tuple[bytes, bool]]:
        """(key, True: added / False: removed) since the last call, in order."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def _drop(self, key: bytes) -> None:
        payload, _, _ = self._entries.pop(key)
        self.used -= payload.numel()
        self._events.append((key, False))
