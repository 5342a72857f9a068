"""EPLB across EP = 2 ranks (gloo, two processes): the planner's placement applied on both ranks in rounds that
keep every expert a replica, expert weights moved between them point to point without a step waiting, the switch
at one step boundary on every rank; outputs unchanged across rebalances and the moved weights byte-identical to
the checkpoint's. The engine runs of EP = 2 with EPLB are in test_expert_parallel_engine.py."""

from __future__ import annotations

import datetime
import random
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsinfer.config import EplbConfig
from dsinfer.distributed.eplb import moves
from dsinfer.layers.moe import ExpertSlots
from tests.distributed.test_expert_parallel import _cfg, _load_like, _moe_block, _reference_block

RANKS = [range(0, 4), range(4, 8)]  # 3 physical experts and a spare per rank


def test_two_ranks_swap_their_only_replicas_in_one_round():
    slot_log = [0, 1, 2, -1, 3, 4, 5, -1]
    targets = [Counter([0, 1, 3]), Counter([2, 4, 5])]
    excess, missing = moves.rank_moves(targets, slot_log, RANKS)
    assert excess == [Counter([2]), Counter([3])] and missing == [Counter([3]), Counter([2])]
    chosen = moves.next_round(slot_log, excess, missing)
    assert chosen == [(0, 2, 3), (1, 3, 2)]  # either alone would leave expert 2 or 3 without a replica
    moves.apply_round(slot_log, chosen, {0: 3, 1: 7}, RANKS)
    assert slot_log == [0, 1, -1, 3, -1, 4, 5, 2]  # each spare took its gain, each lost slot is the new spare


def test_planned_ranks_are_matched_to_the_real_rank_they_overlap_most():
    slot_log = [0, 1, 2, -1, 3, 4, 5, -1]
    # the planner put rank 1's experts first: matched, nothing has to move
    targets = moves.rank_targets(np.array([3, 4, 5, 0, 1, 2]), slot_log, RANKS)
    assert targets == [Counter([0, 1, 2]), Counter([3, 4, 5])]
    excess, missing = moves.rank_moves(targets, slot_log, RANKS)
    assert not any(excess) and not any(missing)


def test_rounds_reach_any_planned_placement_keeping_every_expert():
    rng = random.Random(0)
    for _ in range(200):
        num_logical, per_rank, num_ranks = 6, 4, 3  # 12 physical over 3 ranks, one spare each
        ranks = [range(r * (per_rank + 1), (r + 1) * (per_rank + 1)) for r in range(num_ranks)]
        start = list(range(num_logical)) + [rng.randrange(num_logical) for _ in range(per_rank * num_ranks - 6)]
        rng.shuffle(start)
        goal = list(range(num_logical)) + [rng.randrange(num_logical) for _ in range(per_rank * num_ranks - 6)]
        rng.shuffle(goal)
        slot_log = [e for r in range(num_ranks) for e in start[r * per_rank:(r + 1) * per_rank] + [-1]]
        targets = moves.rank_targets(np.array(goal), slot_log, ranks)
        excess, missing = moves.rank_moves(targets, slot_log, ranks)
        while any(missing):
            chosen = moves.next_round(slot_log, excess, missing)
            assert chosen, "a round must always be possible towards a placement holding every expert"
            spares = {r: next(s for s in ranks[r] if slot_log[s] == -1) for r, _, _ in chosen}
            moves.apply_round(slot_log, chosen, spares, ranks)
            moves.take(excess, missing, chosen)
            assert set(slot_log) - {-1} == set(range(num_logical))
        assert [Counter(slot_log[s] for s in r if slot_log[s] >= 0) for r in ranks] == targets


NUM_STEPS = 40
CONFIG = EplbConfig(window_size=4, step_interval=8, num_redundant_experts=2)


def _balancer_rank(rank: int, world: int, init: str, cfg: dict) -> None:
    from dsinfer.distributed.eplb.balancer import ExpertLoadBalancer
    from dsinfer.distributed.state import ParallelState

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.set_num_threads(1)
        parallel = ParallelState(world, rank, dist.group.WORLD, ep_size=world, ep_rank=rank, ep_group=dist.group.WORLD,
                                 ep_move_group=dist.new_group(backend="gloo"),
                                 ep_host_group=dist.new_group(backend="gloo"))
        references = [_reference_block(cfg) for _ in range(2)]
        blocks = [_moe_block(cfg, parallel, ExpertSlots(CONFIG.num_redundant_experts, 1)) for _ in range(2)]
        for block, reference in zip(blocks, references):
            _load_like(block, reference, rank, world)
        balancer = ExpertLoadBalancer(blocks, CONFIG, 1, torch.device("cpu"), parallel)
        gen = torch.Generator().manual_seed(7)  # the same tokens on both ranks (data_parallel_size 1)
        for step in range(NUM_STEPS):
            x = torch.randn(5, cfg["hidden_size"], generator=gen)
            x[:, :4] += 2.0  # skewed routing: a few experts take most tokens
            with torch.no_grad():
                for block, reference in zip(blocks, references):
                    torch.testing.assert_close(block(x), reference(x), rtol=1e-5, atol=1e-5)
            in_flight = sum(len(r.moves) for r in balancer._rounds if r is not None)
            switched, mid_prefill = balancer.stats.num_switches, step % 6 == 0
            balancer.end_step(mid_prefill)
            # only rounds whose copies started at an earlier boundary switch (a copy has a step to run, none is
            # waited for), and never inside a prefill
            assert balancer.stats.num_switches - switched <= (0 if mid_prefill else in_flight)
        stats = balancer.stats
        assert stats.num_rebalances >= 2 and stats.received_bytes > 0, stats
        gathered = [None] * world
        dist.all_gather_object(gathered, [b.expert_map.slot_log for b in blocks])
        assert gathered[0] == gathered[1]  # both ranks switched to the same maps
        for block, reference in zip(blocks, references):
            slot_log = block.expert_map.slot_log
            assert sorted(set(slot_log) - {-1}) == list(range(cfg["n_routed_experts"]))
            for local, slot in enumerate(block.expert_map.rank_slots(rank)):
                if slot_log[slot] >= 0:  # byte-identical to the checkpoint's expert, wherever it came from
                    assert torch.equal(block.experts.w13[local], reference.experts.w13[slot_log[slot]])
                    assert torch.equal(block.experts.w2[local], reference.experts.w2[slot_log[slot]])
    finally:
        dist.destroy_process_group()


def test_rebalances_over_two_ranks_move_weights_exactly_and_keep_outputs(tmp_path):
    pytest.importorskip("transformers")  # here, not at the top: the spawned ranks import this module
    mp.spawn(_balancer_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", _cfg(2)), nprocs=2, join=True)

