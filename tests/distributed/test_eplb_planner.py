"""The EPLB planner on known cases: replication, packing, both policies, ties, errors."""

from __future__ import annotations

import numpy as np
import pytest

from dsinfer.distributed.eplb.planner import (
    balanced_packing,
    moe_lb,
    placement_from_phy2log,
    rebalance_experts,
    replicate_experts,
    static_placement,
)


def test_replication_gives_each_extra_slot_to_the_highest_load_per_replica():
    replica_of, count = replicate_experts(np.array([6.0, 3.0, 1.0]), 5)
    # 6 -> two replicas of 3; then 3 (expert 0) ties 3 (expert 1): the lower index wins
    assert replica_of.tolist() == [0, 1, 2, 0, 0]
    assert count.tolist() == [3, 1, 1]


def test_packing_fills_every_pack_to_the_same_count_heaviest_first():
    pack, slot = balanced_packing(np.array([5.0, 4.0, 3.0, 2.0, 1.0, 1.0]), 2)
    assert pack.tolist() == [0, 1, 1, 0, 0, 1]
    assert slot.tolist() == [0, 0, 1, 1, 2, 2]
    assert np.bincount(pack, weights=[5, 4, 3, 2, 1, 1]).tolist() == [8.0, 8.0]


def test_packing_swaps_past_the_greedy_order_to_the_optimum():
    weight = np.array([17.0, 13.0, 10.0, 6.0, 6.0, 1.0])
    # greedy alone: {17, 6, 6} = 29 / {13, 10, 1} = 24; the optimum (brute force) is 28
    pack, _ = balanced_packing(weight, 2)
    assert np.bincount(pack, weights=weight).max() == 28.0
    assert np.bincount(pack).tolist() == [3, 3]


def test_global_policy_replicates_the_hot_expert_and_balances_ranks():
    loads = np.array([[90.0, 10.0, 10.0, 10.0]])
    # DeepSeek's rule alone: expert 0 three times, {30, 30, 30, 10, 10, 10} in 3 + 3 slots: 70 / 50 at best
    replica_of, count = replicate_experts(loads[0], 6)
    assert count.tolist() == [3, 1, 1, 1]
    placement = rebalance_experts(loads, 6, num_groups=1, num_nodes=1, num_gpus=2)
    # capped at the mean GPU load (60), expert 0 takes two replicas of 45, and the spare slot splits a cold
    # expert: {45, 10, 5} and {45, 10, 5}
    assert placement.logcnt.tolist() == [[2, 2, 1, 1]]
    assert placement.rank_loads(loads, 2).tolist() == [[60.0, 60.0]]
    assert moe_lb(loads, placement, 2).tolist() == [1.0]
    log2phy = placement.log2phy[0]
    assert sorted(log2phy[0].tolist()) == np.flatnonzero(placement.phy2log[0] == 0).tolist()
    assert log2phy[2].tolist() == [np.flatnonzero(placement.phy2log[0] == 2)[0], -1]
    assert set(placement.phy2log[0, :3].tolist()) & {0} and set(placement.phy2log[0, 3:].tolist()) & {0}


def test_hierarchical_policy_keeps_each_group_on_one_node():
    rng = np.random.default_rng(3)
    loads = rng.integers(1, 100, size=(3, 16)).astype(float)
    placement = rebalance_experts(loads, 24, num_groups=4, num_nodes=2, num_gpus=4, policy="hierarchical")
    for layer in range(3):
        groups_per_node = [set(placement.phy2log[layer, node * 12:(node + 1) * 12] // 4) for node in range(2)]
        assert len(groups_per_node[0]) == len(groups_per_node[1]) == 2
        assert not groups_per_node[0] & groups_per_node[1]
        assert np.bincount(placement.phy2log[layer], minlength=16).min() >= 1
    assert (placement.logcnt.sum(axis=1) == 24).all()


def test_equal_loads_plan_deterministically_to_experts_in_order():
    loads = np.ones((2, 8))
    first = rebalance_experts(loads, 8, num_groups=2, num_nodes=1, num_gpus=4)
    again = rebalance_experts(loads.copy(), 8, num_groups=2, num_nodes=1, num_gpus=4)
    assert (first.phy2log == again.phy2log).all()
    assert (first.logcnt == 1).all()
    assert moe_lb(loads, first, 4).tolist() == [1.0, 1.0]


def test_redundant_experts_lower_moe_lb_on_skewed_loads():
    rng = np.random.default_rng(0)
    loads = rng.zipf(1.5, size=(4, 32)).astype(float)
    before = moe_lb(loads, static_placement(4, 32, 32), 8)
    after = moe_lb(loads, rebalance_experts(loads, 40, num_groups=1, num_nodes=1, num_gpus=8), 8)
    assert (after < before).all()
    assert after.max() < 1.25


def test_placement_from_phy2log_refuses_a_logical_expert_without_replica():
    with pytest.raises(ValueError, match="logical expert 2 has no physical replica"):
        placement_from_phy2log(np.array([[0, 1, 1, 0]]), 3)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_physical": 6}, "num_physical=6 physical experts do not divide over num_gpus=4"),
    ({"num_physical": 7, "num_gpus": 1}, "do not divide into num_groups=3"),
    ({"num_physical": 2}, "must be >= the 4 logical experts"),
    ({"num_physical": 6, "num_gpus": 3, "num_nodes": 2}, "num_gpus=3 is not a multiple of num_nodes=2"),
    ({"policy": "best"}, "policy='best' is not one of"),
])
def test_bad_planner_arguments_are_value_errors(kwargs, message):
    args = {"num_physical": 8, "num_groups": 1, "num_nodes": 1, "num_gpus": 4, **kwargs}
    if "divide into" in message:
        args["num_groups"] = 3
    with pytest.raises(ValueError, match=message):
        rebalance_experts(np.ones((1, 4)), **args)
