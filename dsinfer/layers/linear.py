"""Linear layers whose parameters know how to load their checkpoint shards (``param.weight_loader``).

A merged projection (q/k/v, gate/up) is one matmul; the checkpoint's separate tensors are copied into their row
ranges by shard id. Tensor parallelism (Megatron's split): ``ColumnParallelLinear`` / ``QKVParallelLinear`` keep
this rank's output rows, ``RowParallelLinear`` its input columns and all-reduces the partial sums; their weight
loaders cut the checkpoint's full tensors, so a model states only which way each projection is split.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.distributed.state import ParallelState, split_evenly
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


class ColumnParallelLinear(Linear):
    """A ``Linear`` whose output rows are split across the tensor-parallel ranks: each rank holds its slice of
    every shard (rows [r * n / tp, (r + 1) * n / tp) of an n-row shard) and computes its slice of the output; no
    collective. ``shard_parts`` maps a shard to (parts, index) when it is not cut ``tp`` ways at this rank's index:
    (1, 0) for a shard every rank holds whole (MLA's kv_a beside its split q), (kv_heads, rank * kv_heads // tp)
    for a key/value head every ``tp / kv_heads`` ranks share."""

    def __init__(self, in_features: int, output_sizes: list[int] | int, tp: ParallelState, bias: bool = False,
                 shard_names: list[str] | None = None, shard_parts: dict[str | int, tuple[int, int]] | None = None,
                 what: str = "the output size"):
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        names = shard_names or list(range(len(sizes)))
        self.parts = {name: (shard_parts or {}).get(name, (tp.tp_size, tp.tp_rank)) for name in names}
        self.global_sizes = dict(zip(names, sizes))
        local = [split_evenly(size, self.parts[name][0], what) for name, size in zip(names, sizes)]
        super().__init__(in_features, local, bias, shard_names)
        self.tp = tp

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        """This rank's rows of the checkpoint tensor of ``shard_id`` (None: of the whole merged weight)."""
        if shard_id is None and len(self.parts) > 1:
            if loaded.shape[0] != sum(self.global_sizes.values()):
                raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit the merged "
                                 f"{sum(self.global_sizes.values())} rows {list(self.global_sizes.values())}")
            for name, part in zip(self.global_sizes, loaded.split(list(self.global_sizes.values()))):
                self.load_shard(param, part, name)
            return
        name = shard_id if shard_id is not None else next(iter(self.parts))
        parts, index = self.parts[name]
        if loaded.shape[0] % parts:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} cannot be split {parts} ways")
        size = loaded.shape[0] // parts
        super().load_shard(param, loaded.narrow(0, index * size, size), shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """The merged q/k/v projection split by heads: each rank holds num_heads / tp query heads and
    num_kv_heads / tp key/value heads; with fewer key/value heads than ranks, each rank holds one, shared by
    tp / num_kv_heads ranks (replicated, as vLLM does). Sizes that do not divide are ValueErrors."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: ParallelState,
                 bias: bool = False):
        split_evenly(num_heads, tp.tp_size, "num_attention_heads")
        if num_kv_heads >= tp.tp_size:
            split_evenly(num_kv_heads, tp.tp_size, "num_key_value_heads")
            kv_parts = (tp.tp_size, tp.tp_rank)
        elif tp.tp_size % num_kv_heads:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide tensor_parallel_size "
                             f"({tp.tp_size}) when it is smaller (each key/value head is then replicated)")
        else:
            kv_parts = (num_kv_heads, tp.tp_rank * num_kv_heads // tp.tp_size)
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden, [q, kv, kv], tp, bias, ["q", "k", "v"], {"k": kv_parts, "v": kv_parts})
        self.num_heads = num_heads // tp.tp_size  # this rank's
        self.num_kv_heads = max(1, num_kv_heads // tp.tp_size)


class RowParallelLinear(Linear):
    """A ``Linear`` whose input columns are split across the ranks: each rank multiplies its slice of the input
    (a column-parallel layer's output) by its columns, and the partial sums are all-reduced once
    (``reduce_results``; False leaves the partial sum for the caller to reduce with others: DeepSeek's shared
    experts beside the routed ones). The bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, tp: ParallelState, bias: bool = False,
                 reduce_results: bool = True, what: str = "the input size"):
        super().__init__(split_evenly(in_features, tp.tp_size, what), out_features, bias)
        self.tp = tp
        self.partial = tp.tp_size > 1  # the output is this rank's part of the sum
        self.reduce_results = reduce_results

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if param is self.weight and self.partial:
            size = self.in_features
            if loaded.dim() != 2 or loaded.shape[1] != size * self.tp.tp_size:
                raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                                 f"({self.out_features}, {size * self.tp.tp_size})")
            loaded = loaded.narrow(1, self.tp.tp_rank * size, size)
        super().load_shard(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.partial:
            return super().forward(x)
        out = linear(x, self.weight)
        if self.reduce_results:
            out = self.tp.all_reduce(out)
        elif self.tp.tp_rank != 0:  # a partial sum: the bias rides on rank 0's part
            return out
        return out if self.bias is None else out.add_(self.bias)
