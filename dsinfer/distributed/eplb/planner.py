"""The EPLB planner: per-layer logical expert loads -> a placement of physical expert replicas on EP ranks.

A pure function of its inputs (numpy on the host; no torch, no state), ties always broken towards the lower
index, so every rank that plans from the same loads gets the same placement.

Two policies, as DeepSeek's EPLB describes them:
- **hierarchical** (when the expert groups divide evenly over the nodes): the groups are packed onto nodes with
  balanced loads (a group's experts stay on one node, so group-limited routing keeps its traffic inside it), each
  node replicates its own experts into its share of the physical slots, and each node's physical experts are
  packed onto its GPUs;
- **global** (otherwise, or asked for): the same with one group and one node, so replicas go anywhere.

Replication gives each extra slot to the logical expert with the highest load per replica (``load / count``,
DeepSeek's rule), or (our addition, kept when it packs better) splits every expert until a replica carries at
most a cap near the mean GPU load and gives the slots left to the coldest experts. Packing puts the items,
heaviest first, into the lightest pack that still has room (every pack holds exactly ``items / packs``), then
swaps pairs of items between the heaviest pack and another while that lowers the heavier of the two (our
refinement on top of DeepSeek's greedy packing: it matters when a pack holds only a few items).

Physical ids are rank-major: rank r holds physical experts ``[r * P / R, (r + 1) * P / R)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POLICIES = ("auto", "hierarchical", "global")
# replica caps tried besides DeepSeek's replication, as fractions of the mean GPU load (``_replicate_and_pack``)
_CAPS = (0.7, 0.8, 0.9, 0.95, 1.0)
_MAX_SWAPS_PER_ITEM = 4  # refinement bound: swaps tried per item of the packing (it stops earlier when stuck)


@dataclass(frozen=True)
class Placement:
    """Where each layer's logical experts live.

    ``phy2log [L, P]``: the logical expert of each physical slot; ``log2phy [L, E, R]``: each logical expert's
    physical slots in replica order, padded with -1 to R = the most replicas any expert has; ``logcnt [L, E]``:
    replicas per logical expert (>= 1, summing to P in every layer)."""

    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    def rank_loads(self, loads: np.ndarray, num_ranks: int) -> np.ndarray:
        """[L, ranks]: each rank's share of ``loads [L, E]``, a logical expert's load split evenly over its
        replicas (the router spreads its tokens so)."""
        per_replica = np.take_along_axis(loads / self.logcnt, self.phy2log, axis=1)
        return per_replica.reshape(loads.shape[0], num_ranks, -1).sum(axis=2)


def static_placement(num_layers: int, num_logical: int, num_physical: int) -> Placement:
    """The placement before any load is known: physical p holds logical ``p % E`` (experts in order, the
    redundant slots replicating the first ones)."""
    phy2log = np.tile(np.arange(num_physical) % num_logical, (num_layers, 1))
    return placement_from_phy2log(phy2log, num_logical)


def placement_from_phy2log(phy2log: np.ndarray, num_logical: int) -> Placement:
    """The ``Placement`` of a physical -> logical map (replica order: ascending physical id)."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    num_layers, num_physical = phy2log.shape
    logcnt = np.zeros((num_layers, num_logical), dtype=np.int64)
    for layer in range(num_layers):
        logcnt[layer] = np.bincount(phy2log[layer], minlength=num_logical)
    if (logcnt == 0).any():
        layer, expert = np.argwhere(logcnt == 0)[0]
        raise ValueError(f"layer {layer}: logical expert {expert} has no physical replica")
    log2phy = np.full((num_layers, num_logical, int(logcnt.max())), -1, dtype=np.int64)
    for layer in range(num_layers):
        seen = np.zeros(num_logical, dtype=np.int64)
        for phy, log in enumerate(phy2log[layer]):
            log2phy[layer, log, seen[log]] = phy
            seen[log] += 1
    return Placement(phy2log, log2phy, logcnt)


def moe_lb(loads: np.ndarray, placement: Placement, num_ranks: int) -> np.ndarray:
    """[L]: each layer's balancedness, max rank load / mean rank load (1.0 is perfect; 1.0 for a layer with
    no load)."""
    ranks = placement.rank_loads(np.asarray(loads, dtype=np.float64), num_ranks)
    mean = ranks.mean(axis=1)
    return np.where(mean > 0, ranks.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


def balancedness(physical_load: np.ndarray, num_ranks: int) -> tuple[np.ndarray, float]:
    """(moe_lb per layer, overall) of measured loads per physical expert [L, P] (rank-major): a layer's slowest
    rank over its mean rank; overall, the layers' slowest ranks summed over their means summed (each layer
    waits for its slowest rank, so that is the share of MoE time lost to imbalance). 1.0 where nothing ran."""
    ranks = np.asarray(physical_load, dtype=np.float64).reshape(physical_load.shape[0], num_ranks, -1).sum(axis=2)
    peak, mean = ranks.max(axis=1), ranks.mean(axis=1)
    per_layer = np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)
    return per_layer, float(peak.sum() / mean.sum()) if mean.sum() > 0 else 1.0


def load_summary(expert_load: list[list[float]], counters: dict[str, int], num_ranks: int) -> dict:
    """The engine's EPLB stats: moe_lb per MoE layer and overall (``balancedness``) of an expert-load window
    [L, P], beside the rebalances' totals (``counters``: rank 0's)."""
    per_layer, overall = balancedness(np.asarray(expert_load), num_ranks=num_ranks)
    return {"moe_lb": per_layer.tolist(), "moe_lb_overall": overall,
            "num_rebalances": counters.get("num_rebalances", 0), "num_switches": counters.get("num_switches", 0),
            "received_bytes": counters.get("received_bytes", 0)}


def rebalance_experts(loads: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int,
                      policy: str = "auto") -> Placement:
    """The placement of ``num_physical`` physical experts per layer on ``num_gpus`` ranks for ``loads [L, E]``
    (tokens routed to each logical expert over the window). ``num_groups``: the router's expert groups
    (``n_group``); ``num_nodes``: nodes of ``num_gpus / num_nodes`` GPUs each. ``policy``: "auto" takes the
    hierarchical one when the groups divide over the nodes, else the global one."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2:
        raise ValueError(f"loads must be [layers, logical experts], got shape {loads.shape}")
    num_layers, num_logical = loads.shape
    _check(num_logical, num_physical, num_groups, num_nodes, num_gpus, policy)
    hierarchical = policy == "hierarchical" or (policy == "auto" and num_groups % num_nodes == 0)
    if not hierarchical:
        num_groups = num_nodes = 1
    phy2log = np.stack([_plan_layer(loads[layer], num_physical, num_groups, num_nodes, num_gpus)
                        for layer in range(num_layers)])
    return placement_from_phy2log(phy2log, num_logical)


def _check(num_logical: int, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int,
           policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not one of {POLICIES}")
    for name, value in (("num_groups", num_groups), ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if num_physical < num_logical:
        raise ValueError(f"num_physical={num_physical} must be >= the {num_logical} logical experts")
    if num_physical % num_gpus:
        raise ValueError(f"num_physical={num_physical} physical experts do not divide over num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} is not a multiple of num_nodes={num_nodes}")
    if num_logical % num_groups:
        raise ValueError(f"{num_logical} logical experts do not divide into num_groups={num_groups}")
    if policy == "hierarchical" and num_groups % num_nodes:
        raise ValueError(f"policy='hierarchical' needs num_groups={num_groups} divisible by num_nodes={num_nodes}")


def _plan_layer(load: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int) -> np.ndarray:
    """One layer's physical -> logical map (rank-major, see the module doc)."""
    num_logical = load.shape[0]
    group_size = num_logical // num_groups
    # 1. groups onto nodes
    group_node, _ = balanced_packing(load.reshape(num_groups, group_size).sum(axis=1), num_nodes)
    phy2log = []
    gpus_per_node, physical_per_node = num_gpus // num_nodes, num_physical // num_nodes
    for node in range(num_nodes):
        groups = np.flatnonzero(group_node == node)  # ascending: deterministic
        experts = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
        replica_of, pack, slot = _replicate_and_pack(load[experts], physical_per_node, gpus_per_node)
        order = np.lexsort((slot, pack))  # by GPU, then by place in it
        phy2log.append(experts[replica_of[order]])
    return np.concatenate(phy2log)


def _replicate_and_pack(load: np.ndarray, num_physical: int, num_gpus: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logical expert of each physical slot, its GPU, its place there) for one node: 2. replicas, 3. packing.

    The replicas of DeepSeek's rule (``replicate_experts``) all end near the same load per replica, which packs
    badly when a GPU holds only a few slots (two replicas of ~0.6 of a GPU's share cannot share a GPU). So the
    candidates also include replica counts capped at a fraction of the mean GPU load (``capped_replicas``), and
    the candidate whose packing has the lightest heaviest GPU wins (the first among equals: DeepSeek's rule)."""
    candidates = [replicate_experts(load, num_physical)]
    mean = load.sum() / num_gpus
    if mean > 0:
        candidates += [c for cap in _CAPS if (c := capped_replicas(load, num_physical, cap * mean)) is not None]
    best = None
    for replica_of, count in candidates:
        items = load[replica_of] / count[replica_of]
        pack, slot = balanced_packing(items, num_gpus)
        heaviest = np.bincount(pack, weights=items, minlength=num_gpus).max()
        if best is None or heaviest < best[0] - 1e-12 * max(heaviest, 1.0):
            best = (heaviest, replica_of, pack, slot)
    return best[1], best[2], best[3]


def capped_replicas(load: np.ndarray, num_physical: int, cap: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Replicas as ``replicate_experts`` returns them, each expert split until a replica carries at most ``cap``,
    the slots left over replicating the coldest experts (the lowest load per replica: tiny items fill GPUs that
    hold a large replica); None when the cap needs more than ``num_physical`` slots."""
    count = np.maximum(1, np.ceil(load / cap)).astype(np.int64)
    if count.sum() > num_physical:
        return None
    for _ in range(num_physical - int(count.sum())):
        count[int(np.argmin(load / count))] += 1
    return np.repeat(np.arange(load.shape[0]), count), count


def replicate_experts(load: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray]:
    """(logical expert of each physical slot [P], replicas of each logical expert [E]): slots 0..E-1 hold the
    experts once each; every further slot replicates the expert with the highest load per replica (the lowest
    index among equals)."""
    num_logical = load.shape[0]
    count = np.ones(num_logical, dtype=np.int64)
    replica_of = list(range(num_logical))
    for _ in range(num_physical - num_logical):
        hot = int(np.argmax(load / count))  # argmax: the first of equal maxima
        replica_of.append(hot)
        count[hot] += 1
    return np.asarray(replica_of, dtype=np.int64), count


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """(pack of each item [n], its place in the pack [n]): n items into ``num_packs`` packs of exactly n / packs
    items each, the heaviest pack as light as the greedy order and the swap refinement make it."""
    n = weight.shape[0]
    if n % num_packs:
        raise ValueError(f"{n} items do not divide into {num_packs} packs")
    per_pack = n // num_packs
    pack = np.empty(n, dtype=np.int64)
    if per_pack == 1 or num_packs == 1:
        pack[:] = np.arange(n) if per_pack == 1 else 0
    else:
        totals, sizes = np.zeros(num_packs), np.zeros(num_packs, dtype=np.int64)
        for item in np.argsort(-weight, kind="stable"):  # heaviest first; equal weights by index
            target = int(np.argmin(np.where(sizes < per_pack, totals, np.inf)))
            pack[item] = target
            totals[target] += weight[item]
            sizes[target] += 1
        _refine(weight, pack, num_packs)
    slot = np.empty(n, dtype=np.int64)
    for p in range(num_packs):
        members = np.flatnonzero(pack == p)
        slot[members] = np.arange(members.shape[0])
    return pack, slot


def _refine(weight: np.ndarray, pack: np.ndarray, num_packs: int) -> None:
    """Swap an item of the heaviest pack with a lighter item of another pack while the swap lowers the larger
    of the two packs' totals below the heaviest's (in place; bounded by ``_MAX_SWAPS_PER_ITEM`` per item)."""
    for _ in range(_MAX_SWAPS_PER_ITEM * weight.shape[0]):
        totals = np.bincount(pack, weights=weight, minlength=num_packs)
        heavy = int(np.argmax(totals))
        inside, outside = np.flatnonzero(pack == heavy), np.flatnonzero(pack != heavy)
        delta = weight[inside][:, None] - weight[outside][None, :]  # what the heavy pack gives away
        other = totals[pack[outside]][None, :]
        worse = np.maximum(totals[heavy] - delta, other + delta)
        worse = np.where(delta > 0, worse, np.inf)
        best = np.unravel_index(int(np.argmin(worse)), worse.shape)  # the first of equal minima
        if not worse[best] < totals[heavy] - 1e-12 * max(totals[heavy], 1.0):
            return
        i, j = inside[best[0]], outside[best[1]]
        pack[i], pack[j] = pack[j], heavy
