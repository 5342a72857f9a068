"""Linear layers whose parameters know how to load their checkpoint shards (``param.weight_loader``).

A merged projection (q/k/v, gate/up) is one matmul; the checkpoint's separate tensors are copied into their row
ranges by shard id.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.ops.activation import silu_and_mul
from dsinfer.ops.linear import linear, linear_silu_mul


class Linear(nn.Module):
    """y = x W^T (+ b). ``output_sizes`` splits the rows into named or numbered shards for merged weights.
    ``quant_method``: a CPU quantization method holding the weight instead (``layers.quant``), or None."""

    quant_method = None

    def __init__(self, in_features: int, output_sizes: list[int] | int, bias: bool = False,
                 shard_names: list[str] | None = None):
        super().__init__()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        names = shard_names or list(range(len(sizes)))
        self.in_features, self.out_features = in_features, sum(sizes)
        self.shard_offsets = {name: (sum(sizes[:i]), size) for i, (name, size) in enumerate(zip(names, sizes))}
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.load_shard
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        target = param.data
        if shard_id is not None:
            offset, size = self.shard_offsets[shard_id]
            target = target.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(x, self.bias)
        return linear(x, self.weight, self.bias)

    def silu_mul(self, x: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """SiLU(gate) * up of a merged [gate, up] projection: one kernel where the GEMV tuner measured it beating
        the projection and the SiLU-mul kernel and ``fused`` (``ops.linear.linear_silu_mul``)."""
        if self.quant_method is not None:
            return silu_and_mul(self.quant_method.apply(x, self.bias))
        return linear_silu_mul(x, self.weight, self.bias, fused)
