"""Config fields that change the math, against HF transformers (prompt logprobs of one 40-token prompt on tiny
random float32 checkpoints), and the fields dsinfer refuses with a ValueError instead of computing something else.
Found by an outside parity probe: ``layer_types`` and a missing ``max_window_layers`` in Qwen2/Qwen3, top-1
routing with ``norm_topk_prob``, a non-SiLU ``hidden_act``."""

from __future__ import annotations

import json

import pytest
import torch

from dsinfer import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
DEEPSEEK = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                n_routed_experts=8, num_hidden_layers=2, q_lora_rank=24, n_shared_experts=1, first_k_dense_replace=1)


def _save(model_cls, cfg, path, drop=()):
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # unit-scale weights: differences in the math show in the logprobs
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn_like(p) / (1 if "embed" in name else p.shape[-1]) ** 0.5)
    model.save_pretrained(path)
    if drop:
        config = json.loads((path / "config.json").read_text())
        for key in drop:
            config.pop(key, None)
        (path / "config.json").write_text(json.dumps(config))
    return model_cls.from_pretrained(path, dtype=torch.float32).eval()  # HF reading the same config.json


def _max_logprob_diff(model, path) -> float:
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    out = LLM(str(path), dtype="float32").generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
    return (ours - ref[:, 0]).abs().max().item()


@pytest.mark.parametrize("case", ["qwen2-layer-types", "qwen3-layer-types", "qwen2-no-max-window-layers",
                                  "qwen3-no-max-window-layers", "v3-top1-normalized"])
def test_config_variant_matches_transformers(case, tmp_path):
    window = dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    if case.startswith("qwen"):
        cfg_cls, model_cls = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if case.startswith("qwen2")
                              else (transformers.Qwen3Config, transformers.Qwen3ForCausalLM))
        if case.endswith("layer-types"):  # layer_types decides, not max_window_layers
            model = _save(model_cls, cfg_cls(**SMALL, **window, layer_types=types), tmp_path)
        else:  # an older config.json: no layer_types, no max_window_layers (transformers' default 28)
            model = _save(model_cls, cfg_cls(**SMALL, **window), tmp_path, drop=("layer_types", "max_window_layers"))
    else:
        cfg = transformers.DeepseekV3Config(**DEEPSEEK, num_experts_per_tok=1, n_group=1, topk_group=1,
                                            norm_topk_prob=True)
        model = _save(transformers.DeepseekV3ForCausalLM, cfg, tmp_path)
    assert _max_logprob_diff(model, tmp_path) < 1e-4


@pytest.mark.parametrize("arch, override, message", [
    ("LlamaForCausalLM", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ("Qwen2ForCausalLM", dict(layer_types=["full_attention"]), "layer_types must list"),
    ("DeepseekV3ForCausalLM", dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    ("DeepseekV3ForCausalLM", dict(mlp_bias=True), "mlp_bias=true is not supported"),
    ("DeepseekV3ForCausalLM", dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    ("DeepseekV3ForCausalLM", dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
    ("DeepseekV2ForCausalLM", dict(scoring_func="sigmoid"), "scoring_func='sigmoid' is not supported"),
])
def test_configs_computing_something_else_are_refused(arch, override, message):
    from dsinfer.models.registry import model_class

    base = dict(SMALL) if not arch.startswith("Deepseek") else dict(
        DEEPSEEK, num_experts_per_tok=2, n_group=1, topk_group=1, rms_norm_eps=1e-6)
    with pytest.raises(ValueError, match=message):
        model_class(arch)(dict(base, architectures=[arch], **override))
