"""Choosing a replica for one request. Every policy is ``choose(replicas, request) -> (replica, reason)`` over the
replicas available now (never empty: the pool answers 503 before asking), and never touches the network.

- ``round_robin``: in turn, for comparison;
- ``power_of_two``: the less loaded of two picked at random (a cheap baseline);
- ``load_aware``: DeepInfer's decode balancing on two axes at once, requests (the batch size) and KV tokens (the
  attention cost): each replica is scored by the fuller of the two after taking this request,
  ``max((requests + 1) / max_num_seqs, (kv_tokens + prompt) / kv_capacity)``, and the lowest score wins. A short
  request goes where few requests run even if their KV is long, a long one where the KV is light; ties rotate
  (so that misses never pile onto the first replica);
- ``prefix_aware``: the replica holding the longest prefix of the request's block hashes (as the router sent
  them) unless its requests are over the least loaded replica's by ``balance_abs`` and ``balance_rel`` times
  (then load-aware: cache affinity must not pile onto an overloaded replica); a miss is load-aware. With one
  shared KV store behind every replica, every replica hits: load-aware alone;
- ``PrefillBuckets``: prefill replicas of P/D, per prompt length bucket (DeepInfer's <16k, 16-64k, 64-256k,
  >=256k), replicas re-allocated to buckets by demand every ``rebalance_s``.
"""

from __future__ import annotations

import abc
import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsinfer.router.replica import Replica
from dsinfer.router.settings import PREFILL_BUCKETS, RouterSettings


@dataclass
class RequestInfo:
    """What the policies know of a request: its prompt length and its prompt's block hashes (by block size)."""

    num_tokens: int
    hashes_by_block_size: dict[int, list[bytes]] = field(default_factory=dict)

    def hashes(self, block_size: int | None) -> list[bytes]:
        return self.hashes_by_block_size.get(block_size, []) if block_size else []


def load_score(replica: Replica, num_tokens: int) -> tuple[float, float]:
    """(the fuller axis, the sum of both) once ``replica`` takes a request of ``num_tokens`` prompt tokens."""
    requests = (replica.num_requests + 1) / replica.max_num_seqs
    capacity = replica.kv_capacity_tokens or 1 << 20
    kv = (replica.num_kv_tokens + num_tokens) / capacity
    return max(requests, kv), requests + kv


class Policy(abc.ABC):
    name = ""

    @abc.abstractmethod
    def choose(self, replicas: Sequence[Replica], request: RequestInfo) -> tuple[Replica, str]:
        """The replica for ``request`` and the reason (a metrics label)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[Replica], request: RequestInfo) -> tuple[Replica, str]:
        replica = replicas[self._next % len(replicas)]
        self._next += 1
        return replica, "round_robin"


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, replicas: Sequence[Replica], request: RequestInfo) -> tuple[Replica, str]:
        pair = self._rng.sample(list(replicas), min(2, len(replicas)))
        return min(pair, key=lambda r: load_score(r, request.num_tokens)), "power_of_two"


class LoadAware(Policy):
    name = "load_aware"

    def __init__(self) -> None:
        self._turn = 0

    def least_loaded(self, replicas: Sequence[Replica], num_tokens: int) -> Replica:
        """The lowest score; among equal scores, the next in turn (the rotation starts one further each call)."""
        start, self._turn = self._turn % len(replicas), self._turn + 1
        rotated = [*replicas[start:], *replicas[:start]]
        return min(rotated, key=lambda r: load_score(r, num_tokens))

    def choose(self, replicas: Sequence[Replica], request: RequestInfo) -> tuple[Replica, str]:
        return self.least_loaded(replicas, request.num_tokens), "load"


class PrefixAware(Policy):
    name = "prefix_aware"

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.load = LoadAware()

    def choose(self, replicas: Sequence[Replica], request: RequestInfo) -> tuple[Replica, str]:
        dirs = {r.store_dir for r in replicas}
        if len(replicas) > 1 and len(dirs) == 1 and None not in dirs:
            return self.load.least_loaded(replicas, request.num_tokens), "shared_store"
        matched = [(r.cached_blocks(request.hashes(r.block_size)) * (r.block_size or 0), r) for r in replicas]
        best_tokens = max(tokens for tokens, _ in matched)
        if best_tokens < max(self.settings.min_prefix_tokens, 1):
            return self.load.least_loaded(replicas, request.num_tokens), "prefix_miss"
        best = self.load.least_loaded([r for tokens, r in matched if tokens == best_tokens], request.num_tokens)
        least = min(r.num_requests for r in replicas)
        if (best.num_requests - least > self.settings.balance_abs
                and best.num_requests > self.settings.balance_rel * least):
            return self.load.least_loaded(replicas, request.num_tokens), "prefix_overloaded"
        return best, "prefix_hit"


def make_policy(settings: RouterSettings, rng: random.Random | None = None) -> Policy:
    if settings.policy == "round_robin":
        return RoundRobin()
    if settings.policy == "power_of_two":
        return PowerOfTwo(rng)
    if settings.policy == "load_aware":
        return LoadAware()
    return PrefixAware(settings)


class PrefillBuckets:
    """Prefill replicas per prompt length bucket. Each bucket's demand (prompt tokens, halved at each rebalance so
    that it follows the traffic) decides how many replicas it gets: at least one for every bucket with demand,
    while replicas last (largest demand first), the rest in proportion. A request goes to the least loaded
    replica (prompt tokens in flight first) of its bucket, or of all of them when its bucket has none."""

    def __init__(self, bounds: Sequence[int] = PREFILL_BUCKETS, rebalance_s: float = 10.0):
        self.bounds = tuple(bounds)
        self.rebalance_s = rebalance_s
        self.demand = [0.0] * (len(self.bounds) + 1)
        self.assignment: dict[str, int] = {}  # replica url -> bucket
        self._last_rebalance: float | None = None
        self._turn = 0

    def bucket(self, num_tokens: int) -> int:
        return bisect.bisect_right(self.bounds, num_tokens)  # bucket i: bounds[i-1] <= tokens < bounds[i]

    def choose(self, replicas: Sequence[Replica], request: RequestInfo, now: float) -> tuple[Replica, str]:
        b = self.bucket(request.num_tokens)
        self.demand[b] += max(request.num_tokens, 1)
        stale = self._last_rebalance is None or now - self._last_rebalance >= self.rebalance_s
        if stale or any(r.url not in self.assignment for r in replicas):
            self.rebalance([r.url for r in replicas], now)
        group = [r for r in replicas if self.assignment.get(r.url) == b]
        reason = f"prefill_bucket_{b}" if group else "prefill_spill"
        group = group or list(replicas)
        start, self._turn = self._turn % len(group), self._turn + 1  # ties rotate
        rotated = [*group[start:], *group[:start]]
        return min(rotated, key=lambda r: (r.num_kv_tokens, r.num_requests)), reason

    def counts(self, num_replicas: int) -> list[int]:
        """Replicas per bucket for the current demand."""
        counts = [0] * len(self.demand)
        wanted = sorted((d, i) for i, d in enumerate(self.demand) if d > 0)[::-1]
        for _, i in wanted[:num_replicas]:
            counts[i] = 1
        total = sum(self.demand)
        for _ in range(num_replicas - sum(counts)):
            if not total:
                counts[0] += 1
                continue
            # the bucket furthest below its share of the replicas
            i = max(range(len(counts)), key=lambda j: self.demand[j] / total * num_replicas - counts[j])
            counts[i] += 1
        return counts

    def rebalance(self, urls: Sequence[str], now: float) -> None:
        counts, order = self.counts(len(urls)), sorted(urls)
        self.assignment = {}
        for b, n in enumerate(counts):
            for url in order[:n]:
                self.assignment[url] = b
            order = order[n:]
        self.demand = [d / 2 for d in self.demand]
        self._last_rebalance = now
