"""Programmatic dependent launch (PDL) on a chain of small dependent kernels, replayed from a CUDA graph.

Measures what one kernel boundary costs with and without PDL (the next kernel launched while its predecessor
drains, waiting on ``griddepcontrol.wait`` before it reads): a chain of row RMSNorm kernels (each reads the
previous output), alone and interleaved with cuBLAS GEMVs, the way a batch-1 decode step alternates Triton ops
and dense projections. Prints microseconds per kernel and checks that the outputs are identical.

    python3 benchmarks/pdl_probe.py
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tuning import graph_bench  # noqa: E402


@triton.jit
def _norm_kernel(x_ptr, w_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n + offs, mask=offs < n, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / n + 1e-6) * w
    tl.store(out_ptr + row * n + offs, y.to(out_ptr.dtype.element_ty), mask=offs < n)


def chain(x, w, mats, bufs, pdl: bool, length: int):
    cur = x
    for i in range(length):
        out = bufs[i % 2]
        _norm_kernel[(x.shape[0],)](cur, w, out, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]), PDL=pdl,
                                    launch_pdl=pdl, num_warps=4)
        cur = out
        if mats is not None:
            out = bufs[2 + i % 2]
            torch.mm(cur, mats[i % len(mats)], out=out)
            cur = out
    return cur


def replay_us(fn) -> float:
    """Median microseconds of a CUDA-graph replay of one ``fn()`` (``benchmarks.tuning.graph_bench``)."""
    return graph_bench(fn) * 1e3


def main():
    torch.manual_seed(0)
    dev = "cuda"
    length = 200
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| chain | rows x hidden | no PDL us/step | PDL us/step | saved per boundary us | same output |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows, hidden, with_mm in ((1, 2048, False), (1, 4096, False), (64, 4096, False), (1, 2048, True),
                                  (1, 4096, True)):
        x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
        w = torch.rand(hidden, device=dev, dtype=torch.bfloat16) + 0.5
        mats = [torch.randn(hidden, hidden, device=dev, dtype=torch.bfloat16) / hidden ** 0.5 for _ in range(4)] \
            if with_mm else None
        bufs = [torch.empty_like(x) for _ in range(4)]
        results = {}
        for pdl in (False, True):
            us = replay_us(functools.partial(chain, x, w, mats, bufs, pdl, length))
            torch.cuda.synchronize()
            results[pdl] = (us, chain(x, w, mats, bufs, pdl, length).clone())
        kernels = length * (2 if with_mm else 1)
        same = torch.equal(results[False][1], results[True][1])
        saved = (results[False][0] - results[True][0]) / length
        name = "norm + GEMV" if with_mm else "norm"
        print(f"| {name} x {length} ({kernels} kernels) | {rows} x {hidden} | {results[False][0]:.1f} | "
              f"{results[True][0]:.1f} | {saved:.2f} | {same} |")


if __name__ == "__main__":
    main()
