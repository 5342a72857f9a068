"""Weight-only quantized linears on CPU: a quantization method that a ``Linear`` (or the embedding / LM head)
holds, as vLLM's ``LinearMethod``.

``attach_cpu_quantization(model, mode)`` gives every plain ``Linear``, ``VocabEmbedding`` and untied ``LMHead``
of a model a ``CpuQuantMethod`` before its weights load. The layer's dense ``weight`` parameter becomes an empty
placeholder whose loader hands each checkpoint shard to the method: a ``QuantizedWeight`` (a GGUF's packs,
``models/loader/gguf_quant.py``) is kept as it is, a dense tensor (safetensors, dummy weights) is kept until
``finish_cpu_quantization(model)`` quantizes it once into ``mode``'s format ("gguf" takes int4). Finishing joins
the shards of a merged projection (q/k/v, gate/up) into one pack (all int8 where their formats differ) and
registers ``qweight`` / ``scales`` / ``mins`` buffers; the forward then runs ``ops.cpu_quant``. Where the C++
kernel cannot be built the finished layer keeps a dense float32 weight of the dequantized values instead; where
it is, the model's RMSNorms and decode attention take its kernels (``layers.norm``, ``layers.attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.layers.attention import Attention
from dsinfer.layers.embedding import LMHead, VocabEmbedding
from dsinfer.layers.linear import Linear
from dsinfer.layers.norm import RMSNorm
from dsinfer.ops import cpu_quant
from dsinfer.ops.cpu_quant import BLOCK, QuantizedWeight


class CpuQuantMethod:
    """Loads, packs and applies one layer's quantized weight (see the module doc)."""

    def __init__(self, layer: nn.Module, fmt: str, shard_offsets: dict | None = None):
        self.fmt = "int4" if fmt == "gguf" else fmt  # the format dense shards are quantized to
        self.rows, self.cols = layer.weight.shape
        self.shard_offsets = shard_offsets or {None: (0, self.rows)}
        self.shards: dict = {}  # shard id -> QuantizedWeight or dense tensor, until ``finish``
        self.weight: QuantizedWeight | None = None
        self.dense: torch.Tensor | None = None  # the fallback without the native kernel
        placeholder = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)
        placeholder.weight_loader = self.load
        placeholder.dummy_init = self.dummy_init
        self.placeholder = layer.weight = placeholder

    def load(self, param: nn.Parameter, loaded: torch.Tensor | QuantizedWeight, shard_id=None) -> None:
        if shard_id is None and len(self.shard_offsets) == 1:  # the whole weight of an unmerged layer
            shard_id = next(iter(self.shard_offsets))
        _, size = self.shard_offsets[shard_id]
        shape = loaded.shape if isinstance(loaded, QuantizedWeight) else tuple(loaded.shape)
        if tuple(shape) != (size, self.cols):
            raise ValueError(f"checkpoint tensor of shape {tuple(shape)} does not fit {(size, self.cols)}")
        self.shards[shard_id] = loaded

    def dummy_init(self, std: float, generator: torch.Generator) -> None:
        for shard_id, (_, size) in self.shard_offsets.items():
            self.shards[shard_id] = torch.empty(size, self.cols).normal_(0.0, std, generator=generator)

    def finish(self) -> None:
        """Pack the loaded shards (every one must be loaded) into the layer's weight."""
        missing = [s for s in self.shard_offsets if s not in self.shards]
        if missing:
            raise ValueError(f"quantized weight of shape {(self.rows, self.cols)} lacks shard(s) {missing}")
        ordered = sorted(self.shard_offsets, key=lambda s: self.shard_offsets[s][0])
        parts = [self._packed(self.shards[s]) for s in ordered]
        if len({p.fmt for p in parts}) > 1:  # e.g. a Q4_K file's Q6_K attn_v beside its Q4_K attn_q
            parts = [cpu_quant.quantize(cpu_quant.dequantize(p), "int8") for p in parts]
        cat = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        self.weight = QuantizedWeight(parts[0].fmt, cat("qweight"), cat("scales"), cat("mins"))
        self.shards.clear()
        if not cpu_quant.native_available():
            self.dense, self.weight = cpu_quant.dequantize(self.weight), None

    def _packed(self, value: torch.Tensor | QuantizedWeight) -> QuantizedWeight:
        if isinstance(value, QuantizedWeight):
            return value
        return cpu_quant.quantize(value.float(), self.fmt)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight is None:
            return F.linear(x.float(), self.dense, bias).to(x.dtype)
        y = cpu_quant.quant_linear(x, self.weight, bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the weight, dequantized."""
        if self.weight is None:
            return F.embedding(ids, self.dense).to(dtype)
        w = self.weight
        rows = QuantizedWeight(w.fmt, w.qweight[ids.reshape(-1)], w.scales[ids.reshape(-1)],
                               None if w.mins is None else w.mins[ids.reshape(-1)])
        return cpu_quant.dequantize(rows).view(*ids.shape, self.cols).to(dtype)

    def nbytes(self) -> int:
        if self.weight is None:
            return self.dense.numel() * self.dense.element_size()
        w = self.weight
        return sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.mins) if t is not None)


def attach_cpu_quantization(model: nn.Module, mode: str) -> None:
    """Give the model's linears (K a multiple of 32), embedding and LM head a ``CpuQuantMethod``."""
    by_weight: dict[int, CpuQuantMethod] = {}  # id of the dense weight replaced -> its method
    heads = []
    for module in model.modules():
        if type(module) is LMHead and module.tied:
            heads.append(module)
            continue
        # the tensor-parallel linears at one rank are plain linears (EngineArgs refuses quantization above one)
        one_rank = getattr(getattr(module, "tp", None), "tp_size", 1) == 1
        if isinstance(module, Linear) and one_rank and module.in_features % BLOCK == 0:
            fmt, offsets = mode, module.shard_offsets
        elif type(module) in (VocabEmbedding, LMHead) and module.weight.shape[1] % BLOCK == 0:
            fmt, offsets = "int8" if mode == "int4" else mode, None  # the logits' weight stays 8-bit
        else:
            continue
        weight = module.weight
        module.quant_method = by_weight[id(weight)] = CpuQuantMethod(module, fmt, offsets)
    for head in heads:  # a tied head shares its embedding's method and placeholder
        method = by_weight.get(id(head.weight))
        if method is not None:
            head.quant_method, head.weight = method, method.placeholder


def finish_cpu_quantization(model: nn.Module) -> None:
    """Pack every attached method's loaded shards (after the weights loaded); with the C++ kernels built, the
    model's RMSNorms and decode attention take them too (``layers.norm``, ``layers.attention``)."""
    seen = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and id(method) not in seen:
            seen.add(id(method))
            method.finish()
    if cpu_quant.native_available():
        for module in model.modules():
            if isinstance(module, RMSNorm | Attention):
                module.native_cpu = True


def quantized_bytes(model: nn.Module) -> int:
    """The bytes of the model's quantized weights (each shared pack once)."""
    methods = {id(m): m for m in (getattr(mod, "quant_method", None) for mod in model.modules()) if m is not None}
    return sum(m.nbytes() for m in methods.values())
