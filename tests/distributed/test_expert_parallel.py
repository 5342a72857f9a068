"""Expert parallelism on 2 spawned gloo ranks against the single-rank MoE, with EPLB maps spanning the ranks."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsinfer.distributed.expert_parallel import EPGroup, ep_moe, ep_moe_replicated, local_slots
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


def _rank(rank: int, world: int, init: str, cfgs: dict[int, dict]) -> None:
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
        _check_moe_blocks(rank, world, cfgs)
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_the_single_rank_moe(tmp_path):
    """``ep_moe`` against the one-rank MoE, then DeepseekMoE partitioned over 2 EP ranks (``CASES``): the tokens
    of DP attention through ``ep_moe``'s all-to-all, or the same tokens on both ranks through
    ``ep_moe_replicated`` and the all-reduce; with EPLB's redundant slots or without; V2's softmax gate and V3's
    grouped sigmoid gate. One spawn for all (a rank's start costs seconds)."""
    cfgs = {2: _cfg(2), 3: _cfg(3)}  # built here: the ranks need not import transformers
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", cfgs), nprocs=2, join=True)


def test_each_rank_part_of_the_replicated_moe_sums_to_the_whole():
    """Two ranks' parts (4 slots each, eager and CUDA-graph-static) add up to the one-rank MoE."""
    w13, w2, gate, _ = _weights()
    w13, w2 = torch.cat([w13, w13[:2]]), torch.cat([w2, w2[:2]])  # 8 slots: experts 0..5, replicas of 0 and 1
    x = _tokens(0, 0)
    weights, ids = select_experts(x @ gate.t(), TOP_K)
    reference = fused_moe(x, w13, w2, weights, ids)
    for static in (False, True):
        parts = [ep_moe_replicated(x, weights, ids, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], r * 4, static)
                 for r in range(2)]
        torch.testing.assert_close(parts[0] + parts[1], reference, rtol=1e-5, atol=1e-5)
        assert not torch.equal(parts[0], reference)  # each rank holds a part only


def test_physical_experts_must_divide_over_the_ranks():
    with pytest.raises(ValueError, match="7 physical experts do not divide over 2 EP ranks"):
        local_slots(7, EPGroup(0, 2))
    with pytest.raises(ValueError, match="EP rank 2 is not in"):
        EPGroup(2, 2)


def _moe_block(cfg: dict, parallel, slots: ExpertSlots | None):
    from dsinfer.config import KernelConfig
    from dsinfer.models.deepseek.blocks import DeepseekMoE, router_config
    from dsinfer.models.deepseek.model import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    variant = (DeepseekV3ForCausalLM if cfg["model_type"] == "deepseek_v3" else DeepseekV2ForCausalLM).variant
    return DeepseekMoE(cfg, None, router_config(cfg, variant["router"]), KernelConfig(fuse_shared_experts=False),
                       tp=parallel, expert_slots=slots)


def _reference_block(cfg: dict):
    """One rank's DeepseekMoE with seeded random weights (and a hot expert 0)."""
    from dsinfer.distributed.state import SINGLE

    torch.manual_seed(0)
    block = _moe_block(cfg, SINGLE, None)
    for param in block.parameters():
        param.data.normal_(0.0, 0.2)
    block.gate.weight.data[0] *= 3
    if block.gate.e_score_correction_bias is not None:
        block.gate.e_score_correction_bias.data.zero_()
    return block


def _load_like(block, reference, tp_rank: int, tp_size: int) -> None:
    """The EP block's weights from the reference's: the experts through their loader (the stacked layout), the
    shared MLP's intermediate columns sliced for this tensor-parallel rank."""
    num_routed = reference.experts.num_routed
    for name, param in block.named_parameters():
        source = dict(reference.named_parameters())[name].data
        if name.startswith("experts."):
            param.weight_loader(param, source[:num_routed])
        elif name.endswith("gate_up_proj.weight"):  # [gate; up] rows, each cut to this rank's columns
            param.data.copy_(torch.cat([part.chunk(tp_size)[tp_rank] for part in source.chunk(2)]))
        elif name.endswith("down_proj.weight"):
            param.data.copy_(source.chunk(tp_size, dim=1)[tp_rank])
        else:
            param.data.copy_(source)
    block.process_weights_after_loading()


CASES = [(2, 1, None), (2, 2, 2), (3, 2, None), (3, 1, 2)]  # (DeepSeek version, dp_size, redundant experts)


def _check_moe_blocks(rank: int, world: int, cfgs: dict[int, dict]) -> None:
    from dsinfer.distributed.state import ParallelState

    for version, dp_size, redundant in CASES:
        cfg = cfgs[version]
        tp_size = world // dp_size
        parallel = ParallelState(tp_size, rank % tp_size, dist.group.WORLD if tp_size > 1 else None,
                                 ep_size=world, ep_rank=rank, ep_group=dist.group.WORLD, dp_size=dp_size)
        reference = _reference_block(cfg)
        slots = None if redundant is None else ExpertSlots(redundant, 1)
        block = _moe_block(cfg, parallel, slots)
        per_rank = (cfg["n_routed_experts"] + (redundant or 0)) // world + (slots is not None)
        assert block.experts.w13.shape[0] == per_rank  # this rank's share of the experts (and its spare)
        _load_like(block, reference, rank % tp_size, tp_size)
        for case in range(3):
            # DP attention: each rank its own tokens (one rank none); otherwise every rank the same ones
            x = _tokens(rank if dp_size > 1 else 0, case).repeat(1, cfg["hidden_size"] // HIDDEN)
            with torch.no_grad():
                torch.testing.assert_close(block(x), reference(x), rtol=1e-5, atol=1e-5)


def _cfg(version: int) -> dict:
    from tests.models.test_deepseek import v2_config, v3_config

    return (v2_config() if version == 2 else v3_config()).to_dict()

