"""Llama and its close relatives: Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm), Mistral (sliding window).

Reads like the HF reference, with q/k/v and gate/up merged into one matmul each (the loader fills the shards).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dsinfer.config import KernelConfig
from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.distributed.state import SINGLE, ParallelState
from dsinfer.layers.attention import Attention
from dsinfer.layers.embedding import LMHead, VocabEmbedding
from dsinfer.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.rotary import RotaryEmbedding, rope_parameters_of
from dsinfer.models.cpu_fused_decode import FusedDecode
from dsinfer.models.stack import DecoderStack
from dsinfer.models.weights import load_named_weights

# FP8 KV-cache scales as quantizers write them: self_attn.{k,v,kv}_scale (compressed-tensors, AutoFP8),
# self_attn.{k,v}_proj.{k,v}_scale (ModelOpt), self_attn.{k,v}_proj.output_scale (older compressed-tensors)
_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:(k|v)_proj\.output_scale|(?:[kv]_proj\.)?(k|v|kv)_scale)$")


def _require(cfg: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise ValueError(f"config.json is missing required field(s) {missing} for {cfg.get('architectures')}")


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, qkv_bias: bool, qk_norm: bool,
                 sliding_window: int | None, tp: ParallelState = SINGLE):
        super().__init__()
        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        self.head_dim = cfg.get("head_dim") or hidden // num_heads
        attention_bias = bool(cfg.get("attention_bias"))  # Llama: bias on q/k/v/o; Qwen2: q/k/v always
        # this rank's heads (all of them at one rank)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, tp,
                                          bias=qkv_bias or attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, tp, bias=attention_bias,
                                        what="num_attention_heads * head_dim")
        self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"]) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"]) if qk_norm else None
        rotary_dim = int(self.head_dim * cfg.get("partial_rotary_factor", 1.0))
        self.rotary = RotaryEmbedding(rotary_dim, cfg.get("max_position_embeddings", 4096), rope_parameters_of(cfg))
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, sliding_window)
        self.split = [q_size, kv_size, kv_size]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.split, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, batch, self.rotary, positions))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, fused_silu_mul: bool = True,
                 tp: ParallelState = SINGLE):
        super().__init__()
        self.fused_silu_mul = fused_silu_mul  # KernelConfig.fused_silu_mul
        if hidden <= 0 or intermediate <= 0:
            raise ValueError(f"hidden_size and intermediate_size must be > 0, got {hidden}, {intermediate}")
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], tp, bias=bias,
                                                 what="intermediate_size")
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, bias=bias, what="intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_mul(x, self.fused_silu_mul))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, variant: dict[str, Any], kernel: KernelConfig,
                 tp: ParallelState = SINGLE):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, variant["qkv_bias"], variant["qk_norm"],
                                        variant["sliding_window"](cfg, layer_idx), tp)
        self.mlp = LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"], bool(cfg.get("mlp_bias")),
                            kernel.fused_silu_mul, tp)
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


def _no_window(cfg: dict[str, Any], layer_idx: int) -> int | None:
    return None


def _mistral_window(cfg: dict[str, Any], layer_idx: int) -> int | None:
    return cfg.get("sliding_window") or None


def _qwen2_window(cfg: dict[str, Any], layer_idx: int) -> int | None:
    # As transformers: a window only with use_sliding_window, on the layers ``layer_types`` names
    # "sliding_attention", else (older configs) from layer max_window_layers (default 28) on.
    if not cfg.get("use_sliding_window"):
        return None
    types = cfg.get("layer_types")
    sliding = types[layer_idx] == "sliding_attention" if types else layer_idx >= cfg.get("max_window_layers", 28)
    return (cfg.get("sliding_window") or None) if sliding else None


class LlamaForCausalLM(DecoderStack):
    """The Llama family; subclasses only change the variant flags."""

    variant: dict[str, Any] = {"qkv_bias": False, "qk_norm": False, "sliding_window": _no_window}
    # decode steps of 1 + k tokens a sequence (drafts to verify) capture into CUDA graphs: paged attention reads
    # nothing on the host at any query length (runner/cuda_graphs.py)
    multi_token_decode_graphs = True
    # weight-only int8 / int4 linears on CPU (layers/quant.py: every Linear, the embedding and the LM head)
    supports_cpu_quantization = True
    # checkpoint name fragment -> (our merged parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    supports_tensor_parallel = True

    def __init__(self, cfg: dict[str, Any], kernel: KernelConfig | None = None, parallel: ParallelState = SINGLE):
        """``kernel``: the engine's kernel choices (None: ``KernelConfig()``'s defaults); ``parallel``: this
        rank's tensor-parallel state (heads, MLP columns and the vocabulary split across its ranks)."""
        super().__init__()
        kernel = kernel or KernelConfig()
        _require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported; supported: 'silu'")
        types = cfg.get("layer_types")
        if types is not None and (not isinstance(types, list) or len(types) != cfg["num_hidden_layers"]
                                  or not set(types) <= {"full_attention", "sliding_attention"}):
            raise ValueError("layer_types must list 'full_attention' or 'sliding_attention' for each of the "
                             f"{cfg['num_hidden_layers']} layers, got {types!r:.120}")
        cfg.setdefault("rms_norm_eps", 1e-6)
        self.cfg = cfg
        self.embed_tokens = VocabEmbedding(cfg["vocab_size"], cfg["hidden_size"], parallel)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, self.variant, kernel, parallel) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        tied = cfg.get("tie_word_embeddings", False)
        self.lm_head = LMHead(cfg["vocab_size"], cfg["hidden_size"], self.embed_tokens if tied else None, parallel)
        # quantized on CPU: decode steps' layers as one C++ call each, built at the first forward (after the
        # weights are packed); False until then, None where the model is not covered
        self.cpu_fused_layer = kernel.cpu_fused_layer
        self._fused_decode: FusedDecode | None | bool = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.cpu_fused_layer and input_ids.device.type == "cpu":
            if self._fused_decode is False:
                self._fused_decode = FusedDecode.build(self)
            if self._fused_decode is not None:
                hidden = self._fused_decode.forward(self, input_ids, positions, batch)
                if hidden is not None:
                    return hidden
        return super().forward(input_ids, positions, batch)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name to ours; None to skip it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("lm_head.") and self.lm_head.tied:
            return None
        if name.startswith("model."):
            name = name[len("model."):]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, self._take_kv_scales(weights), self.packed_modules, self.checkpoint_name)

    def _take_kv_scales(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the weights through, giving the KV-cache scales among them to their attention layers."""
        for name, tensor in weights:
            match = _KV_SCALE.search(name)
            if match is None:
                yield name, tensor
                continue
            layer, which = int(match.group(1)), f"{match.group(2) or match.group(3)}_scale"
            if layer >= len(self.layers):
                raise ValueError(f"checkpoint tensor {name!r}: the model has {len(self.layers)} layers")
            try:
                self.layers[layer].self_attn.attn.load_kv_scale(which, tensor)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {name!r}: {exc}") from None


class Qwen2ForCausalLM(LlamaForCausalLM):
    variant = {"qkv_bias": True, "qk_norm": False, "sliding_window": _qwen2_window}


class Qwen3ForCausalLM(LlamaForCausalLM):
    variant = {"qkv_bias": False, "qk_norm": True, "sliding_window": _qwen2_window}


class MistralForCausalLM(LlamaForCausalLM):
    variant = {"qkv_bias": False, "qk_norm": False, "sliding_window": _mistral_window}
