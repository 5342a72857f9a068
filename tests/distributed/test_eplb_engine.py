"""EPLB in the engine at EP = 1 on a skewed DeepSeek-V2 checkpoint: counters, redundant experts, rebalances."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.config import EplbConfig
from dsinfer.distributed.eplb.balancer import ExpertLoadBalancer
from tests.distributed.eplb_fixture import save_skewed_v2

pytest.importorskip("transformers")

NEW_TOKENS = 20
REBALANCING = {"num_redundant_experts": 3, "window_size": 4, "step_interval": 8}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("skewed-v2")
    save_skewed_v2(path)
    return path


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 1 for j in range(30 + 9 * i)]} for i in range(4)]


def _llm(ckpt, **kwargs) -> LLM:
    return LLM(str(ckpt), dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=32, **kwargs)


def _greedy(llm: LLM, logprobs: int | None = None):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate(_prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def baseline(ckpt):
    llm = _llm(ckpt)
    return [o.token_ids for o in _greedy(llm)], llm.engine.runner.model


def _instrument(balancer: ExpertLoadBalancer) -> list[dict]:
    """Record, per step boundary, the bytes copied and the maps switched, with whether a prefill was mid-way."""
    events: list[dict] = []
    end_step = balancer.end_step

    def recorded(mid_prefill: bool) -> None:
        copied, switched = balancer.stats.copy_bytes, balancer.stats.num_switches
        end_step(mid_prefill)
        events.append({"mid_prefill": mid_prefill, "copied": balancer.stats.copy_bytes - copied,
                       "switched": balancer.stats.num_switches - switched})

    balancer.end_step = recorded
    return events


def test_counters_count_every_routed_pair_of_the_window(ckpt):
    llm = _llm(ckpt, enable_eplb=True, eplb_config={"window_size": 1000, "step_interval": 10**6})
    outputs = _greedy(llm)
    load = llm.engine.runner.eplb.physical_load()
    forward_tokens = sum(len(p["prompt_token_ids"]) for p in _prompts()) + len(outputs) * (NEW_TOKENS - 1)
    top_k = 3
    assert load.shape == (2, 8)  # two MoE layers, no redundant experts
    assert load.sum(dim=1).tolist() == [float(top_k * forward_tokens)] * 2
    assert load[:, :2].sum() > load[:, 2:].sum() / 3  # the skew: experts 0 and 1 are hot


def test_redundant_experts_leave_greedy_output_unchanged(ckpt, baseline):
    llm = _llm(ckpt, enable_eplb=True, eplb_config={"num_redundant_experts": 4, "step_interval": 10**6})
    assert [o.token_ids for o in _greedy(llm)] == baseline[0]
    eplb = llm.engine.runner.eplb
    # slots 8..11 replicate experts 0..3 (p % 8): the hot experts' tokens are spread over both replicas
    assert eplb.maps[0].slot_log == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, -1]
    load = eplb.physical_load()
    assert load.shape == (2, 12) and (load[:, 8:10] > 0).all()
    assert torch.equal(load[:, 0] > 0, load[:, 8] > 0)


def test_rebalances_keep_greedy_output_and_copy_weights_exactly(ckpt, baseline):
    tokens, reference = baseline
    llm = _llm(ckpt, enable_eplb=True, eplb_config=REBALANCING)
    runner = llm.engine.runner
    events = _instrument(runner.eplb)
    assert [o.token_ids for o in _greedy(llm)] == tokens
    stats = runner.eplb.stats
    assert stats.num_rebalances >= 2 and stats.num_switches >= 4
    # the first rebalance is planned after a quarter of the interval
    assert runner.eplb.next_rebalance - REBALANCING["step_interval"] >= REBALANCING["step_interval"] // 4
    ours = runner.model.moe_blocks()
    theirs = reference.moe_blocks()
    for block, ref in zip(ours, theirs):
        slot_log = block.expert_map.slot_log
        assert sorted(set(slot_log) - {-1}) == list(range(8))
        assert sum(s >= 0 for s in slot_log) == 11
        for slot, logical in enumerate(slot_log):
            if logical >= 0:  # byte-identical to the checkpoint's expert
                assert torch.equal(block.experts.w13[slot], ref.experts.w13[logical])
                assert torch.equal(block.experts.w2[slot], ref.experts.w2[logical])
    slot_bytes = ours[0].experts.slot_bytes()
    # a boundary copies at most one expert per layer, switches only maps whose copy finished at an earlier
    # boundary (nothing waits for a copy), and never inside a prefill
    assert max(e["copied"] for e in events) <= len(ours) * slot_bytes
    pending = 0
    for event in events:
        assert event["switched"] <= pending
        assert not (event["mid_prefill"] and event["switched"])
        pending += event["copied"] // slot_bytes - event["switched"]
    assert any(e["mid_prefill"] for e in events)


def test_deterministic_mode_is_identical_across_rebalances(ckpt):
    plain = _greedy(_llm(ckpt, deterministic=True), logprobs=2)
    llm = _llm(ckpt, deterministic=True, enable_eplb=True, eplb_config=REBALANCING)
    balanced = _greedy(llm, logprobs=2)
    assert llm.engine.runner.eplb.stats.num_rebalances >= 1
    for a, b in zip(plain, balanced):
        assert a.token_ids == b.token_ids
        assert [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)] == \
            [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)]


def test_engine_stats_and_metrics_report_moe_lb(ckpt):
    from dsinfer.server.metrics import ServerMetrics

    llm = _llm(ckpt, enable_eplb=True, eplb_config={"num_redundant_experts": 1, "window_size": 4, "step_interval": 8})
    engine = llm.engine
    assert engine.get_stats()["eplb"] is None  # nothing came back yet; the next step asks
    _greedy(llm)
    engine.get_stats()  # asks the next step for the window and the totals of the rebalances run by then
    _greedy(llm)
    stats = engine.get_stats()
    eplb = stats["eplb"]
    assert eplb["moe_lb"] == [1.0, 1.0] and eplb["moe_lb_overall"] == 1.0  # one rank: balanced by definition
    assert eplb["num_rebalances"] >= 1 and eplb["received_bytes"] == 0  # one rank receives nothing
    text = ServerMetrics().render(stats).decode()
    assert 'dsinfer_moe_lb{layer="1"} 1.0' in text and "dsinfer_moe_lb_overall 1.0" in text
    assert f"dsinfer_eplb_rebalances_total {float(eplb['num_rebalances'])}" in text


def test_mtp_layers_are_balanced_too():
    import transformers

    from tests.models.test_deepseek import v3_config

    cfg = v3_config().to_dict()
    cfg.update(num_nextn_predict_layers=1, architectures=["DeepseekV3ForCausalLM"])
    from dsinfer.layers.moe import ExpertSlots
    from dsinfer.models.deepseek.model import DeepseekV3ForCausalLM

    assert transformers
    model = DeepseekV3ForCausalLM(cfg, expert_slots=ExpertSlots(2, 1))
    blocks = model.moe_blocks()
    assert len(blocks) == 2 and blocks[-1] is model.mtp.layers[0].block.mlp
    assert all(b.expert_map.num_storage == 11 for b in blocks)


@pytest.mark.parametrize("kwargs, message", [
    ({"eplb_config": {"window_size": 0}}, r"eplb_config.window_size must be an integer >= 1, got 0"),
    ({"eplb_config": {"step_interval": 2.5}}, r"eplb_config.step_interval must be an integer"),
    ({"eplb_config": {"num_redundant_experts": -1}}, r"eplb_config.num_redundant_experts must be an integer >= 0"),
    ({"eplb_config": {"log_balancedness": "yes"}}, r"log_balancedness must be true or false"),
    ({"eplb_config": {"windows": 3}}, r"unknown key\(s\) \['windows'\]"),
])
def test_bad_eplb_config_is_a_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EplbConfig.from_dict(kwargs["eplb_config"])


def test_eplb_needs_a_deepseek_moe_model_and_redundancy_needs_eplb(ckpt):
    with pytest.raises(ValueError, match="enable_eplb=True needs a DeepSeek"):
        LLM(enable_eplb=True)  # the bundled Llama-family model
    with pytest.raises(ValueError, match="num_redundant_experts=2 needs enable_eplb=True"):
        _llm(ckpt, eplb_config={"num_redundant_experts": 2})


def test_serve_flags_validate_eplb_config():
    import argparse

    from dsinfer.server.cli import add_serve_args, check_serve_args, engine_args

    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(["m", "--enable-eplb", "--eplb-config", '{"num_redundant_experts": 8}'])
    check_serve_args(args)
    eargs = engine_args(args)
    assert eargs.enable_eplb is True and eargs.eplb_config == {"num_redundant_experts": 8}
    bad = parser.parse_args(["m", "--eplb-config", '{"window_size": -3}'])
    with pytest.raises(ValueError, match=r"--eplb-config .*window_size must be an integer >= 1"):
        check_serve_args(bad)
