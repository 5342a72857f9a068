"""Programmatic dependent launch (PDL, sm_90+): a kernel launched while the one before it on the stream still runs.

Without PDL a kernel's blocks start only after the previous kernel has finished and its writes are flushed, so
every kernel boundary of a decode step costs the launch, the block scheduling and the first loads' latency in
series (a V2-Lite batch-1 step has ~350 boundaries). With PDL (``launch_pdl`` on the launch, ``griddepcontrol``
in the kernels):

- each of our kernels, once running, signals that the next one may launch (``gdc_launch_dependents``);
- the next kernel's blocks start on the SMs left free, do what does not depend on the previous kernel (index
  arithmetic; the dense GEMM prefetches its first weight tiles into L2, ``moe._gemm_kernel``), then wait
  (``gdc_wait``) until the previous kernel has completed and its memory is visible, before any dependent load
  and before any store.

``enter(PDL)`` waits then signals, in that order (``WAIT_FIRST``): a kernel lets its successor launch only once
its own predecessor has finished, so at most one kernel waits ahead of the running one. Where
``DSINFER_PDL_EARLY_TRIGGER`` says so it signals first (``TRIGGER_FIRST``): the kernel after a small one then launches
while the kernel before the small one still runs, and a GEMV's weight prefetch overlaps that kernel's tail. Still
exact: ``griddepcontrol.wait`` waits for the predecessor's completion, not its signal, and a predecessor completes
only after its own wait, so every earlier kernel has completed too. Nor can it deadlock: a kernel launches only
once every block of its predecessor has started (signalled or exited), so the blocks it waits on are resident.

The wait is what makes this exact: every kernel launched with ``launch_pdl`` calls ``enter`` before its first
load of anything another kernel writes and before its first store. What no kernel of a forward writes may be read
before it, taking those loads off the critical path: weights, and the step's metadata (positions, slot mapping,
query_start_loc, seq_lens, block tables) and the rope cos/sin table, which torch ops write before the forward's
first kernel (a torch kernel lets its successor launch only when it has completed, so such writes are done
before any kernel after it launches); ``tests/ops/test_pdl.py`` checks each kernel's source for this. A kernel
launched without PDL (cuBLAS, torch) keeps the full stream order, and ``gdc_wait`` there returns at once. CUDA
graph capture keeps these edges (programmatic graph edges).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsinfer import envs
from dsinfer.ops import options

WAIT_FIRST, TRIGGER_FIRST = 1, 2  # values of a kernel's PDL constexpr when launched with PDL


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the previous kernel on the stream (its writes visible) and let the next one launch, in the order
    the PDL constexpr names; nothing when the kernel is not launched with PDL (a constexpr: the CPU interpreter
    never meets the instructions)."""
    if PDL == 2:  # TRIGGER_FIRST
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on device launch with PDL: CUDA sm_90+ and the ``pdl`` kernel option (``DSINFER_PDL``) on."""
    if device.type != "cuda" or not options.current().pdl:
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


# Kernel roles, as DSINFER_PDL_EARLY_TRIGGER names them (envs.PDL_ROLES): the MoE routing and expert kernels, the
# MLA / GQA decode's split combine, RMSNorm, rotary and cache-store kernels, split-K sums, and every other kernel.
MOE, MLA_COMBINE, NORM, ROPE, GQA_COMBINE, SPLIT_SUM, OTHER = envs.PDL_ROLES


@functools.cache
def _early_roles(policy: str) -> frozenset[str]:
    if policy == "off":
        return frozenset()
    if policy in ("all", "dense"):
        return frozenset(envs.PDL_ROLES) - ({MOE} if policy == "dense" else set())
    return frozenset(policy.split(","))


def launch_args(device: torch.device, role: str = OTHER) -> dict:
    """The launch keywords of a kernel with a ``PDL`` constexpr that calls ``enter``: ``PDL`` (the order of its
    wait and signal: ``TRIGGER_FIRST`` where ``DSINFER_PDL_EARLY_TRIGGER`` names the kernel's ``role``, else
    ``WAIT_FIRST``) and Triton's ``launch_pdl`` when ``enabled``, else nothing (the kernel's default
    ``PDL=False``)."""
    if not enabled(device):
        return {}
    early = role in _early_roles(options.current().pdl_early_trigger)
    return {"PDL": TRIGGER_FIRST if early else WAIT_FIRST, "launch_pdl": True}
