"""One Llama-family decoder layer of a CPU decode step as one C++ call (``csrc/cpu_layer.cpp``, built with the
quantized linears: call only where ``cpu_quant.native_available()``); ``models.cpu_fused_decode`` decides when a
step takes it. Its reference is the module path itself: the same kernels in the same order, bit for bit."""

from __future__ import annotations

import torch

from dsinfer.ops.cpu_quant import QuantizedWeight


def linear_tensors(w: QuantizedWeight) -> list[torch.Tensor]:
    """A quantized weight as the C++ layer takes it: [qweight, scales, mins] (int4) or [qweight, scales] (int8)."""
    return [w.qweight, w.scales] + ([w.mins] if w.fmt == "int4" else [])


def decode_layer(hidden: torch.Tensor, residual: torch.Tensor | None, ln1: torch.Tensor, ln2: torch.Tensor,
                 eps: float, qkv: list[torch.Tensor], o: list[torch.Tensor], gate_up: list[torch.Tensor],
                 down: list[torch.Tensor], heads: int, kv_heads: int, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 slots: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) after the layer: input norm (with the residual add after the first layer), q/k/v, rope
    + KV store, full decode attention over ``slots`` [B, L] (the attention plan's ``decode_slots``), output projection,
    post-attention norm, SiLU-gated MLP. ``hidden`` [B, H] float32, one token per sequence."""
    return torch.ops.dsinfer_cpu.decode_layer(hidden, residual, ln1, ln2, eps, qkv, o, gate_up, down, heads,
                                              kv_heads, positions, cos_sin_cache, kv_cache, slot_mapping, slots,
                                              seq_lens, scale)
