"""The process groups of an engine's ranks: the tensor-parallel group (NCCL on CUDA, gloo on CPU), whose
collectives time out after ``DSINFER_DIST_TIMEOUT_S`` so that a dead or hung rank fails the others in bounded time,
and the control channel (gloo, host memory), over which rank 0 hands every engine message (step plans as msgpack
bytes) to the other ranks.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from dsinfer.distributed.rendezvous import Rendezvous
from dsinfer.distributed.state import ParallelState

# rank 0 sends a ping this often while the engine is idle, so the control channel's wait never times out on an
# idle server (and a follower that died is noticed by rank 0 within about a ping)
PING_S = 30.0
# the control channel also waits while rank 0 loads the model (the other ranks may finish first)
CONTROL_TIMEOUT_S = 1800.0


class ControlChannel:
    """Rank 0 -> every rank: byte messages in order (``broadcast(data)`` on rank 0, ``receive()`` elsewhere)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def broadcast(self, data: bytes) -> None:
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.group)

    def receive(self) -> bytes:
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.group)
        return data.numpy().tobytes()


def init_parallel_state(rdv: Rendezvous, rank: int, device: torch.device, timeout_s: float,
                        expert_parallel: bool = False, dp_size: int = 1) -> tuple[ParallelState, ControlChannel]:
    """Join the rendezvous as ``rank``; -> the parallel state and the control channel. Every rank of the world
    is in the tensor-parallel group, and with ``expert_parallel`` in the expert-parallel group too; with
    ``dp_size`` > 1 (DP attention) each rank is its own tensor-parallel group of one and the world is the EP
    group. Blocks until every rank has joined (or the store's timeout passes)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=rdv.url, rank=rank, world_size=rdv.world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=max(CONTROL_TIMEOUT_S, timeout_s)))
    ep = {}
    if expert_parallel:  # every rank creates the same groups in the same order
        ep = dict(ep_size=rdv.world_size, ep_rank=rank, ep_group=dist.group.WORLD,
                  ep_move_group=dist.new_group(backend=backend, timeout=timeout),
                  ep_host_group=dist.new_group(backend="gloo", timeout=timeout))
    if dp_size > 1:
        return ParallelState(dp_size=dp_size, **ep), ControlChannel(control)
    state = ParallelState(tp_size=rdv.world_size, tp_rank=rank, tp_group=dist.group.WORLD, **ep)
    return state, ControlChannel(control)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
