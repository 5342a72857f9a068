"""One replica as the router sees it: its health, its circuit breaker, its load and the prefixes it was sent.

Load has two sources: the replica's ``GET /load`` (its last engine step: running and waiting requests, KV tokens
in use) and the router's own counts since that poll (requests begun, their prompt tokens), so that a burst
between two polls is not all sent to the replica that looked idle at the last one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

STATES = ("healthy", "ejected", "removed")


@dataclass
class Breaker:
    """Consecutive request failures open it for ``cooldown_s``; then one trial request is let through (half open):
    its success closes it, its failure opens it again."""

    failures_to_open: int
    cooldown_s: float
    failures: int = 0
    open_until: float | None = None  # None: closed
    trial_in_flight: bool = False

    @property
    def is_open(self) -> bool:
        return self.open_until is not None

    def allows(self, now: float) -> bool:
        if self.open_until is None:
            return True
        return now >= self.open_until and not self.trial_in_flight

    def on_begin(self, now: float) -> None:
        if self.open_until is not None and now >= self.open_until:
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.failures, self.open_until, self.trial_in_flight = 0, None, False

    def on_failure(self, now: float) -> bool:
        """Count a failure; True when this one opened the breaker."""
        self.failures += 1
        was_open = self.open_until is not None
        if self.trial_in_flight or self.failures >= self.failures_to_open:
            self.open_until, self.trial_in_flight = now + self.cooldown_s, False
            return not was_open
        return False


@dataclass
class Replica:
    url: str
    role: str = "mixed"  # mixed | prefill | decode
    breaker: Breaker = field(default_factory=lambda: Breaker(3, 5.0))
    lru_blocks: int = 1 << 20  # prefix blocks remembered when /load does not give the KV capacity
    state: str = "ejected"  # until its first health check passes
    load: dict[str, Any] = field(default_factory=dict)  # the last /load answer
    in_flight: int = 0  # requests the router has open on it now
    ok_streak: int = 0
    fail_streak: int = 0
    num_routed: int = 0  # requests sent to it, all time
    _begun_since_poll: int = 0
    _ended_since_poll: int = 0
    _tokens_since_poll: int = 0
    _blocks: OrderedDict = field(default_factory=OrderedDict)  # prefix block hashes sent to it, LRU order

    # ----------------------------------------------------------------- availability
    def available(self, now: float | None = None) -> bool:
        return self.state == "healthy" and self.breaker.allows(time.monotonic() if now is None else now)

    def state_label(self, now: float | None = None) -> str:
        """healthy | ejected | removed | open (healthy but its breaker is open)."""
        if self.state == "healthy" and self.breaker.is_open:
            return "open"
        return self.state

    # ----------------------------------------------------------------- load
    def observe(self, load: dict[str, Any]) -> None:
        """A fresh ``/load`` answer: the router's counts since the last one start again."""
        self.load = load
        self._begun_since_poll = self._ended_since_poll = self._tokens_since_poll = 0

    @property
    def num_requests(self) -> float:
        """Running + waiting at the last poll, with the requests begun and ended since; at least the router's own
        open requests."""
        polled = self.load.get("num_running", 0) + self.load.get("num_waiting", 0)
        return max(polled + self._begun_since_poll - self._ended_since_poll, self.in_flight, 0)

    @property
    def num_kv_tokens(self) -> float:
        """KV tokens in use and prompt tokens waiting at the last poll, with the prompt tokens sent since."""
        return self.load.get("num_kv_tokens", 0) + self.load.get("num_waiting_tokens", 0) + self._tokens_since_poll

    @property
    def max_num_seqs(self) -> int:
        return int(self.load.get("max_num_seqs") or 256)

    @property
    def kv_capacity_tokens(self) -> int | None:
        return self.load.get("kv_capacity_tokens")

    @property
    def block_size(self) -> int | None:
        return self.load.get("block_size")

    @property
    def store_dir(self) -> str | None:
        return self.load.get("kv_store_dir")

    def begin(self, num_tokens: int, now: float | None = None) -> None:
        self.in_flight += 1
        self.num_routed += 1
        self._begun_since_poll += 1
        self._tokens_since_poll += num_tokens
        self.breaker.on_begin(time.monotonic() if now is None else now)

    def end(self) -> None:
        self.in_flight -= 1
        self._ended_since_poll += 1

    # ----------------------------------------------------------------- prefixes
    def cached_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` the router has sent this replica (and it may still hold)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def remember(self, hashes: Sequence[bytes]) -> None:
        """``hashes`` were sent here: most recently used now; the oldest beyond the replica's KV capacity go."""
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        capacity = self.lru_blocks
        if self.kv_capacity_tokens and self.block_size:
            capacity = max(self.kv_capacity_tokens // self.block_size, 1)
        while len(self._blocks) > capacity:
            self._blocks.popitem(last=False)

    def forget_prefixes(self) -> None:
        """The replica restarted or was ejected: what it held is gone."""
        self._blocks.clear()
