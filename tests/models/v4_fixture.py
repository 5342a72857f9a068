"""A tiny DeepSeek-V4 checkpoint written by transformers, with every layer type, both MoE kinds and 2 HC streams.

Window 8, CSA rate 4 (index top-3 of the compressed entries, so the indexer's choice matters past 16 tokens), HCA
rate 16, YaRN on the compressed layers. Weights are re-drawn at unit scale (std 1/sqrt(fan_in), norms around 1,
random sinks, window biases, hyper-connection weights and hash table) so every piece visibly shapes the output:
transformers' init (std 0.02, zero sinks and biases, an all-zero tid2eid) would hide bugs. 8 indexer heads: an
entry scores exactly 0 when every head's ReLU is 0, and with 2 heads such ties at the top-k cut were common
(transformers breaks them arbitrarily, differently for a different number of entries).
"""

from __future__ import annotations

from pathlib import Path

import torch

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]


def v4_config(transformers, **overrides):
    kwargs = dict(
        vocab_size=128, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        head_dim=16, q_lora_rank=24, partial_rotary_factor=0.5, n_routed_experts=4, num_experts_per_tok=2,
        layer_types=LAYER_TYPES, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}, sliding_window=8,
        o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=2, hc_sinkhorn_iters=5,
        max_position_embeddings=512, num_nextn_predict_layers=0, routed_scaling_factor=1.5, swiglu_limit=2.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1},
        eos_token_id=1, bos_token_id=0,
    )
    kwargs.update(overrides)
    return transformers.DeepseekV4Config(**kwargs)


def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                t.copy_(torch.stack([torch.randperm(model.config.n_routed_experts, generator=gen)[:t.shape[1]]
                                     for _ in range(t.shape[0])]))
            elif "norm" in name:
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            elif name.endswith(("sinks", "position_bias", "e_score_correction_bias", ".base", "hc_base")):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith(("scale", "hc_scale")):
                t.copy_(1 + 0.3 * torch.randn(t.shape, generator=gen))
            elif t.dim() >= 2:
                fan_in = 1 if "embed" in name else t.shape[-1]
                t.copy_(torch.randn(t.shape, generator=gen) / fan_in**0.5)


def write_checkpoint(transformers, path: Path, seed: int = 0, **overrides):
    """-> the transformers model (fp32, eval) whose save_pretrained checkpoint is at ``path``."""
    torch.manual_seed(seed)
    hf = transformers.DeepseekV4ForCausalLM(v4_config(transformers, **overrides)).eval()
    randomize(hf, seed)
    hf.save_pretrained(path)
    return hf
