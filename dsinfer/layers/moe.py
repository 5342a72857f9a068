"""Routed experts: the router gate and the stacked expert weights that ``ops.fused_moe`` runs.

Checkpoints store one tensor per expert (``experts.{e}.{gate,up,down}_proj.weight``); the weight loader copies
each into its slice of ``w13 [E, 2I, H]`` ([gate; up]) or ``w2 [E, H, I]``. transformers' fused layout
(``experts.gate_up_proj`` / ``experts.down_proj``) loads whole into the routed slots. FP8 checkpoints keep FP8
experts with their block scales: on CUDA the block-scaled fused MoE kernel multiplies them as FP8; on CPU (or
with an intermediate size off the scale grid) they are dequantized once after loading.

Shared experts can ride in the same stack: with ``num_shared`` = S the slots are E routed experts, then S
shared ones (``w13 [E + S, 2I, H]``), which the router gives every token with weight 1.0
(``RouterConfig.num_shared``). A shared MLP of intermediate size S * I is exactly S experts of size I summed
(SiLU(gate) * up is elementwise over the intermediate dimension, down sums over it), so its checkpoint tensors
(shard ``("shared", kind)``) load in S chunks: gate / up rows [jI, (j + 1)I) and down_proj columns
[jI, (j + 1)I) go to slot E + j, block scales likewise (which needs I on the scale grid).

Redundant experts (EPLB, ``ExpertSlots``): the stack then holds ``num_storage`` routed slots, P = E +
``num_redundant`` of them in use (physical experts) and ``num_spare`` outside any map, into which a rebalance
copies new replicas; the shared slots follow them. ``ExpertMap`` turns the router's logical ids into storage
slots, a replica chosen by token index, and counts each slot's tokens on the device. A checkpoint loads into
slots 0..E-1 (expert e in slot e); ``fill_replicas`` copies each into the other slots that hold it.

Expert parallelism (``ParallelState.ep_size`` = N > 1): the storage slots are global and rank-major, rank r holding
``[r L, (r + 1) L)`` with L = P / N + spares per rank (its physical experts, then its own spare slots), and a
rank's ``FusedExperts`` holds only its L slots (``local_log``: the logical expert each starts with): the
checkpoint's expert e loads straight into every local slot holding it, the other ranks' experts are read and
skipped. Without EPLB, P = E and rank r holds experts ``[r E / N, (r + 1) E / N)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dsinfer import batch_invariant
from dsinfer.distributed.state import SINGLE, ParallelState, split_evenly, split_over_experts
from dsinfer.layers.fp8_linear import BlockScaledShards, Fp8Config
from dsinfer.ops.activation import silu_and_mul
from dsinfer.ops.fp8 import FP8_DTYPE, fp8_block_linear
from dsinfer.ops.moe import Routing, fused_moe, route_hidden, select_experts

SHARDS = {"gate": ("w13", 0), "up": ("w13", 1), "down": ("w2", 0)}
SHARED = "shared"  # the expert index of a shard of the shared experts' MLP: ("shared", "gate" | "up" | "down")


@dataclass(frozen=True)
class RouterConfig:
    """A MoE layer's gate: how many experts, how many per token, and how they are picked (``ops.moe.Routing``)."""

    num_experts: int  # routed experts (the gate's outputs)
    top_k: int  # routed experts per token
    routing: Routing = Routing()
    num_shared: int = 0  # shared experts stacked after the routed ones, given to every token with weight 1.0
    gemv: bool = True  # small batches' logits from the split-K Triton GEMV on CUDA (``KernelConfig.router_gemv``)

    def __post_init__(self):
        n_group, topk_group = self.routing.n_group, self.routing.topk_group
        if isinstance(self.num_shared, bool) or not isinstance(self.num_shared, int) or self.num_shared < 0:
            raise ValueError(f"num_shared={self.num_shared!r} must be an integer >= 0")
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

    def forward(self, hidden: torch.Tensor, with_shared: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights, topk_ids): the routed choice, plus the shared-expert columns when ``with_shared``."""
        shared = self.cfg.num_shared if with_shared else 0
        if (self.weight_16bit is not None and hidden.dtype == self.dtype and hidden.dim() == 2
                and not batch_invariant.is_enabled()):  # that mode's invariant matmuls take float32 here
            return route_hidden(hidden, self.weight_16bit, self.cfg.top_k, self.cfg.routing,
                                self.e_score_correction_bias, shared, gemv=self.cfg.gemv)
        logits = torch.nn.functional.linear(hidden.float(), self.weight)
        return select_experts(logits, self.cfg.top_k, self.cfg.routing, self.e_score_correction_bias, shared)


@dataclass(frozen=True)
class ExpertSlots:
    """A MoE layer's physical expert slots beyond its logical experts (EPLB): ``num_redundant`` replicas of hot
    experts in the maps, ``num_spare`` storage slots outside them that a rebalance copies new replicas into."""

    num_redundant: int = 0
    num_spare: int = 1


class ExpertMap(nn.Module):
    """Logical expert -> the storage slot of one of its replicas, and the tokens each slot got.

    ``table [E + S, R]``: each logical expert's storage slots (R = the most replicas one can have, rows padded
    by repeating), then the S shared experts' (one each, after the routed storage slots); ``counts [E + S]``:
    replicas per row. Token t takes replica ``t % count`` of each expert it routes to: the choice depends on the
    token's index only, and replicas hold the same bytes, so outputs do not depend on it. ``load``: when set (a
    [storage slots] float32 view of the load balancer's counters), every forward adds each routed pair to its
    slot's count on the device (``index_add_``: no host read, CUDA-graph safe). The host keeps ``slot_log``
    (the logical expert of each storage slot, -1 for a spare); ``assign`` rewrites the device tables from it."""

    def __init__(self, num_logical: int, num_shared: int, slots: ExpertSlots, ep_size: int = 1):
        """``ep_size``: the expert-parallel ranks the storage slots are spread over (rank-major, each rank its
        share of the physical experts and its own ``num_spare`` spares; see the module doc)."""
        super().__init__()
        self.num_logical, self.num_shared = num_logical, num_shared
        self.num_physical = num_logical + slots.num_redundant
        what = "n_routed_experts + eplb_config.num_redundant_experts" if slots.num_redundant else "n_routed_experts"
        physical_per_rank = split_over_experts(self.num_physical, ep_size, what)
        self.ep_size = ep_size
        self.num_storage = self.num_physical + ep_size * slots.num_spare
        self.storage_per_rank = self.num_storage // ep_size
        self.max_replicas = slots.num_redundant + 1
        self.register_buffer("table", torch.zeros(num_logical + num_shared, self.max_replicas, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("counts", torch.ones(num_logical + num_shared, dtype=torch.int64), persistent=False)
        self.load: torch.Tensor | None = None
        initial: list[int] = []
        for rank in range(ep_size):  # its physical experts (p holds logical p % E), then its spares
            first = rank * physical_per_rank
            initial += [p % num_logical for p in range(first, first + physical_per_rank)] + [-1] * slots.num_spare
        self.slot_log: list[int] = []
        self.assign(initial)

    def rank_slots(self, rank: int) -> range:
        """The global storage slots expert-parallel rank ``rank`` holds."""
        return range(rank * self.storage_per_rank, (rank + 1) * self.storage_per_rank)

    def tables(self, slot_log: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(table, counts) on the host for ``slot_log`` (replicas in ascending slot order)."""
        replicas: list[list[int]] = [[] for _ in range(self.num_logical)]
        for slot, logical in enumerate(slot_log):
            if logical >= 0:
                replicas[logical].append(slot)
        if any(not r for r in replicas) or len(slot_log) != self.num_storage:
            raise ValueError(f"a slot map must give every logical expert a slot in {self.num_storage} slots")
        replicas += [[self.num_storage + j] for j in range(self.num_shared)]
        table = torch.tensor([[r[i % len(r)] for i in range(self.max_replicas)] for r in replicas])
        return table, torch.tensor([len(r) for r in replicas])

    def assign(self, slot_log: list[int]) -> None:
        """Route by ``slot_log`` from the next forward on (stream-ordered copies: no host wait on CUDA)."""
        table, counts = self.tables(slot_log)
        if self.table.is_cuda:
            table, counts = table.pin_memory(), counts.pin_memory()
        self.table.copy_(table, non_blocking=True)
        self.counts.copy_(counts, non_blocking=True)
        self.slot_log = list(slot_log)

    def forward(self, topk_ids: torch.Tensor, num_routed: int) -> torch.Tensor:
        """[T, k (+ S)] logical ids -> storage slots; the first ``num_routed`` columns are counted in ``load``."""
        token = torch.arange(topk_ids.shape[0], device=topk_ids.device).unsqueeze(1)
        slots = self.table[topk_ids, token % self.counts[topk_ids]]
        if self.load is not None:
            routed = slots[:, :num_routed].reshape(-1)
            self.load.index_add_(0, routed, torch.ones(routed.shape, dtype=self.load.dtype, device=routed.device))
        return slots


class FusedExperts(nn.Module):
    """SiLU-gated experts stacked for one grouped op: ``w13 [E + S, 2I, H]``, ``w2 [E + S, H, I]``; slots
    0..E-1 the routed experts, E..E+S-1 the shared ones (``num_shared``, see the module doc)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, quant: Fp8Config | None,
                 num_shared: int = 0, tp: ParallelState = SINGLE, num_storage: int | None = None,
                 local_log: list[int] | None = None):
        """``tp``: every expert's intermediate columns split across its ranks (each holds I / tp of them; its
        output is then its part of the sum, for the caller to all-reduce); ``num_storage``: routed storage slots
        (EPLB: physical experts and spares; None: ``num_experts``); ``local_log``: expert parallelism: the
        logical expert each of this rank's storage slots holds at load (-1: a spare; ``num_storage`` is its
        length), the checkpoint's other experts are skipped (None: slot e holds expert e)."""
        super().__init__()
        self.local_log = None if local_log is None else list(local_log)
        if local_log is not None:
            if num_shared:
                raise ValueError("experts partitioned over ranks (local_log) stack no shared experts")
            num_storage = len(local_log)
        if tp.tp_size > 1 and quant:
            raise ValueError("FP8 experts are not supported with tensor_parallel_size > 1 yet (the block scales "
                             "would need splitting too): use a bf16 checkpoint")
        intermediate_size = split_evenly(intermediate_size, tp.tp_size, "moe_intermediate_size")
        self.tp = tp
        self.num_routed, self.num_shared, self.quant = num_experts, num_shared, quant
        self.num_storage = num_experts if num_storage is None else num_storage
        self.num_experts = slots = self.num_storage + num_shared  # what the stacked weights hold
        dtype = FP8_DTYPE if quant else None
        self.w13 = nn.Parameter(
            torch.empty(slots, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(slots, hidden_size, intermediate_size, dtype=dtype), requires_grad=False
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
                    torch.empty(slots, shards.scale_rows, shards.cols, dtype=torch.float32),
                    requires_grad=False,
                )
                scale.weight_loader = self._loader(name, True)
                scale.dummy_init = lambda std, gen: None  # written by the weight's dummy init
                setattr(self, f"{name}_scale_inv", scale)
                getattr(self, name).dummy_init = self._dummy_init_fn(name)
        if (self.num_storage > num_experts or local_log is not None) and not quant:  # as drawn without replicas
            self.w13.dummy_init, self.w2.dummy_init = self._logical_init("w13"), self._logical_init("w2")
        self.dtype = torch.get_default_dtype()
        self.dense: tuple[torch.Tensor, torch.Tensor] | None = None
        self.filled: set[tuple[str, int | str, str]] = set()  # (parameter, expert | "shared", kind) loaded so far

    def missing_shards(self) -> list[str]:
        """Checkpoint tensors this stack has not received (``load_weights`` checks every expert is there: the
        stacked parameters are one tensor each, so a missing expert would not show as a missing parameter)."""
        leaves = [(n, n) for n in ("w13", "w2")] + [(f"{n}_scale_inv", n) for n in self.shards]
        experts = [*range(self.num_routed), *([SHARED] if self.num_shared else [])]
        return [f"{'shared_experts' if e == SHARED else f'experts.{e}'}.{kind}_proj"
                f"{'.weight_scale_inv' if leaf != name else '.weight'}"
                for leaf, name in leaves for e in experts for kind, (owner, _) in SHARDS.items()
                if owner == name and (leaf, e, kind) not in self.filled]

    def _loader(self, name: str, is_scale: bool):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int | str, str] | None = None) -> None:
            """``shard``: (expert, 'gate' | 'up' | 'down') for a per-expert tensor, ("shared", kind) for the
            shared experts' MLP; None: the routed experts stacked."""
            targets, dim = self._targets(name, is_scale, param.data, shard)
            leaf = f"{name}_scale_inv" if is_scale else name
            if self.local_log is not None:  # expert parallelism: this rank's experts only, each in all its slots
                loaded, targets = self._local_part(loaded, shard, targets)
            if self.tp.tp_size > 1:
                loaded = self._rank_slice(loaded, name, shard is None, len(targets))
            if not targets:  # another expert-parallel rank's expert
                self.filled.add((leaf, *shard))
                return
            size, want = targets[0].shape[dim], list(targets[0].shape)
            want[dim] *= len(targets)
            if tuple(loaded.shape) != tuple(want):
                chunks = f" ({len(targets)} shared experts of {tuple(targets[0].shape)})" if len(targets) > 1 else ""
                raise ValueError(f"expert tensor of shape {tuple(loaded.shape)} does not fit {tuple(want)}{chunks}")
            if self.quant and not is_scale and loaded.dtype != FP8_DTYPE:
                raise ValueError(
                    f"expected FP8 (float8_e4m3fn) experts for an fp8 checkpoint, got {loaded.dtype}"
                )
            for target, part in zip(targets, loaded.split(size, dim)):
                target.copy_(part)
            if shard is None:  # the stacked layout: every routed expert's shards of this parameter
                self.filled.update((leaf, e, kind) for e in range(self.num_routed)
                                   for kind, (owner, _) in SHARDS.items() if owner == name)
            else:
                self.filled.add((leaf, *shard))

        return load

    def _targets(
        self, name: str, is_scale: bool, data: torch.Tensor, shard: tuple[int | str, str] | None
    ) -> tuple[list[torch.Tensor], int]:
        """The views of ``data`` (``w13`` / ``w2`` or its scale) one checkpoint tensor fills, and the dimension
        of that tensor they lie along: one view, or the shared experts' S chunks (rows of gate / up, columns of
        down_proj: its input is the intermediate dimension)."""
        if shard is None:
            if self.local_log is not None:
                return [data[slot] for slot, logical in enumerate(self.local_log) if logical >= 0], 0
            return [data[: self.num_routed]], 0
        expert, kind = shard
        if kind not in SHARDS or SHARDS[kind][0] != name:
            raise ValueError(f"shard {kind!r} does not belong in {name}; {name} takes "
                             f"{[k for k, (n, _) in SHARDS.items() if n == name]}")
        if expert == SHARED:
            if not self.num_shared:
                raise ValueError("a shared-expert tensor for experts stacked without shared slots (num_shared=0)")
            slots, dim = range(self.num_storage, self.num_experts), 1 if kind == "down" else 0
        elif isinstance(expert, int) and 0 <= expert < self.num_routed:
            slots, dim = ([expert] if self.local_log is None else
                          [slot for slot, logical in enumerate(self.local_log) if logical == expert]), 0
        else:
            raise ValueError(f"expert index {expert!r} out of range [0, {self.num_routed}) (routed experts)")
        index = SHARDS[kind][1]
        if is_scale:
            _, _, srow, srows = self.shards[name].offsets[index]
            return [data[e].narrow(0, srow, srows) for e in slots], dim
        if name == "w13":
            size = data.shape[1] // 2
            return [data[e].narrow(0, index * size, size) for e in slots], dim
        return [data[e] for e in slots], dim

    def _local_part(self, loaded: torch.Tensor, shard: tuple[int | str, str] | None,
                    targets: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Expert parallelism: (the loaded rows for ``targets``, laid end to end along dimension 0, and the
        targets): the stacked layout's experts of this rank's slots, or one expert repeated for its replicas."""
        if shard is None:
            used = [logical for logical in self.local_log if logical >= 0]
            return loaded[used].flatten(0, 1), targets
        return (loaded if len(targets) <= 1 else torch.cat([loaded] * len(targets))), targets

    def _rank_slice(self, loaded: torch.Tensor, name: str, stacked: bool, chunks: int) -> torch.Tensor:
        """This rank's intermediate columns of a checkpoint tensor: w13's rows (an expert's gate or up
        [chunks * I, H], or the stacked [E, 2I, H]) or w2's columns ([H, chunks * I], or [E, H, I]), each chunk of
        I cut to its I / tp."""
        if name == "w13":
            dim, chunks = (1, 2) if stacked else (0, chunks)
        else:
            dim, chunks = loaded.dim() - 1, 1 if stacked else chunks
        size = loaded.shape[dim] // chunks
        local = size // self.tp.tp_size
        parts = loaded.unflatten(dim, (chunks, size)).narrow(dim + 1, self.tp.tp_rank * local, local)
        return parts.flatten(dim, dim + 1)

    def checkpoint_tensor(self, leaf: str, shard: tuple[int | str, str] | None = None) -> torch.Tensor:
        """The weight loader read backwards: the tensor a checkpoint stores for ``shard`` of the parameter
        ``leaf`` ("w13", "w2", "w13_scale_inv", ...), rebuilt from our slots (to copy our weights elsewhere)."""
        name = leaf.removesuffix("_scale_inv")
        targets, dim = self._targets(name, leaf != name, getattr(self, leaf).data, shard)
        if self.local_log is not None:  # one of this rank's replicas of the expert (or the stacked experts')
            if not targets:
                raise ValueError(f"expert {shard[0]} is not on this expert-parallel rank")
            return targets[0] if shard is not None else torch.stack(targets)
        return targets[0] if len(targets) == 1 else torch.cat(targets, dim)

    def logical_slots(self) -> list[int]:
        """The slots a checkpoint fills: the routed experts' 0..E-1, then the shared ones (expert parallelism:
        the numbers the draws of one rank's stack hold, 0..E-1)."""
        if self.local_log is not None:
            return list(range(self.num_routed))
        return [*range(self.num_routed), *range(self.num_storage, self.num_experts)]

    def _logical_init(self, name: str):
        def init(std: float, generator: torch.Generator) -> None:
            """Random weights into the checkpoint's slots, drawn as for a stack without replicas."""
            data, slots = getattr(self, name).data, self.logical_slots()
            drawn = torch.empty((len(slots), *data.shape[1:]), dtype=data.dtype,
                                device=data.device).normal_(0.0, std, generator=generator)
            if self.local_log is None:
                data[slots] = drawn
                return
            for slot, logical in enumerate(self.local_log):  # this rank's experts, as one rank draws them
                if logical >= 0:
                    data[slot] = drawn[logical]

        return init

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by slot in its first dimension (weights, block scales, dequantized copies)."""
        names = ["w13", "w2", *(f"{n}_scale_inv" for n in self.shards)]
        return [getattr(self, n).data for n in names] + list(self.dense or ())

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot ``dst`` becomes a byte copy of slot ``src`` (on the current stream)."""
        for tensor in self.slot_tensors():
            tensor[dst].copy_(tensor[src], non_blocking=True)

    def slot_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.slot_tensors())

    def _dummy_init_fn(self, name: str):
        def init(std: float, generator: torch.Generator) -> None:
            weight, scale = getattr(self, name).data, getattr(self, f"{name}_scale_inv").data
            for e in self.logical_slots():  # one expert at a time: bounded float32 scratch
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
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        addend: Callable[[], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The routed (and stacked shared) experts' weighted sum, plus ``addend()`` (see ``ops.moe.fused_moe``)."""
        if self.dense is not None:
            return fused_moe(hidden, *self.dense, topk_weights, topk_ids, addend=addend)
        if self.quant:
            return fused_moe(
                hidden, self.w13, self.w2, topk_weights, topk_ids, w13_scale_inv=self.w13_scale_inv,
                w2_scale_inv=self.w2_scale_inv, block_size=self.quant.block_size, addend=addend,
            )
        return fused_moe(hidden, self.w13, self.w2, topk_weights, topk_ids, addend=addend)

    def shared(self, hidden: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        """The shared experts (slots E..E+S-1) as dense MLPs beside the grouped GEMM, for the batches where their
        rows in it would cost more than separate GEMMs (``DeepseekMoE``): one batched gate/up GEMM over the S
        slots, SiLU-mul, and the down GEMMs summed, into ``add_to`` in place when given (the sum is the GEMMs'
        epilogue)."""
        first = self.num_storage
        if self.quant and self.dense is None:  # FP8 slots: the block-scaled GEMM, slot by slot
            block = self.quant.block_size
            out = add_to
            for e in range(first, self.num_experts):
                h = silu_and_mul(fp8_block_linear(hidden, self.w13[e], self.w13_scale_inv[e], block))
                down = fp8_block_linear(h, self.w2[e], self.w2_scale_inv[e], block)
                out = down if out is None else out + down
            return out
        w13, w2 = (w[first:] for w in (self.dense or (self.w13, self.w2)))
        h = silu_and_mul(torch.matmul(hidden, w13.transpose(1, 2)))  # [S, T, I]
        if add_to is None:  # beta=0: the empty tensor's contents are ignored
            return hidden.new_empty(hidden.shape[0], w2.shape[1]).addbmm_(h, w2.transpose(1, 2), beta=0)
        return add_to.addbmm_(h, w2.transpose(1, 2))
