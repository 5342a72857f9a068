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


def init_parallel_state(rdv: Rendezvous, rank: int, device: torch.device,
                        timeout_s: float) -> tuple[ParallelState, ControlChannel]:
    """Join the rendezvous as ``rank``; -> the tensor-parallel state (every rank of the world, for now) and the
    control channel. Blocks until every rank has joined (or the store's timeout passes)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=rdv.url, rank=rank, world_size=rdv.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=max(CONTROL_TIMEOUT_S, timeout_s)))
    state = ParallelState(tp_size=rdv.world_size, tp_rank=rank, tp_group=dist.group.WORLD)
    return state, ControlChannel(control)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
