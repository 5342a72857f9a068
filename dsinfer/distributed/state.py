"""``ParallelState``: this rank's place in the tensor- and expert-parallel groups and the collectives its layers
call.

Built once per worker process (``groups.init_parallel_state``) and handed to the model at construction, so a
layer holds the state it reduces over; nothing on the forward path reads a global. At one rank (``SINGLE``) every
collective returns its input untouched: the single-GPU path does no extra work.

Expert parallelism (vLLM's ``enable_expert_parallel``) spans the EP group of ``ep_size`` = tensor_parallel_size x
data_parallel_size ranks: the routed experts are partitioned over it instead of split by intermediate columns
(``layers.moe``, ``distributed.expert_parallel``). ``dp_size`` > 1 means each rank runs its own tokens through
attention (DP attention); with ``dp_size`` = 1 every EP rank holds the same tokens (attention TP-split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def split_evenly(size: int, parts: int, what: str) -> int:
    """``size / parts``, or a ValueError naming ``what`` when it does not divide (sizes are checked before any
    weight loads: the engine builds the model on the meta device first)."""
    if size % parts:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({parts}); pick a "
                         f"tensor_parallel_size that divides it")
    return size // parts


def split_over_experts(num_physical: int, ep_size: int, what: str) -> int:
    """Physical experts per EP rank, or a ValueError naming ``what`` (checked on the meta device, before load)."""
    if num_physical % ep_size:
        raise ValueError(f"{what} ({num_physical}) is not divisible by the expert-parallel size {ep_size} "
                         "(tensor_parallel_size x data_parallel_size with enable_expert_parallel); pick sizes "
                         "that divide it, or set eplb_config.num_redundant_experts so that experts + redundant "
                         "is a multiple of it")
    return num_physical // ep_size


@dataclass(frozen=True)
class ParallelState:
    """This process's rank in the tensor-parallel group (of ``tp_size`` ranks) and the group itself, and in the
    expert-parallel group (``ep_size`` 1: experts are not partitioned)."""

    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None  # a torch.distributed ProcessGroup; None: one rank (or a shape check on the meta device)
    ep_size: int = 1  # ranks the routed experts are partitioned over (1: expert parallelism off)
    ep_rank: int = 0
    ep_group: Any = None  # the EP ranks' process group (the device's backend); None: one rank or a shape check
    # the same ranks again, for EPLB's point-to-point weight moves (the device's backend, beside the forward's)
    ep_move_group: Any = None
    # and a gloo group of them, for EPLB's host-side agreements (every rank switches at one step boundary)
    ep_host_group: Any = None
    dp_size: int = 1  # data-parallel attention ranks inside the EP group (1: every EP rank holds the same tokens)

    def __post_init__(self):
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} is outside [0, tp_size={self.tp_size})")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank={self.ep_rank} is outside [0, ep_size={self.ep_size})")
        if self.ep_size > 1 and self.ep_size != self.tp_size * self.dp_size:
            raise ValueError(f"ep_size={self.ep_size} must be tp_size x dp_size = {self.tp_size * self.dp_size}")

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1

    def for_shapes(self) -> ParallelState:
        """The same sizes and ranks without process groups (a model built on the meta device to check shapes)."""
        return ParallelState(self.tp_size, self.tp_rank, ep_size=self.ep_size, ep_rank=self.ep_rank,
                             dp_size=self.dp_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, in place (at one rank: ``x`` itself)."""
        if self.tp_size == 1:
            return x
        dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim`` in rank order (at one rank: ``x`` itself)."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:
            out = x.new_empty(self.tp_size * x.shape[0], *x.shape[1:])
            dist.all_gather_into_tensor(out, x, group=self.tp_group)
            parts = out.chunk(self.tp_size)
        else:
            parts = [torch.empty_like(x) for _ in range(self.tp_size)]
            dist.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim)

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` of the group's ranks (each rank sizes its KV cache; all must hold the same
        blocks)."""
        if self.tp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
        return int(t.item())


SINGLE = ParallelState()
