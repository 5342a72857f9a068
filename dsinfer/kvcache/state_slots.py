"""State slots: a fixed number of per-sequence state areas (``core.kv_cache_spec.StateSlotSpec``), handed out whole.

Invariants: a slot is free or held by exactly one request; the lowest free slot is handed out first (so a small
batch touches few slots).
"""

from __future__ import annotations

import heapq


class StateSlotPool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a state slot pool needs at least 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are held")
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise RuntimeError(f"state slot {slot} released twice or never held (of {self.num_slots})")
        heapq.heappush(self._free, slot)
