"""From the placement a layer has to the one the planner wants, one spare slot per rank at a time.

A layer's storage slots are rank-major (``layers.moe.ExpertMap``): rank r holds ``rank_slots[r]``, its physical
experts and one spare (-1). The planner gives each rank a multiset of logical experts (``Placement.phy2log``'s
row, rank-major); which of the planner's ranks becomes which real rank is free, so each is matched to the real
rank whose experts it overlaps most (fewest moves). Then each rank has ``excess`` experts (held, not wanted) and
``missing`` ones (wanted, not held), as many of each.

A **round** moves at most one expert per rank: rank r copies a missing expert y into its spare (from a replica
on r when it has one, else from another rank) and, at the switch, the spare becomes y and a slot of an excess
expert x becomes the spare. All moves of a round switch together, so the round is valid when every logical
expert keeps a replica after all of its gains and losses: that lets two ranks swap their only replicas of two
experts in one round. ``next_round`` picks, for each rank, the missing expert with the fewest replicas (the
endangered ones first) and the excess expert with the most replicas after the round's gains; a rank whose every
excess expert would vanish sits the round out. Pure functions of lists: every rank computes the same rounds.
"""

from __future__ import annotations

from collections import Counter

import numpy as np


def rank_targets(phy2log: np.ndarray, slot_log: list[int], rank_slots: list[range]) -> list[Counter]:
    """The planner's per-rank multisets (``phy2log`` [P], rank-major) matched to the real ranks: greedily, each
    planned rank in order to the unmatched real rank holding most of it (ties: the lower rank)."""
    num_ranks = len(rank_slots)
    planned = [Counter(part.tolist()) for part in np.asarray(phy2log).reshape(num_ranks, -1)]
    held = [Counter(slot_log[s] for s in slots if slot_log[s] >= 0) for slots in rank_slots]
    targets: list[Counter | None] = [None] * num_ranks
    for plan in planned:
        free = [r for r in range(num_ranks) if targets[r] is None]
        best = max(free, key=lambda r: (sum((plan & held[r]).values()), -r))
        targets[best] = plan
    return targets


def rank_moves(targets: list[Counter], slot_log: list[int], rank_slots: list[range]
               ) -> tuple[list[Counter], list[Counter]]:
    """(excess, missing) per rank: the experts a rank holds beyond its target, and those it lacks."""
    held = [Counter(slot_log[s] for s in slots if slot_log[s] >= 0) for slots in rank_slots]
    return [h - t for h, t in zip(held, targets)], [t - h for h, t in zip(held, targets)]


def next_round(slot_log: list[int], excess: list[Counter], missing: list[Counter]) -> list[tuple[int, int, int]]:
    """The moves of the next round, (rank, losing, gaining) in rank order; [] when no rank can move (nothing
    left, or every move left would take some expert's last replica). See the module doc."""
    counts = Counter(e for e in slot_log if e >= 0)
    active = [r for r, lacking in enumerate(missing) if lacking]
    while active:
        gains = {r: min(missing[r], key=lambda e: (counts[e], e)) for r in active}
        after = counts.copy()
        after.update(gains.values())
        moves, stuck = [], []
        for r in active:
            losing = min(excess[r], key=lambda e: (-after[e], e))
            if after[losing] < 2:
                stuck.append(r)
                continue
            after[losing] -= 1
            moves.append((r, losing, gains[r]))
        if not stuck:
            return moves
        active = [r for r in active if r not in stuck]
    return []


def apply_round(slot_log: list[int], moves: list[tuple[int, int, int]], spares: dict[int, int],
                rank_slots: list[range]) -> list[tuple[int, int]]:
    """Switch a round in ``slot_log`` (in place): each rank's spare (``spares[rank]``) takes its gaining expert,
    the rank's highest slot of its losing expert becomes the spare; -> (spare, freed slot) per move."""
    switched = []
    for rank, losing, gaining in moves:
        dst = spares[rank]
        lost = max(s for s in rank_slots[rank] if slot_log[s] == losing)
        slot_log[dst], slot_log[lost] = gaining, -1
        switched.append((dst, lost))
    return switched


def take(excess: list[Counter], missing: list[Counter], moves: list[tuple[int, int, int]]) -> None:
    """Strike a round's moves off the ranks' excess and missing experts."""
    for rank, losing, gaining in moves:
        excess[rank][losing] -= 1
        missing[rank][gaining] -= 1
        excess[rank] += Counter()  # drops the zero counts
        missing[rank] += Counter()
