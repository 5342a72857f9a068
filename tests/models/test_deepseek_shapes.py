"""DeepSeek real shapes with dummy weights (few layers, CPU) and clear errors for bad configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.core.kv_cache_spec import MLASpec
from dsinfer.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"  # copies of ../shared/model-configs


def _config_dir(name: str, tmp_path: Path) -> Path:
    src = CONFIGS / name / "config.json"
    if not src.exists():
        pytest.skip(f"no {src}")
    shutil.copy(src, tmp_path / "config.json")
    return tmp_path


@pytest.mark.parametrize(
    "name, bytes_per_token", [("deepseek-v2-lite", 27 * 576 * 2), ("deepseek-v3", 61 * 576 * 2)]
)
def test_kv_bytes_per_token_of_real_shapes(name, bytes_per_token):
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    spec = MLASpec(16, cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], torch.bfloat16)
    assert cfg["num_hidden_layers"] * spec.bytes_per_block // 16 == bytes_per_token


def _routing_recorder(model):
    """Record the routed expert ids each MoE gate picks (not the fused shared experts' columns after them)."""
    picked: list[torch.Tensor] = []
    for layer in model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.register_forward_hook(lambda mod, args, out: picked.append(out[1][:, : mod.cfg.top_k].flatten()))
    return picked


@pytest.mark.slow
def test_v2_lite_shape_runs_with_dummy_weights_and_routes_widely(tmp_path):
    path = _config_dir("deepseek-v2-lite", tmp_path)
    llm = LLM(
        str(path),
        load_format="dummy",
        dtype="bfloat16",
        hf_overrides={"num_hidden_layers": 2},
        max_model_len=256,
        num_kv_blocks=64,
    )
    picked = _routing_recorder(llm.engine.runner.model)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 102400, (24,), generator=gen).tolist()} for _ in range(4)
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert llm.engine.runner.kv_bytes_per_token == 2 * 576 * 2
    touched = torch.cat(picked).unique().numel()
    assert touched >= 48, f"dummy routing is degenerate: {touched} of 64 experts touched"


@pytest.mark.slow
def test_v3_shape_runs_with_dummy_fp8_weights(tmp_path):
    path = _config_dir("deepseek-v3", tmp_path)
    # one dense layer (the first three are dense) keeps CPU memory in bounds; the GPU benchmarks raise it
    llm = LLM(
        str(path),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=256,
        num_kv_blocks=32,
        hf_overrides={"num_hidden_layers": 1, "num_nextn_predict_layers": 0},
    )
    model = llm.engine.runner.model
    assert model.layers[0].self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    outs = llm.generate(
        [{"prompt_token_ids": [1, 2, 3, 4, 5]}] * 2,
        SamplingParams(max_tokens=3, ignore_eos=True),
        use_tqdm=False,
    )
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


TINY = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
}


@pytest.mark.parametrize(
    "override, message",
    [
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"n_routed_experts": 10}, "n_routed_experts=10 is not divisible by n_group=4"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"topk_group": 5}, "topk_group=5"),
        ({"topk_method": "random"}, "topk_method='random'"),
        ({"scoring_func": "relu"}, "scoring_func='relu'"),
        ({"qk_rope_head_dim": 5}, "qk_rope_head_dim must be even"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
        ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size"),
    ],
)
def test_bad_configs_raise_clear_errors(override, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        DeepseekV3ForCausalLM(dict(TINY, **override))


def test_tiny_configs_build():
    assert len(DeepseekV2ForCausalLM(dict(TINY, architectures=["DeepseekV2ForCausalLM"])).layers) == 2
    assert DeepseekV3ForCausalLM(dict(TINY)).layers[1].mlp.experts.w13.shape == (9, 32, 32)  # 8 routed + 1 shared
