"""FP8 block-quantized linear layers (``quantization_config``: quant_method "fp8", ``weight_block_size``).

``Fp8BlockLinear`` keeps the checkpoint's FP8 weight and its block scales (``weight_scale_inv``) as
parameters, so a GPU block-scaled GEMM can use them. On CPU ``process_weights_after_loading`` dequantizes
once into a dense weight of the model dtype (CPU has no FP8 matmul).

A merged projection (gate/up) stores each shard's own scale grid, one after the other: identical to the merged
grid when every shard boundary is a multiple of the block height (all real DeepSeek shapes); otherwise
(``aligned`` False, tiny test models) the layer always runs on its dequantized weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.distributed.state import ParallelState
from dsinfer.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from dsinfer.ops.activation import silu_and_mul
from dsinfer.ops.fp8 import FP8_DTYPE, block_dequantize, block_quantize, fp8_block_linear, scale_grid


@dataclass(frozen=True)
class Fp8Config:
    """FP8 block quantization of a checkpoint."""

    block_size: tuple[int, int]  # (rows, cols) of one scale block, e.g. (128, 128)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Fp8Config | None:
        """None when the config has no quantization_config; ValueError for a scheme we cannot run."""
        qc = cfg.get("quantization_config")
        if not qc:
            return None
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(
                f"quantization_config.quant_method={method!r} is not supported; supported: 'fp8'"
            )
        block = qc.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ValueError(
                f"fp8 quantization needs weight_block_size [rows, cols] (e.g. [128, 128]), got {block!r}"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 format {fmt!r} is not supported; supported: 'e4m3'")
        return cls((int(block[0]), int(block[1])))


def make_linear(
    in_features: int,
    output_sizes: list[int] | int,
    quant: Fp8Config | None,
    bias: bool = False,
    shard_names: list[str] | None = None,
    tp: ParallelState | None = None,
    split: str | None = None,
    **parallel: Any,
) -> nn.Module:
    """A plain ``Linear``, or an ``Fp8BlockLinear`` when the checkpoint is FP8 block-quantized. With ``tp`` of
    several ranks and ``split`` "column" or "row": a ``ColumnParallelLinear`` / ``RowParallelLinear`` (``parallel``:
    their further arguments); at one rank the very layer of one process (its own fast paths kept)."""
    if tp is not None and tp.tp_size > 1 and split is not None:
        if quant is not None:
            raise ValueError("FP8 block-quantized checkpoints are not supported with tensor_parallel_size > 1 yet "
                             "(the block scales would need splitting too): use a bf16 checkpoint")
        if split == "column":
            return ColumnParallelLinear(in_features, output_sizes, tp, bias, shard_names, **parallel)
        return RowParallelLinear(in_features, output_sizes, tp, bias, **parallel)
    if quant is None:
        return Linear(in_features, output_sizes, bias=bias, shard_names=shard_names)
    return Fp8BlockLinear(in_features, output_sizes, quant.block_size, bias=bias, shard_names=shard_names)


class BlockScaledShards:
    """Row ranges of the shards of a merged FP8 weight and of their block-scale grids."""

    def __init__(self, in_features: int, sizes: list[int], names: list, block_size: tuple[int, int]):
        self.block_size = block_size
        self.cols = scale_grid(1, in_features, block_size)[1]
        self.offsets: dict[Any, tuple[int, int, int, int]] = {}  # name -> (row, rows, scale_row, scale_rows)
        row = srow = 0
        for name, size in zip(names, sizes):
            srows = scale_grid(size, 1, block_size)[0]
            self.offsets[name] = (row, size, srow, srows)
            row, srow = row + size, srow + srows
        self.rows, self.scale_rows = row, srow
        self.aligned = all(size % block_size[0] == 0 for size in sizes[:-1])

    def dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., rows, in] fp8 + [..., scale_rows, cols] -> dense [..., rows, in]."""
        if self.aligned:
            return block_dequantize(weight, scale_inv, self.block_size, dtype)
        parts = [
            block_dequantize(weight[..., r : r + n, :], scale_inv[..., s : s + m, :], self.block_size, dtype)
            for r, n, s, m in self.offsets.values()
        ]
        return torch.cat(parts, dim=-2)

    def quantize_into(self, dense: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Quantize a dense [rows, in] weight shard by shard into ``weight`` / ``scale_inv`` (dummy init)."""
        for r, n, s, m in self.offsets.values():
            q, sc = block_quantize(dense[r : r + n], self.block_size)
            weight[r : r + n].copy_(q)
            scale_inv[s : s + m].copy_(sc)


class Fp8BlockLinear(nn.Module):
    """y = x dequant(W)^T (+ b) with W in FP8 e4m3 and one float32 scale per block."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int] | int,
        block_size: tuple[int, int],
        bias: bool = False,
        shard_names: list[str] | None = None,
    ):
        super().__init__()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        names = shard_names or list(range(len(sizes)))
        self.in_features, self.out_features = in_features, sum(sizes)
        self.shards = BlockScaledShards(in_features, sizes, names, block_size)
        self.weight = nn.Parameter(
            torch.empty(self.out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(self.shards.scale_rows, self.shards.cols, dtype=torch.float32), requires_grad=False
        )
        self.weight.weight_loader = self.weight_scale_inv.weight_loader = self.load_shard
        self.weight.dummy_init = self._dummy_init
        self.weight_scale_inv.dummy_init = lambda std, gen: None  # written by the weight's dummy init
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.load_shard
        self.dtype = torch.get_default_dtype()  # the model dtype (activations, bias, dequantized weight)
        self.dense: torch.Tensor | None = None

    def load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        target = param.data
        if shard_id is not None:
            row, rows, srow, srows = self.shards.offsets[shard_id]
            target = (
                target.narrow(0, srow, srows)
                if param is self.weight_scale_inv
                else target.narrow(0, row, rows)
            )
        if param is self.weight and loaded.dtype != FP8_DTYPE:
            raise ValueError(
                f"expected an FP8 (float8_e4m3fn) weight for an fp8-quantized layer, got {loaded.dtype}"
            )
        if target.shape != loaded.shape:
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def _dummy_init(self, std: float, generator: torch.Generator) -> None:
        dense = torch.empty(self.weight.shape, dtype=torch.float32, device=self.weight.device)
        dense.normal_(0.0, std, generator=generator)
        self.shards.quantize_into(dense, self.weight.data, self.weight_scale_inv.data)

    def dequantized_weight(self) -> torch.Tensor:
        if self.dense is not None:
            return self.dense
        return self.shards.dequantize(self.weight, self.weight_scale_inv, self.dtype)

    def process_weights_after_loading(self) -> None:
        """CPU (no FP8 GEMM) or shards off the block grid: dequantize once and run dense."""
        if self.weight.device.type == "cpu" or not self.shards.aligned:
            self.dense = self.shards.dequantize(self.weight, self.weight_scale_inv, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return F.linear(x, self.dense, self.bias)
        return fp8_block_linear(x, self.weight, self.weight_scale_inv, self.shards.block_size, self.bias)

    def silu_mul(self, x: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """SiLU(gate) * up of a merged [gate, up] projection, as ``Linear.silu_mul`` (here always two ops, whatever
        ``fused``)."""
        return silu_and_mul(self(x))
