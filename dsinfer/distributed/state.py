"""``ParallelState``: this rank's place in the tensor-parallel group and the collectives its layers call.

Built once per worker process (``groups.init_parallel_state``) and handed to the model at construction, so a
layer holds the state it reduces over; nothing on the forward path reads a global. At one rank (``SINGLE``) every
collective returns its input untouched: the single-GPU path does no extra work. Data- and expert-parallel groups
(issue 38) join here as further fields.
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


@dataclass(frozen=True)
class ParallelState:
    """This process's rank in the tensor-parallel group (of ``tp_size`` ranks) and the group itself."""

    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None  # a torch.distributed ProcessGroup; None: one rank (or a shape check on the meta device)

    def __post_init__(self):
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} is outside [0, tp_size={self.tp_size})")

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
