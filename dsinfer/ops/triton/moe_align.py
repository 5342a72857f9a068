"""Expert alignment for the fused MoE on the GPU: ``moe_align`` and its torch reference ``moe_align_ref``.

The T * top_k (token, expert) pairs, sorted by expert, each expert's run padded to a multiple of ``BLOCK_M``
(padding entries hold the sentinel ``T * top_k``), with the expert of every block of rows: the layout the
grouped GEMM of ``ops.triton.moe`` walks. One Triton launch at decode sizes (a program per expert; two launches
past 4096 pairs), sized from shapes (a capacity of ``pairs + min(pairs, E) * (BLOCK_M - 1)`` rows), so no host
sync and CUDA-graph safe; blocks past the real total exit at once. For one token, ``pair_blocks`` gives a
layout the grouped GEMM reads the same way without any launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops.triton.pdl import MOE, enter, launch_args


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """``moe_align`` in torch ops (the reference): some 25 small CUDA kernels (scatter_add, cumsums, a stable radix
    argsort, searchsorted, index_put, ...), no host sync."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_e = flat[order]
    first = counts.cumsum(0) - counts
    dest = (ends - padded)[sorted_e] + torch.arange(num_pairs, device=device) - first[sorted_e]
    capacity = align_capacity(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.int()
    block_start = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_start, right=True).clamp_max_(num_experts - 1).int()
    return sorted_ids, expert_ids, ends[-1:].int()


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of ``moe_align``'s output: every pair plus at most ``block_m - 1`` padding per active expert."""
    return triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m) * block_m


@triton.jit
def _align_count(ids_ptr, lo, hi, E_PAD: tl.constexpr, HCHUNK: tl.constexpr):
    """[E_PAD] int32: how many of the pairs lo..hi-1 go to each expert."""
    counts = tl.zeros([E_PAD], tl.int32)
    for start in range(lo, hi, HCHUNK):
        offs = start + tl.arange(0, HCHUNK)
        valid = offs < hi
        e = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
        counts += tl.histogram(e, E_PAD, mask=valid)
    return counts


@triton.jit
def _align_place(ids_ptr, sorted_ids_ptr, lo, hi, base, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """sorted_ids[base[e] + r] = p for each pair p in lo..hi-1, e its expert and r its rank among the pairs of e
    in lo..p-1 (pair order kept: a stable sort). The rank is an inclusive scan of a one-hot [CHUNK, E_PAD] tile;
    ``base`` runs on by each chunk's histogram."""
    experts = tl.arange(0, E_PAD)
    for start in range(lo, hi, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        valid = offs < hi
        e = tl.load(ids_ptr + offs, mask=valid, other=E_PAD).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        dest = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + base[None, :]), axis=1)
        tl.store(sorted_ids_ptr + dest, offs, mask=valid)
        base += tl.sum(onehot, axis=0)


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, num_pairs, span, E_PAD: tl.constexpr, HCHUNK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """counts[s, e]: the pairs of span s (pairs s * span ...) that go to expert e."""
    enter(PDL)
    pid = tl.program_id(0)
    lo = pid * span
    counts = _align_count(ids_ptr, lo, tl.minimum(lo + span, num_pairs), E_PAD, HCHUNK)
    tl.store(counts_ptr + pid * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit
def _moe_align_kernel(
    ids_ptr, counts_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, num_experts, capacity, span, num_spans,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, SPANS_BLOCK: tl.constexpr, NB: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program s places the pairs of span s (the per-span counts come from ``_moe_count_kernel``) and its share of
    the tail and of ``expert_ids``; program 0 also writes each expert's padding and ``num_padded``."""
    enter(PDL)
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    totals = tl.zeros([E_PAD], tl.int32)
    before = tl.zeros([E_PAD], tl.int32)  # pairs of each expert in the spans before this one
    for s0 in range(0, num_spans, SPANS_BLOCK):
        spans = s0 + tl.arange(0, SPANS_BLOCK)
        tab = tl.load(counts_ptr + spans[:, None] * E_PAD + experts[None, :], mask=spans[:, None] < num_spans,
                      other=0)
        totals += tl.sum(tab, axis=0)
        before += tl.sum(tl.where(spans[:, None] < pid, tab, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    lo = pid * span
    _align_place(ids_ptr, sorted_ids_ptr, lo, tl.minimum(lo + span, num_pairs), starts + before, E_PAD, CHUNK)
    total = tl.sum(padded)
    if pid == 0:
        tl.store(num_padded_ptr, total)
        j = tl.arange(0, BLOCK_M)
        slot = (starts + totals)[:, None] + j[None, :]
        sentinel = tl.full([E_PAD, BLOCK_M], num_pairs, tl.int32)
        tl.store(sorted_ids_ptr + slot, sentinel, mask=j[None, :] < (padded - totals)[:, None])
    # the tail past the padded total, and the expert of every block: shared out over the programs
    nprog = tl.num_programs(0)
    for t0 in range(total + pid * 1024, capacity, nprog * 1024):
        offs = t0 + tl.arange(0, 1024)
        tl.store(sorted_ids_ptr + offs, tl.full([1024], num_pairs, tl.int32), mask=offs < capacity)
    num_blocks = capacity // BLOCK_M
    for b0 in range(pid * NB, num_blocks, nprog * NB):
        blocks = b0 + tl.arange(0, NB)
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.minimum(expert, num_experts - 1), mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["num_pairs", "capacity"])  # one compile per tile, whatever the batch
def _moe_align_by_expert_kernel(
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, num_experts, capacity,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, P_PAD: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr = False,
):
    """Decode sizes (all pairs in one tile): program e < E places expert e's pairs (its rank = a scan of
    ``ids == e`` over the pairs), its padding and the expert id of its blocks; program E writes ``num_padded``,
    the tail past it and the expert of the tail's blocks. Every program counts all pairs (one histogram), so no
    program waits on another: one launch of short, parallel programs."""
    enter(PDL)
    e = tl.program_id(0)
    offs = tl.arange(0, P_PAD)
    valid = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    counts = tl.histogram(ids, E_PAD, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    experts = tl.arange(0, E_PAD)
    if e < num_experts:
        mine = (ids == e) & valid
        count = tl.sum(mine.to(tl.int32))
        if count > 0:
            start = tl.sum(tl.where(experts == e, ends - padded, 0))
            run = tl.sum(tl.where(experts == e, padded, 0))
            rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
            tl.store(sorted_ids_ptr + start + rank, offs, mask=mine)
            j = tl.arange(0, BLOCK_M)
            tl.store(sorted_ids_ptr + start + count + j, tl.full([BLOCK_M], num_pairs, tl.int32),
                     mask=j < run - count)
            for b0 in range(start // BLOCK_M, (start + run) // BLOCK_M, NB):
                blocks = b0 + tl.arange(0, NB)
                tl.store(expert_ids_ptr + blocks, tl.full([NB], 0, tl.int32) + e,
                         mask=blocks < (start + run) // BLOCK_M)
    else:
        total = tl.sum(padded)
        tl.store(num_padded_ptr, total)
        for t0 in range(total, capacity, 1024):
            offs_t = t0 + tl.arange(0, 1024)
            tl.store(sorted_ids_ptr + offs_t, tl.full([1024], num_pairs, tl.int32), mask=offs_t < capacity)
        for b0 in range(total // BLOCK_M, capacity // BLOCK_M, NB):
            blocks = b0 + tl.arange(0, NB)
            tl.store(expert_ids_ptr + blocks, tl.full([NB], 0, tl.int32) + (num_experts - 1),
                     mask=blocks < capacity // BLOCK_M)


# Up to here every program of the by-expert kernel holds all pairs in one tile. The tile is 1024 or 4096 wide,
# not the next power of two of the pair count: mixed prefill steps bring ever new pair counts, and each new
# width would be a JIT compile (seconds) inside a running workload.
_ALIGN_BY_EXPERT_PAIRS = 4096


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """-> (sorted_ids [cap] int32, expert_ids [cap // block_m] int32, num_padded [1] int32); no host sync.

    sorted_ids: the pair indices (token * top_k + slot) sorted by expert, stably (by pair index within an
    expert), each expert's run padded to a multiple of ``block_m`` with the sentinel ``num_pairs`` (as is
    everything past ``num_padded``); expert_ids: the expert of each block of ``block_m`` rows (the last expert
    past ``num_padded``). Triton: one launch of a program per expert up to 4096 pairs (decode), else two
    (per-span counts, then placement by span programs). Same outputs as ``moe_align_ref``."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    capacity = align_capacity(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = max(32, triton.next_power_of_2(num_experts))  # tl.histogram: at least a bin per lane of a warp
    if num_pairs <= _ALIGN_BY_EXPERT_PAIRS:
        _moe_align_by_expert_kernel[(num_experts + 1,)](
            flat, sorted_ids, expert_ids, num_padded, num_pairs, num_experts, capacity, BLOCK_M=block_m,
            E_PAD=e_pad, P_PAD=1024 if num_pairs <= 1024 else _ALIGN_BY_EXPERT_PAIRS, NB=128,
            num_warps=4 if num_pairs <= 1024 else 8, **launch_args(flat.device, MOE),
        )
        return sorted_ids, expert_ids, num_padded
    chunk = max(16, 16384 // e_pad)  # one-hot tile [chunk, e_pad] of the placement scan
    num_spans = min(triton.cdiv(num_pairs, chunk), 64)
    span = triton.cdiv(triton.cdiv(num_pairs, num_spans), chunk) * chunk
    num_spans = triton.cdiv(num_pairs, span)
    counts = torch.empty(num_spans, e_pad, dtype=torch.int32, device=device)
    _moe_count_kernel[(num_spans,)](flat, counts, num_pairs, span, E_PAD=e_pad, HCHUNK=1024, num_warps=4,
                                    **launch_args(flat.device, MOE))
    _moe_align_kernel[(num_spans,)](flat, counts, sorted_ids, expert_ids, num_padded, num_pairs, num_experts,
                                    capacity, span, num_spans, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk,
                                    SPANS_BLOCK=max(1, 4096 // e_pad), NB=max(32, 8192 // e_pad),
                                    num_warps=8 if e_pad >= 128 else 4, **launch_args(flat.device, MOE))
    return sorted_ids, expert_ids, num_padded


_PAIR_BLOCKS: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def pair_blocks(topk_ids: torch.Tensor, block_m: int):
    """``moe_align``'s contract with one block per (token, expert) pair, in pair order: block j holds pair j and
    ``block_m - 1`` sentinels, its expert is ``topk_ids.flat[j]`` (int64: the ids themselves, a view). The
    grouped GEMM needs blocks of one expert each, in any order, so this layout is exact for any ids; it reads an
    expert's weights once per pair, so it is used for one token, whose k experts a router picks distinct: then
    it reads what ``moe_align``'s layout reads, with no launch (the sorted ids and the padded count are
    constants). Returns None while a CUDA graph is captured and the constants are not made yet (the warm-up
    forward before each capture makes them, outside it)."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    key = (num_pairs, block_m, flat.device)
    if key not in _PAIR_BLOCKS:
        if flat.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        sorted_ids = torch.full((num_pairs, block_m), num_pairs, dtype=torch.int32, device=flat.device)
        sorted_ids[:, 0] = torch.arange(num_pairs, dtype=torch.int32, device=flat.device)
        num_padded = torch.full((1,), num_pairs * block_m, dtype=torch.int32, device=flat.device)
        _PAIR_BLOCKS[key] = sorted_ids.view(-1), num_padded
    sorted_ids, num_padded = _PAIR_BLOCKS[key]
    return sorted_ids, flat, num_padded
