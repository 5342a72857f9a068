"""GPT-OSS (``GptOssForCausalLM``): alternating sliding-window / full attention with learned sinks, and a MoE of
biased experts with GPT-OSS's clamped SwiGLU.

Reads like transformers' ``modeling_gpt_oss``: attention with biases on q/k/v/o, one sink logit per query head,
YaRN rope (neox halves); ``layer_types`` names each layer's attention (sliding layers look back
``sliding_window`` tokens, 128 in the released models); the router is a biased linear whose top-k logits are
softmaxed over the chosen experts only; an expert computes ``gate_up = x @ W13 + b13`` with gate and up
interleaved in its columns (as HF stores them: gate at even, up at odd), ``glu = g * sigmoid(alpha * g)`` with
g clamped above at ``limit``, ``(clamp(up, -limit, limit) + 1) * glu``, then ``@ W2 + b2``.

MXFP4 experts (the released checkpoints' ``*_blocks`` / ``*_scales``) are dequantized to the model's dtype on
load (``models.mxfp4``). The experts run in torch, one matmul pair per active expert (their row counts are read
on the host), so the model runs eagerly on CUDA (``eager_only``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dsinfer.config import KernelConfig
from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.distributed.state import SINGLE, ParallelState, split_evenly
from dsinfer.layers.attention import Attention
from dsinfer.layers.embedding import LMHead, VocabEmbedding
from dsinfer.layers.linear import Linear, QKVParallelLinear, RowParallelLinear
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.rotary import RotaryEmbedding, rope_parameters_of
from dsinfer.models.mxfp4 import pair_mxfp4
from dsinfer.models.stack import DecoderStack
from dsinfer.models.weights import load_named_weights

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "num_local_experts", "num_experts_per_tok", "vocab_size")


def _sliding_window(cfg: dict[str, Any], layer_idx: int) -> int | None:
    types = cfg.get("layer_types") or ["sliding_attention", "full_attention"] * cfg["num_hidden_layers"]
    return cfg.get("sliding_window") if types[layer_idx] == "sliding_attention" else None


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation of interleaved [gate, up] columns: [..., 2I] -> [..., I]."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, tp: ParallelState = SINGLE):
        super().__init__()
        hidden, self.head_dim = cfg["hidden_size"], cfg["head_dim"]
        num_heads = cfg["num_attention_heads"]
        bias = bool(cfg.get("attention_bias", True))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, cfg["num_key_value_heads"], tp, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, tp, bias=bias,
                                        what="num_attention_heads * head_dim")
        self.rotary = RotaryEmbedding(self.head_dim, cfg.get("max_position_embeddings", 131072),
                                      rope_parameters_of(cfg))
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5,
                              _sliding_window(cfg, layer_idx), sinks=True, tp=tp)
        self.split = [q_size, kv_size, kv_size]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.split, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, batch, self.rotary, positions))


class GptOssExperts(nn.Module):
    """The experts in HF's layout: ``gate_up_proj [E, H, 2I]`` (x @ W), ``down_proj [E, I, H]``, with biases.
    With ``tp`` each rank holds I / tp of every expert's intermediate columns (interleaved gate/up pairs kept
    together) and returns its part of the sum (down_proj's bias on rank 0's part), for the caller to reduce."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, alpha: float, limit: float,
                 tp: ParallelState = SINGLE):
        super().__init__()
        self.num_experts, self.alpha, self.limit = num_experts, alpha, limit
        local = split_evenly(intermediate, tp.tp_size, "intermediate_size")

        def param(*shape: int, dim: int | None = None, pairs: bool = False) -> nn.Parameter:
            """``dim``: the intermediate dimension this rank takes its slice of (``pairs``: gate/up columns)."""
            p = nn.Parameter(torch.empty(*shape), requires_grad=False)
            if tp.tp_size > 1 and dim is not None:
                def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
                    part = loaded.unflatten(dim, (intermediate, 2)) if pairs else loaded
                    part = part.narrow(dim, tp.tp_rank * local, local)
                    param.data.copy_(part.flatten(dim, dim + 1) if pairs else part)

                p.weight_loader = load
            return p

        self.gate_up_proj = param(num_experts, hidden, 2 * local, dim=2, pairs=True)
        self.gate_up_proj_bias = param(num_experts, 2 * local, dim=1, pairs=True)
        self.down_proj = param(num_experts, local, hidden, dim=1)
        self.down_proj_bias = param(num_experts, hidden)
        self.adds_down_bias = tp.tp_rank == 0  # the bias joins the sum once

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights / ids [T, k] -> [T, H]: the (token, expert) pairs sorted by expert, one matmul pair
        per active expert over its rows, the weighted outputs added back in expert order (as HF does)."""
        top_k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // top_k
            gate_up = x[tokens] @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
            y = swiglu_clamped(gate_up, self.alpha, self.limit) @ self.down_proj[expert]
            y = y + self.down_proj_bias[expert] if self.adds_down_bias else y
            out.index_add_(0, tokens, (y * flat_weights[pairs, None]).to(x.dtype))
        return out


class GptOssMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any], tp: ParallelState = SINGLE):
        super().__init__()
        self.top_k = cfg["num_experts_per_tok"]
        self.router = Linear(cfg["hidden_size"], cfg["num_local_experts"], bias=True)  # every rank routes
        self.experts = GptOssExperts(cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"],
                                     float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)), tp)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = self.router(x).topk(self.top_k, dim=-1)
        return self.tp.all_reduce(self.experts(x, top.softmax(dim=-1), ids))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, tp: ParallelState = SINGLE):
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer_idx, tp)
        self.mlp = GptOssMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, positions, hidden, residual, batch):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class GptOssForCausalLM(DecoderStack):
    # the experts read their row counts on the host: no CUDA-graph capture, no dummy-batch warm-up
    eager_only = True
    multi_token_decode_graphs = False
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    supports_tensor_parallel = True

    def __init__(self, cfg: dict[str, Any], kernel: KernelConfig | None = None, parallel: ParallelState = SINGLE):
        """``parallel``: this rank's tensor-parallel state (heads, expert columns and vocabulary split)."""
        super().__init__()
        missing = [k for k in _REQUIRED if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config.json is missing required field(s) {missing} for GptOssForCausalLM")
        types = cfg.get("layer_types")
        if types is not None and (len(types) != cfg["num_hidden_layers"]
                                  or not set(types) <= {"full_attention", "sliding_attention"}):
            raise ValueError("layer_types must list 'full_attention' or 'sliding_attention' for each of the "
                             f"{cfg['num_hidden_layers']} layers, got {types!r:.120}")
        method = (cfg.get("quantization_config") or {}).get("quant_method")
        if method not in (None, "mxfp4"):
            raise ValueError(f"GptOssForCausalLM: quantization_config.quant_method={method!r} is not supported; "
                             "supported: 'mxfp4' (experts dequantized on load) or none")
        cfg.setdefault("rms_norm_eps", 1e-5)
        self.cfg = cfg
        self.embed_tokens = VocabEmbedding(cfg["vocab_size"], cfg["hidden_size"], parallel)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i, parallel) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        tied = cfg.get("tie_word_embeddings", False)
        self.lm_head = LMHead(cfg["vocab_size"], cfg["hidden_size"], self.embed_tokens if tied else None, parallel)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def checkpoint_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> ours (None: skip it)."""
        if "rotary_emb.inv_freq" in name or (name.startswith("lm_head.") and self.lm_head.tied):
            return None
        name = name.removeprefix("model.")
        return name.replace(".self_attn.sinks", ".self_attn.attn.sinks")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """MXFP4 experts are stored [E, out, in]: dequantized, then transposed to HF's x @ W layout."""
        dense = pair_mxfp4(weights, self.embed_tokens.weight.dtype, lambda w: w.transpose(1, 2))
        load_named_weights(self, dense, self.packed_modules, self.checkpoint_name)
