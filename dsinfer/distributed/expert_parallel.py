"""Expert parallelism: a MoE layer's experts partitioned across EP ranks, and the two ways tokens meet them.

Which exchange depends on where the tokens are (vLLM's sizes: EP = tensor_parallel_size x data_parallel_size):
- **every rank holds every token** (data_parallel_size 1: attention is tensor-parallel, so its all-reduce has
  already given each rank the whole batch): ``ep_moe_replicated``. This is the all-gather + reduce-scatter
  scheme with its all-gather already done by attention and its reduce-scatter widened to the all-reduce the
  block does anyway (the next attention needs every token on every rank): each rank runs only the (token,
  expert) pairs of its own experts and the one all-reduce sums them with the shared experts' tensor-parallel
  parts. No extra collective over tensor parallelism, nothing read by the host but the pairs' count, and each
  pair computed once. An all-to-all here would move tokens every rank already has.
- **each rank its own tokens** (DP attention, data_parallel_size > 1): ``ep_moe``, below: pairs travel to the
  rank of their expert with ``all_to_all_single`` and come back; the traffic is the pairs, not the batch.

Each rank holds ``slots_per_rank`` physical experts (rank r: global slots [r S, (r + 1) S), rank-major, as the
EPLB planner numbers them; with redundant experts a logical expert may have replicas on several ranks, and its
``ExpertMap`` picks one by token index) and runs the router on its own tokens (attention data-parallel: each
rank its own requests). ``ep_moe`` then:

1. sorts the rank's (token, expert) pairs by the rank owning each pair's slot and exchanges the per-rank pair
   counts (``all_to_all_single`` of one integer per rank; the one host read: the split sizes);
2. dispatches each pair's hidden row, local slot id and routing weight to the owning rank (three asynchronous
   ``all_to_all_single``); the shared experts run on the rank's own tokens while they are in flight;
3. the owning rank runs its experts over the pairs it received (``ops.fused_moe``, one expert per row, the
   routing weight applied);
4. combines: the weighted rows go back the way they came (``all_to_all_single`` with the splits swapped) and are
   summed into their tokens (``index_add_``), plus the shared experts' output.

A rank with no tokens still takes part in every exchange (with empty splits), so the collectives stay matched.
The process group is an argument (``EPGroup``): whoever starts the ranks (the distributed executor) builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsinfer.ops.moe import fused_moe


@dataclass(frozen=True)
class EPGroup:
    """The expert-parallel ranks of one MoE layer stack: this rank's index, their number, their process group
    (None: the default group)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"EP rank {self.rank} is not in [0, {self.size})")


def local_slots(num_physical: int, ep: EPGroup) -> range:
    """The global physical slots rank ``ep.rank`` holds; ValueError when they do not divide over the ranks."""
    if num_physical % ep.size:
        raise ValueError(f"{num_physical} physical experts do not divide over {ep.size} EP ranks: set "
                         "num_redundant_experts so that experts + redundant is a multiple of the EP size")
    per_rank = num_physical // ep.size
    return range(ep.rank * per_rank, (ep.rank + 1) * per_rank)


def ep_moe(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_slots: torch.Tensor, w13: torch.Tensor,
           w2: torch.Tensor, ep: EPGroup, shared: Callable[[torch.Tensor], torch.Tensor] | None = None
           ) -> torch.Tensor:
    """hidden [T, H] (this rank's tokens), topk_weights / topk_slots [T, k] (global physical slots), w13
    [S, 2I, H] / w2 [S, H, I] (this rank's S slots) -> [T, H]: the routed experts' weighted sum, wherever they
    live, plus ``shared(hidden)`` (computed while the tokens are in flight). See the module doc."""
    num_tokens, top_k = topk_slots.shape
    per_rank = w13.shape[0]
    flat = topk_slots.reshape(-1)
    owner = torch.div(flat, per_rank, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    token_of = torch.div(order, top_k, rounding_mode="floor")
    send_counts = torch.bincount(owner, minlength=ep.size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=ep.group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    num_recv = sum(recv_splits)

    rows = hidden.new_empty(num_recv, hidden.shape[1])
    slots = flat.new_empty(num_recv)
    weights = topk_weights.new_empty(num_recv)
    pending = [
        dist.all_to_all_single(rows, hidden[token_of].contiguous(), recv_splits, send_splits, group=ep.group,
                               async_op=True),
        dist.all_to_all_single(slots, flat[order] % per_rank, recv_splits, send_splits,
                               group=ep.group, async_op=True),
        dist.all_to_all_single(weights, topk_weights.reshape(-1)[order].contiguous(), recv_splits, send_splits,
                               group=ep.group, async_op=True),
    ]
    shared_out = shared(hidden) if shared is not None else None  # while the pairs are in flight
    for work in pending:
        work.wait()

    computed = fused_moe(rows, w13, w2, weights.unsqueeze(1), slots.unsqueeze(1)) if num_recv else rows
    back = hidden.new_empty(num_tokens * top_k, hidden.shape[1])
    dist.all_to_all_single(back, computed, send_splits, recv_splits, group=ep.group)
    out = torch.zeros_like(hidden).index_add_(0, token_of, back)
    return out if shared_out is None else out + shared_out


def ep_moe_replicated(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_slots: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, first_slot: int, static: bool = False) -> torch.Tensor:
    """hidden [T, H] (every token, the same on every EP rank), topk_weights / topk_slots [T, k] (global storage
    slots), w13 [S, 2I, H] / w2 [S, H, I] (this rank's S slots, global ``first_slot`` onwards) -> [T, H]: the
    weighted sum of the pairs whose slot this rank holds (zero rows for tokens with none); the caller
    all-reduces it over the EP group. One host read: the number of this rank's pairs; ``static`` (CUDA-graph
    capture) reads nothing: every pair runs, the other ranks' with weight 0 on this rank's first slot (decode-
    sized batches: the extra rows cost little next to the experts' weight reads)."""
    top_k, per_rank = topk_slots.shape[1], w13.shape[0]
    local = topk_slots - first_slot
    mine = (local >= 0) & (local < per_rank)
    if static:
        return fused_moe(hidden, w13, w2, torch.where(mine, topk_weights, 0.0), torch.where(mine, local, 0))
    pairs = mine.reshape(-1).nonzero().squeeze(1)
    out = torch.zeros_like(hidden)
    if pairs.numel() == 0:
        return out
    token_of = torch.div(pairs, top_k, rounding_mode="floor")
    rows = fused_moe(hidden[token_of], w13, w2, topk_weights.reshape(-1)[pairs].unsqueeze(1),
                     local.reshape(-1)[pairs].unsqueeze(1))
    return out.index_add_(0, token_of, rows)
