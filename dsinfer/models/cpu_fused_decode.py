"""A quantized Llama-family model's CPU decode step with each decoder layer as one C++ call
(``ops.cpu_layer.decode_layer``, ``csrc/cpu_layer.cpp``).

A decode step of the bundled SmolLM2 spends about as much time in Python between its kernels (nine module calls
a layer, the linear wrappers, the rope and attention dispatch) as in the int4 linears themselves (issue 43); one
call a layer leaves the kernels. The C++ layer runs the module path's kernels in its order on the same tensors, so
its outputs are bit for bit the module path's (``tests/models/test_cpu_fused_decode.py``); a model or a step it
does not cover runs the modules as before.

Covered: every layer's linears quantized with the kernels built (``layers.quant``), no biases, no q/k norm, full
attention in one KV cache group, NeoX rope over whole heads, float32 activations and KV cache, and a step of one
token per sequence (no prompt rows, no drafts, not inside a CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.ops.attention import AttentionPlan
from dsinfer.ops.cpu_layer import decode_layer, linear_tensors


@dataclass(frozen=True)
class _LayerArgs:
    """One layer's weights and shapes, in the C++ op's order (the KV cache is read at each step: bound later)."""

    attn: nn.Module  # the layer's LlamaAttention (its rope cache and, through ``attn.attn``, its KV cache)
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    heads: int
    kv_heads: int
    scale: float


def _layer_args(layer: nn.Module) -> _LayerArgs | None:
    """The layer's arguments where the C++ layer covers it (see the module doc), else None."""
    attn, mlp = layer.self_attn, layer.mlp
    core = attn.attn
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    weights = [getattr(getattr(lin, "quant_method", None), "weight", None) for lin in linears]
    rotary = attn.rotary
    covered = (
        all(w is not None for w in weights) and all(lin.bias is None for lin in linears)
        and attn.q_norm is None and core.native_cpu and core.sinks is None and core.sliding_window is None
        and core.kv_group == 0 and rotary.is_neox and rotary.cos_sin_cache.dtype == torch.float32
        and rotary.cos_sin_cache.shape[-1] == attn.head_dim
        and all(n.native_cpu and n.weight.dtype == torch.float32 for n in norms)
        and layer.input_layernorm.eps == layer.post_attention_layernorm.eps
    )
    if not covered:
        return None
    return _LayerArgs(attn, norms[0].weight, norms[1].weight, norms[0].eps, *map(linear_tensors, weights),
                      attn.num_heads, attn.num_kv_heads, core.scale)


class FusedDecode:
    """The C++ layers of one model, where all of its layers are covered (``build``)."""

    def __init__(self, layers: list[_LayerArgs]):
        self.layers = layers

    @classmethod
    def build(cls, model: nn.Module) -> FusedDecode | None:
        args = [_layer_args(layer) for layer in model.layers]
        return cls(args) if args and all(a is not None for a in args) else None

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor | None:
        """The model's hidden states after its final norm, or None where this step is not one the C++ layer
        takes (the caller then runs the modules)."""
        if (batch.graphed or batch.max_query_len != 1 or input_ids.device.type != "cpu"
                or input_ids.numel() != batch.num_seqs):
            return None
        kv_cache = self.layers[0].attn.attn.kv_cache
        if kv_cache is None or kv_cache.dtype != torch.float32:
            return None
        block_tables, slot_mapping = batch.kv_tables(0)
        block_size = kv_cache.shape[2]
        # the key the attention layers derive their plan under: one plan a step, whichever path runs
        plan = batch.derive(("attention_plan", 0, None, block_size, True),
                            lambda: AttentionPlan(block_tables, batch.query_start_loc, batch.seq_lens, None,
                                                  block_size, True))
        if not plan.layout.all_decode:
            return None
        hidden = model.embed_tokens(input_ids)
        if hidden.dtype != torch.float32:
            return None
        slots, residual = plan.layout.decode_slots, None
        for a in self.layers:
            hidden, residual = decode_layer(
                hidden, residual, a.ln1, a.ln2, a.eps, a.qkv, a.o, a.gate_up, a.down, a.heads, a.kv_heads,
                positions, a.attn.rotary.cos_sin_cache, a.attn.attn.kv_cache, slot_mapping, slots, batch.seq_lens,
                a.scale)
        hidden, _ = model.norm(hidden, residual)
        return hidden
