"""A byte-bounded LRU map: compiled grammars are kept while their summed size stays under a limit."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteBoundedLRU(Generic[V]):
    """``put`` evicts least-recently-used entries until ``bytes_used <= limit_bytes``; thread-safe.

    An entry larger than the whole limit is not stored (the caller still has it). ``size_of`` gives an entry's
    bytes once, at insertion.
    """

    def __init__(self, limit_bytes: int, size_of: Callable[[V], int]):
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._size_of = size_of
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, value: V) -> None:
        size = max(int(self._size_of(value)), 1)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes_used -= old[1]
            if size > self.limit_bytes:
                return
            self._entries[key] = (value, size)
            self.bytes_used += size
            while self.bytes_used > self.limit_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes_used -= evicted
                self.evictions += 1
