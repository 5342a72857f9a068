"""A small DeepSeek-V2 checkpoint whose router is skewed (a few experts take most tokens), for the EPLB tests."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.models.test_deepseek import hub_style_config, randomize, v2_config


def save_skewed_v2(path: Path, num_hidden_layers: int = 3) -> None:
    """Two MoE layers of 8 experts (top-3, two shared experts fused into the stack); experts 0 and 1 of every
    MoE layer get a gate row 3x larger and a bias-like push towards them, so they take most tokens."""
    import transformers

    torch.manual_seed(0)
    cfg = v2_config()
    cfg.num_hidden_layers = num_hidden_layers
    hf = transformers.DeepseekV2ForCausalLM(cfg).eval()
    randomize(hf, seed=1)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.weight[:2] *= 3.0
    hf.save_pretrained(path)
    hub_style_config(path)
