"""DeepSeek-V2/V3 building blocks: config checks, the dense MLP, the MoE block and the decoder layer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from dsinfer import batch_invariant
from dsinfer.config import KernelConfig
from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.distributed.expert_parallel import EPGroup, ep_moe, ep_moe_replicated
from dsinfer.distributed.state import SINGLE, ParallelState, split_over_experts
from dsinfer.layers.fp8_linear import Fp8Config, make_linear
from dsinfer.layers.linear import Linear
from dsinfer.layers.mla import MLAAttention
from dsinfer.layers.moe import ExpertMap, ExpertSlots, FusedExperts, Router, RouterConfig
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.streams import SideStream, in_graphs
from dsinfer.ops.moe import Routing

REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
MOE_REQUIRED = ("moe_intermediate_size", "num_experts_per_tok")
# batches up to this many tokens run the shared experts inside the grouped GEMM; larger ones run them as dense
# GEMMs, on a side stream beside the router and the routed experts where that is on (V2-Lite on the H200, µs per
# MoE layer, fused / after / beside: 1 token 55.0 / 68.2 / 57.5, 32 tokens 257.7 / 267.2 / 256.8, 64 tokens
# 284.5 / 288.5 / 277.5, 256 tokens 337.2 / 325.2 / 320.0: session 11's probe, docs/benchmarks.md)
FUSED_SHARED_MAX_TOKENS = 64
FUSED_SHARED_MAX_TOKENS_BESIDE = 32


def check_config(cfg: dict[str, Any]) -> None:
    """Raise a ValueError naming the field for a config this model cannot be built from."""
    arch = cfg.get("architectures")
    missing = [k for k in REQUIRED if cfg.get(k) is None]
    if cfg.get("n_routed_experts"):
        missing += [k for k in MOE_REQUIRED if cfg.get(k) is None]
    if missing:
        raise ValueError(f"config.json is missing required field(s) {missing} for {arch}")
    for key in REQUIRED + ("q_lora_rank", "n_routed_experts", "n_shared_experts", "moe_intermediate_size"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{key} must be a positive integer (or null where optional), got {value!r}")
    if cfg["qk_rope_head_dim"] % 2:
        raise ValueError(f"qk_rope_head_dim must be even (rope rotates pairs), got {cfg['qk_rope_head_dim']}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported; supported: 'silu'")
    if (cfg.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"moe_layer_freq={cfg.get('moe_layer_freq')!r} is not supported (every layer from "
                         "first_k_dense_replace on is MoE, as in transformers and every DeepSeek release): 1")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported for DeepSeek models (their MLPs have no bias)")


def router_config(cfg: dict[str, Any], defaults: dict[str, Any], gemv: bool = True) -> RouterConfig:
    """The gate's settings; fields a config leaves out (transformers 5 drops V3's) take the variant's. A config
    naming the other variant's scoring function (V2 softmax, V3 sigmoid: transformers hard-codes them, DeepSeek's
    code raises for the other) or a top-k method outside the variant's ``topk_methods`` is a ValueError, not a
    silent switch. ``gemv``: ``KernelConfig.router_gemv``."""

    def get(key: str, fallback: Any) -> Any:
        value = cfg.get(key)
        return fallback if value is None else value

    if get("scoring_func", defaults["scoring_func"]) != defaults["scoring_func"]:
        raise ValueError(f"scoring_func={cfg['scoring_func']!r} is not supported for {cfg.get('architectures')}; "
                         f"supported: {defaults['scoring_func']!r}")
    if get("topk_method", defaults["topk_method"]) not in defaults["topk_methods"]:
        raise ValueError(f"topk_method={cfg['topk_method']!r} is not supported for {cfg.get('architectures')}; "
                         f"supported: {list(defaults['topk_methods'])}")

    routing = Routing(
        scoring_func=get("scoring_func", defaults["scoring_func"]),
        topk_method=get("topk_method", defaults["topk_method"]),
        n_group=get("n_group", 1),
        topk_group=get("topk_group", 1),
        norm_topk_prob=bool(get("norm_topk_prob", defaults["norm_topk_prob"])),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
    )
    return RouterConfig(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"], routing=routing,
                        gemv=gemv)


def fused_shared_experts(cfg: dict[str, Any], quant: Fp8Config | None, enabled: bool = True) -> int:
    """How many shared experts run as extra experts of the routed grouped GEMM (``FusedExperts`` slots after
    the routed ones, weight 1.0 for every token): ``n_shared_experts``, or 0 to keep a separate shared MLP
    (also when not ``enabled``: ``KernelConfig.fuse_shared_experts``, ``DSINFER_FUSE_SHARED_EXPERTS``).

    Saves the shared MLP's own launches (gate/up GEMM, SiLU-mul, down GEMM) in every MoE layer. Exact: the shared
    MLP of intermediate size S * I is S experts of size I summed. 0 without shared experts, and for FP8 with I off
    the scale grid: a chunk of the shared weights would then split a scale block."""
    shared = cfg.get("n_shared_experts") or 0
    if not shared or not cfg.get("n_routed_experts") or not enabled:
        return 0
    inter = cfg["moe_intermediate_size"]
    if quant and (inter % quant.block_size[0] or inter % quant.block_size[1]):
        return 0
    return shared


def is_moe_layer(cfg: dict[str, Any], layer_idx: int) -> bool:
    return (
        bool(cfg.get("n_routed_experts"))
        and layer_idx >= (cfg.get("first_k_dense_replace") or 0)
        and layer_idx % (cfg.get("moe_layer_freq") or 1) == 0
    )


class DeepseekMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, quant: Fp8Config | None, fused_silu_mul: bool = True,
                 tp: ParallelState = SINGLE, reduce_results: bool = True):
        """``tp``: the intermediate columns split across its ranks; ``reduce_results`` False leaves the output
        this rank's partial sum (the shared experts, reduced with the routed ones in one all-reduce)."""
        super().__init__()
        what = "intermediate_size" if reduce_results else "moe_intermediate_size * n_shared_experts"
        self.gate_up_proj = make_linear(hidden, [intermediate, intermediate], quant, tp=tp, split="column",
                                        what=what)
        self.down_proj = make_linear(intermediate, hidden, quant, tp=tp, split="row", what=what,
                                     reduce_results=reduce_results)
        self.fused_silu_mul = fused_silu_mul  # KernelConfig.fused_silu_mul

    def forward(self, x: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        """MLP(x), or ``add_to + MLP(x)``: with a plain (unquantized, bias-free) down_proj the sum is the down
        GEMM's own epilogue (``addmm_``, in place on ``add_to``: one kernel, not a GEMM and an add)."""
        h = self.gate_up_proj.silu_mul(x, self.fused_silu_mul)
        down = self.down_proj
        if add_to is None:
            return down(h)
        if (type(down) is Linear and down.bias is None and add_to.dtype == h.dtype == down.weight.dtype
                and add_to.is_contiguous() and not batch_invariant.is_enabled()):  # that mode routes addmm only
            return add_to.view(-1, add_to.shape[-1]).addmm_(h.view(-1, h.shape[-1]), down.weight.t()).view(
                add_to.shape)
        return add_to + down(h)


class DeepseekMoE(nn.Module):
    """Routed experts (top-k of n_routed_experts) plus always-on shared experts: fused into the routed experts'
    grouped GEMM (``fused_shared_experts``), else a separate ``shared_experts`` MLP added to their output."""

    def __init__(self, cfg: dict[str, Any], quant: Fp8Config | None, router: RouterConfig,
                 kernel: KernelConfig | None = None, side_stream: SideStream | None = None,
                 tp: ParallelState = SINGLE, expert_slots: ExpertSlots | None = None):
        """``side_stream``: the model's, to run separate shared experts beside the routed ones in CUDA graphs
        (None: in sequence). ``tp``: every expert's intermediate columns split across its ranks (each rank routes
        every token); the routed and shared partial sums are all-reduced once, as the block's output.
        ``expert_slots``: redundant and spare expert slots under EPLB (None: one slot per expert, no map).
        Expert parallelism (``tp.ep_size`` > 1): this rank holds its share of the routed experts whole (see
        ``distributed.expert_parallel``), the shared experts stay a tensor-parallel MLP beside them."""
        super().__init__()
        kernel = kernel or KernelConfig()
        hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
        ep = tp.expert_parallel
        router = replace(router, num_shared=fused_shared_experts(cfg, quant, kernel.fuse_shared_experts and not ep))
        self.gate = Router(hidden, router)
        self.top_k = router.top_k
        self.expert_map = None if expert_slots is None else ExpertMap(router.num_experts, router.num_shared,
                                                                      expert_slots, tp.ep_size)
        storage = None if self.expert_map is None else self.expert_map.num_storage
        local_log = None
        if ep:  # this rank's storage slots and the experts they hold at load
            if self.expert_map is None:
                per_rank = split_over_experts(router.num_experts, tp.ep_size, "n_routed_experts")
                local_log = list(range(tp.ep_rank * per_rank, (tp.ep_rank + 1) * per_rank))
            else:
                local_log = [self.expert_map.slot_log[s] for s in self.expert_map.rank_slots(tp.ep_rank)]
        self.experts = FusedExperts(router.num_experts, hidden, inter, quant, num_shared=router.num_shared,
                                    tp=SINGLE if ep else tp, num_storage=storage, local_log=local_log)
        shared = 0 if router.num_shared else cfg.get("n_shared_experts") or 0
        self.shared_experts = DeepseekMLP(hidden, inter * shared, quant, kernel.fused_silu_mul, tp,
                                          reduce_results=False) if shared else None
        self.side_stream = side_stream  # separate shared experts beside, in CUDA graphs
        self.tp = tp

    def forward(self, x: torch.Tensor, graphed: bool = False) -> torch.Tensor:
        """``graphed``: this forward is captured into a CUDA graph or warms a capture up (``in_graphs``)."""
        if self.tp.expert_parallel:
            return self._expert_parallel(x)
        return self.tp.all_reduce(self._experts(x, graphed))

    def _expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts wherever they live, plus the shared experts (``distributed.expert_parallel``):
        with DP attention each rank's own tokens travel to the experts' ranks and back (``ep_moe``); otherwise
        every rank holds every token, runs the pairs of its own experts, and one all-reduce sums the ranks'
        parts with the shared experts' tensor-parallel partial sums (``ep_moe_replicated``)."""
        topk_weights, topk_slots = self.route(x, with_shared=False)
        per_rank = self.experts.num_storage
        if self.tp.dp_size > 1:
            group = EPGroup(self.tp.ep_rank, self.tp.ep_size, self.tp.ep_group)
            return ep_moe(x, topk_weights, topk_slots, self.experts.w13, self.experts.w2, group,
                          shared=self.shared_experts)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()  # no host read inside a graph
        out = ep_moe_replicated(x, topk_weights, topk_slots, self.experts.w13, self.experts.w2,
                                self.tp.ep_rank * per_rank, static=capturing)
        if self.shared_experts is not None:
            out = self.shared_experts(x, add_to=out)
        return self.tp.all_reduce(out)

    def _experts(self, x: torch.Tensor, graphed: bool) -> torch.Tensor:
        """The routed and shared experts' sum (this rank's part of it)."""
        has_slots = self.experts.num_shared > 0  # shared experts stacked with the routed ones
        # Past a few dozen tokens the shared experts' rows in the grouped GEMM (every token, tiles of a decode
        # config) cost more than dense GEMMs (see FUSED_SHARED_MAX_TOKENS). The deterministic mode always fuses:
        # its sums must not depend on the batch size.
        # Only in CUDA graphs: run eagerly, the fork and join of the side stream cost more host time per layer
        # than the overlap saves (a 512-token eager prefill step of V2-Lite: 46 ms of wall time against 38, for
        # the same 12 ms of GPU time)
        beside = graphed and self.side_stream is not None and x.is_cuda and x.shape[0] > 0
        limit = FUSED_SHARED_MAX_TOKENS_BESIDE if beside else FUSED_SHARED_MAX_TOKENS
        fuse = has_slots and (x.shape[0] <= limit or batch_invariant.is_enabled())
        if beside and not fuse and (has_slots or self.shared_experts is not None):
            # the shared MLP on the side stream while this one routes and runs the routed experts; the top-k
            # sum waits for it and adds it (no add kernel)
            shared = self.experts.shared if has_slots else self.shared_experts
            topk_weights, topk_ids = self.route(x, with_shared=False)
            return self.experts(x, topk_weights, topk_ids, addend=self.side_stream.run_beside(shared, x))
        topk_weights, topk_ids = self.route(x, with_shared=fuse)
        out = self.experts(x, topk_weights, topk_ids)
        if has_slots and not fuse:
            out = self.experts.shared(x, add_to=out)
        if self.shared_experts is not None:
            out = self.shared_experts(x, add_to=out)
        return out


    def route(self, x: torch.Tensor, with_shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights, slot ids): the gate's choice, mapped to storage slots under EPLB."""
        topk_weights, topk_ids = self.gate(x, with_shared=with_shared)
        if self.expert_map is not None:
            topk_ids = self.expert_map(topk_ids, self.top_k)
        return topk_weights, topk_ids

    def fill_replicas(self) -> None:
        """Copy each loaded expert (slot e holds expert e) into the other slots the map gives it."""
        if self.expert_map is None or self.experts.local_log is not None:  # EP: the loader filled every slot
            return
        for slot, logical in enumerate(self.expert_map.slot_log):
            if slot != logical:
                self.experts.copy_slot(logical, slot)

    def process_weights_after_loading(self) -> None:
        """Before the experts' own (``modules()`` visits this module first): the replicas, from the slots the
        checkpoint filled."""
        self.fill_replicas()


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, quant: Fp8Config | None, variant: dict[str, Any],
                 kernel: KernelConfig | None = None, side_stream: SideStream | None = None,
                 tp: ParallelState = SINGLE, expert_slots: ExpertSlots | None = None):
        """``kernel``: the engine's kernel choices (None: the defaults); ``side_stream``: the model's (None: one
        stream); ``tp``: the tensor-parallel split of its attention heads and MLP columns; ``expert_slots``:
        EPLB's (``DeepseekMoE``)."""
        super().__init__()
        kernel = kernel or KernelConfig()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        attention = variant.get("attention", MLAAttention)  # V3.2: MLA over the indexer's selection
        parallel = {"tp": tp} if tp.tp_size > 1 else {}  # V3.2's attention runs on one rank only
        self.self_attn = attention(cfg, quant, variant["rope_is_neox"](cfg), side_stream, **parallel)
        self.is_moe = is_moe_layer(cfg, layer_idx)
        if self.is_moe:
            router = router_config(cfg, variant["router"], kernel.router_gemv)
            self.mlp = DeepseekMoE(cfg, quant, router, kernel, side_stream, tp, expert_slots)
        else:
            self.mlp = DeepseekMLP(hidden, cfg["intermediate_size"], quant, kernel.fused_silu_mul, tp)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.is_moe:
            # asked only where the answer matters (in_graphs is a host call per layer)
            graphed = self.mlp.side_stream is not None and hidden.is_cuda and in_graphs(batch)
            return self.mlp(hidden, graphed), residual
        return self.mlp(hidden), residual
