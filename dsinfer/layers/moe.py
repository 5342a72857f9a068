"""Routed experts: the router gate and the stacked expert weights that ``ops.fused_moe`` runs.

Checkpoints store one tensor per expert (``experts.{e}.{gate,up,down}_proj.weight``); the weight loader copies
each into its slice of ``w13 [E, 2I, H]`` ([gate; up]) or ``w2 [E, H, I]``. transformers' fused layout
(``experts.gate_up_proj`` / ``experts.down_proj``) loads whole. FP8 checkpoints keep FP8 experts with their
block scales: on CUDA the block-scaled fused MoE kernel multiplies them as FP8; on CPU (or with an intermediate
size off the scale grid) they are dequantized once after loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsinfer import batch_invariant
from dsinfer.layers.fp8_linear import BlockScaledShards, Fp8Config
from dsinfer.ops.fp8 import FP8_DTYPE
from dsinfer.ops.moe import Routing, fused_moe, select_experts

SHARDS = {"gate": ("w13", 0), "up": ("w13", 1), "down": ("w2", 0)}


@dataclass(frozen=True)
class RouterConfig:
    """A MoE layer's gate: how many experts, how many per token, and how they are picked (``ops.moe.Routing``)."""

    num_experts: int
    top_k: int
    routing: Routing = Routing()

    def __post_init__(self):
        n_group, topk_group = self.routing.n_group, self.routing.topk_group
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be in [1, n_routed_experts={self.num_experts}]"
            )
        if self.num_experts % n_group:
            raise ValueError(
                f"n_routed_experts={self.num_experts} is not divisible by n_group={n_group}"
            )
        if not 0 < topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
        if n_group > 1 and topk_group * (self.num_experts // n_group) < self.top_k:
            raise ValueError(
                f"topk_group={topk_group} groups of {self.num_experts // n_group} experts "
                f"hold fewer than num_experts_per_tok={self.top_k}"
            )


class Router(nn.Module):
    """Gate logits in float32 (``weight`` stays float32 whatever the model dtype, as in the reference).

    On CUDA, when the model runs in a 16-bit dtype that holds every gate weight exactly (a bf16 checkpoint's
    gate, upcast on load, always does), the logits come from one 16-bit GEMM that accumulates and writes float32:
    the products are exact and the sums float32, so this is the float32 product up to summation order, without
    an upcast copy of the activations and a SIMT float32 GEMM (~5% of a V2-Lite prefill step)."""

    def __init__(self, hidden_size: int, cfg: RouterConfig):
        super().__init__()
        self.cfg = cfg
        self.dtype = torch.get_default_dtype()  # the model dtype (activations)
        self.weight = nn.Parameter(
            torch.empty(cfg.num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.weight.dummy_init = self._dummy_init
        self.weight_16bit: torch.Tensor | None = None
        self.e_score_correction_bias = None
        if cfg.routing.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(cfg.num_experts, dtype=torch.float32), requires_grad=False
            )
            self.e_score_correction_bias.dummy_init = lambda std, gen: (
                self.e_score_correction_bias.data.zero_()
            )

    def _dummy_init(self, std: float, generator: torch.Generator) -> None:
        """Random gate weights as a checkpoint in the model dtype would hold them (rounded to it)."""
        self.weight.data.normal_(0.0, std, generator=generator)
        if self.dtype.itemsize == 2:
            self.weight.data.copy_(self.weight.data.to(self.dtype))

    def process_weights_after_loading(self) -> None:
        weight = self.weight.data
        if weight.device.type != "cuda" or self.dtype not in (torch.bfloat16, torch.float16):
            return
        low = weight.to(self.dtype)
        if torch.equal(low.float(), weight):
            self.weight_16bit = low

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (self.weight_16bit is not None and hidden.dtype == self.dtype and hidden.dim() == 2
                and not batch_invariant.is_enabled()):  # that mode's invariant matmuls take float32 here
            logits = torch.mm(hidden, self.weight_16bit.t(), out_dtype=torch.float32)
        else:
            logits = torch.nn.functional.linear(hidden.float(), self.weight)
        return select_experts(logits, self.cfg.top_k, self.cfg.routing, self.e_score_correction_bias)


class FusedExperts(nn.Module):
    """E SiLU-gated experts stacked for one grouped op: ``w13 [E, 2I, H]``, ``w2 [E, H, I]``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, quant: Fp8Config | None):
        super().__init__()
        self.num_experts, self.quant = num_experts, quant
        dtype = FP8_DTYPE if quant else None
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype), requires_grad=False
        )
        self.w13.weight_loader, self.w2.weight_loader = self._loader("w13", False), self._loader("w2", False)
        self.shards: dict[str, BlockScaledShards] = {}
        if quant:
            size = intermediate_size
            self.shards = {
                "w13": BlockScaledShards(hidden_size, [size, size], [0, 1], quant.block_size),
                "w2": BlockScaledShards(size, [hidden_size], [0], quant.block_size),
            }
            for name, shards in self.shards.items():
                scale = nn.Parameter(
                    torch.empty(num_experts, shards.scale_rows, shards.cols, dtype=torch.float32),
                    requires_grad=False,
                )
                scale.weight_loader = self._loader(name, True)
                scale.dummy_init = lambda std, gen: None  # written by the weight's dummy init
                setattr(self, f"{name}_scale_inv", scale)
                getattr(self, name).dummy_init = self._dummy_init_fn(name)
        self.dtype = torch.get_default_dtype()
        self.dense: tuple[torch.Tensor, torch.Tensor] | None = None

    def _loader(self, name: str, is_scale: bool):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str] | None = None) -> None:
            """``shard``: (expert, 'gate' | 'up' | 'down') for a per-expert tensor; None: stacked."""
            target = param.data
            if shard is not None:
                expert, kind = shard
                if not 0 <= expert < self.num_experts:
                    raise ValueError(f"expert index {expert} out of range [0, {self.num_experts})")
                index, target = SHARDS[kind][1], target[expert]
                if is_scale:
                    _, _, srow, srows = self.shards[name].offsets[index]
                    target = target.narrow(0, srow, srows)
                elif name == "w13":
                    size = target.shape[0] // 2
                    target = target.narrow(0, index * size, size)
            if target.shape != loaded.shape:
                raise ValueError(
                    f"expert tensor of shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}"
                )
            if self.quant and not is_scale and loaded.dtype != FP8_DTYPE:
                raise ValueError(
                    f"expected FP8 (float8_e4m3fn) experts for an fp8 checkpoint, got {loaded.dtype}"
                )
            target.copy_(loaded)

        return load

    def _dummy_init_fn(self, name: str):
        def init(std: float, generator: torch.Generator) -> None:
            weight, scale = getattr(self, name).data, getattr(self, f"{name}_scale_inv").data
            for e in range(self.num_experts):  # one expert at a time: bounded float32 scratch
                dense = torch.empty(weight.shape[1:], dtype=torch.float32, device=weight.device)
                self.shards[name].quantize_into(
                    dense.normal_(0.0, std, generator=generator), weight[e], scale[e]
                )

        return init

    def process_weights_after_loading(self) -> None:
        """FP8 experts on CPU or off the scale grid: dequantize once; on CUDA they stay FP8."""
        w13 = self.w13
        on_grid = self.quant and (w13.shape[1] // 2) % self.quant.block_size[0] == 0
        if self.quant and (w13.device.type == "cpu" or not on_grid):
            self.dense = tuple(
                self.shards[n].dequantize(getattr(self, n), getattr(self, f"{n}_scale_inv"), self.dtype)
                for n in ("w13", "w2")
            )

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.dense is not None:
            return fused_moe(hidden, *self.dense, topk_weights, topk_ids)
        if self.quant:
            return fused_moe(
                hidden, self.w13, self.w2, topk_weights, topk_ids, w13_scale_inv=self.w13_scale_inv,
                w2_scale_inv=self.w2_scale_inv, block_size=self.quant.block_size,
            )
        return fused_moe(hidden, self.w13, self.w2, topk_weights, topk_ids)
