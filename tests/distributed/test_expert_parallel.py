"""Expert parallelism on 2 spawned gloo ranks against the single-rank MoE, with EPLB maps spanning the ranks."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsinfer.distributed.expert_parallel import EPGroup, ep_moe, local_slots
from dsinfer.layers.moe import ExpertMap, ExpertSlots
from dsinfer.ops.moe import fused_moe, select_experts

HIDDEN, INTER, EXPERTS, TOP_K, REDUNDANT = 16, 8, 6, 3, 2
TOKENS = (7, 0, 5)  # per rank and case: a rank with no tokens still takes part in every exchange


def _weights():
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    gate = torch.randn(EXPERTS, HIDDEN, generator=gen)
    gate[0] *= 4  # skewed: expert 0 is hot
    shared = torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
    return w13, w2, gate, shared


def _tokens(rank: int, case: int) -> torch.Tensor:
    return torch.randn(TOKENS[(case + rank) % 3], HIDDEN, generator=torch.Generator().manual_seed(10 * case + rank))


def _placement() -> list[int]:
    """Physical slot -> logical expert, 8 slots over 2 ranks: expert 0 has a replica on each rank, expert 3
    two on rank 1 (what a planner could give; no spares: storage slot = physical id)."""
    return [0, 1, 2, 4, 0, 3, 3, 5]


def _rank(rank: int, world: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.set_num_threads(1)
        ep = EPGroup(rank, world)
        w13, w2, gate, shared_w = _weights()
        slot_log = _placement()
        expert_map = ExpertMap(EXPERTS, 0, ExpertSlots(REDUNDANT, 0))
        expert_map.assign(slot_log)
        mine = local_slots(len(slot_log), ep)
        local13, local2 = w13[[slot_log[s] for s in mine]], w2[[slot_log[s] for s in mine]]
        for case in range(3):
            x = _tokens(rank, case)
            weights, ids = select_experts(x @ gate.t(), TOP_K)
            reference = fused_moe(x, w13, w2, weights, ids) + x @ shared_w.t()  # one rank, no EPLB
            out = ep_moe(x, weights, expert_map(ids, TOP_K), local13, local2, ep, shared=lambda h: h @ shared_w.t())
            torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
            if case == 0 and rank == 0:  # the hot expert's tokens went to both ranks' replicas
                slots = expert_map(ids, TOP_K)[ids == 0]
                assert set(slots.tolist()) == {0, 4}
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_the_single_rank_moe(tmp_path):
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}"), nprocs=2, join=True)


def test_physical_experts_must_divide_over_the_ranks():
    with pytest.raises(ValueError, match="7 physical experts do not divide over 2 EP ranks"):
        local_slots(7, EPGroup(0, 2))
    with pytest.raises(ValueError, match="EP rank 2 is not in"):
        EPGroup(2, 2)
