"""Batch-1 decode chain probe: cuBLAS GEMVs against Triton GEMVs that load their first weight tiles before
waiting on the previous kernel (programmatic dependent launch), on a synthetic Llama-3.1-8B layer stack.

Per layer: norm -> qkv GEMV -> 3 small kernels (rotary/store, attention, reduce stand-ins) -> o_proj GEMV ->
norm -> gate/up GEMV -> SiLU*mul -> down GEMV, 32 layers, distinct weights, replayed from one CUDA graph. The
chain runs all-cuBLAS, all-Triton (with and without PDL) and mixed: Triton only for the shapes where it beat
cuBLAS alone (session 9: o_proj 10.91 against 13.12 us), cuBLAS for the rest.

    python3 benchmarks/gemv_probe.py
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pdl_probe import _norm_kernel, replay_us  # noqa: E402
from benchmarks.roofline import measure_bandwidth  # noqa: E402


@triton.jit
def _silu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + n + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (g / (1 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr,
                 PDL: tl.constexpr):
    """out[:M] = x[:M] @ w^T; the first PRE weight tiles are loaded before waiting on x's producer."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    w_ptrs = w_ptr + rows[None, :] * stride_wn + offs_k[:, None]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    m_mask = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if PRE >= 1:
        w0 = tl.load(w_ptrs)
    if PRE >= 2:
        w1 = tl.load(w_ptrs + BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PRE >= 1:
        acc = tl.dot(tl.load(x_ptrs, mask=m_mask, other=0.0), w0, acc)
    if PRE >= 2:
        acc = tl.dot(tl.load(x_ptrs + BLOCK_K, mask=m_mask, other=0.0), w1, acc)
    for k0 in range(PRE * BLOCK_K, K, BLOCK_K):
        a = tl.load(x_ptrs + k0, mask=m_mask, other=0.0)
        b = tl.load(w_ptrs + k0)
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask & (offs_n[None, :] < N))


def gemv(x, w, out, cfg, pdl):
    bn, bk, warps, stages, pre = cfg
    _gemv_kernel[(triton.cdiv(w.shape[0], bn),)](
        x, w, out, x.shape[0], w.shape[0], w.shape[1], x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, PRE=pre, PDL=pdl, launch_pdl=pdl, num_warps=warps, num_stages=stages)
    return out


def norm(x, w, out, pdl):
    _norm_kernel[(1,)](x, w, out, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]), PDL=pdl, launch_pdl=pdl,
                       num_warps=8)
    return out


def silu(x, out, pdl):
    n = out.shape[1]
    _silu_kernel[(triton.cdiv(n, 2048),)](x, out, n, BLOCK=2048, PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out


def layer_chain(layers, bufs, mode, cfgs, pdl_small):
    x = bufs["x"]
    for lw in layers:
        h = norm(x, lw["n1"], bufs["h"], pdl_small)
        qkv = mm(h, lw["qkv"], bufs["qkv"], mode, cfgs, "qkv")
        t = norm(qkv, lw["n1"], bufs["t1"], pdl_small)  # rotary/store stand-in
        t = norm(t, lw["n1"], bufs["t2"], pdl_small)  # attention stand-in
        t = norm(t, lw["n1"], bufs["t3"], pdl_small)  # reduce stand-in
        o = mm(t, lw["o"], bufs["o"], mode, cfgs, "o")
        h2 = norm(o, lw["n2"], bufs["h2"], pdl_small)
        gu = mm(h2, lw["gu"], bufs["gu"], mode, cfgs, "gu")
        a = silu(gu, bufs["act"], pdl_small)
        x = mm(a, lw["down"], bufs["x"], mode, cfgs, "down")
    return x


def mm(x, w, out, mode, cfgs, name):
    """mode: "cublas"; "triton" / "triton-nopdl" (every GEMV); "mixed" (Triton, no PDL, only for the shapes in
    ``cfgs``, cuBLAS for the others)."""
    if mode == "cublas" or (mode == "mixed" and name not in cfgs):
        return torch.mm(x, w.t(), out=out)
    return gemv(x, w, out, cfgs[name], pdl=mode not in ("triton-nopdl", "mixed"))


def main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    hidden, inter, q_out, num_layers = 4096, 14336, 6144, 32
    bw = measure_bandwidth() / 1e9  # GB/s
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {bw / 1e3:.2f} TB/s")
    shapes = {"qkv": (q_out, hidden), "o": (hidden, hidden), "gu": (2 * inter, hidden), "down": (hidden, inter)}
    layers = [dict(n1=torch.rand(hidden, device=dev, dtype=dt) + 0.5, n2=torch.rand(hidden, device=dev, dtype=dt) + 0.5,
                   **{k: torch.randn(*s, device=dev, dtype=dt) / s[1] ** 0.5 for k, s in shapes.items()})
              for _ in range(num_layers)]
    bufs = dict(x=torch.randn(1, hidden, device=dev, dtype=dt), h=torch.empty(1, hidden, device=dev, dtype=dt),
                qkv=torch.empty(1, q_out, device=dev, dtype=dt), o=torch.empty(1, hidden, device=dev, dtype=dt),
                h2=torch.empty(1, hidden, device=dev, dtype=dt), gu=torch.empty(1, 2 * inter, device=dev, dtype=dt),
                act=torch.empty(1, inter, device=dev, dtype=dt))
    for k in ("t1", "t2", "t3"):
        bufs[k] = torch.empty(1, hidden, device=dev, dtype=dt)
    bufs["t1"] = torch.empty(1, q_out, device=dev, dtype=dt)

    # 1. per shape: cuBLAS against Triton tiles, 32 distinct weights back to back (graph), PDL on
    print("| GEMV | N x K | cuBLAS us | best Triton us (tile) | floor us |")
    print("| --- | --- | --- | --- | --- |")
    best_cfgs, wins = {}, {}
    for name, (n, k) in shapes.items():
        x = torch.randn(1, k, device=dev, dtype=dt)
        out = torch.empty(1, n, device=dev, dtype=dt)
        ws = [lw[name] for lw in layers]
        cub = replay_us(lambda ws=ws, x=x, out=out: [torch.mm(x, w.t(), out=out) for w in ws]) / len(ws)
        results = []
        for bn, bk, warps, stages, pre in itertools.product((16, 32, 64), (128, 256), (4, 8), (4,), (0, 1)):
            if bn * bk * 2 * stages > 200_000 or (n // bn) < 64:
                continue
            cfg = (bn, bk, warps, stages, pre)
            try:
                us = replay_us(functools.partial(lambda ws, x, out, cfg: [gemv(x, w, out, cfg, True) for w in ws],
                                                 ws, x, out, cfg)) / len(ws)
            except Exception as exc:  # a tile that does not compile or fit
                print(f"  {name} {cfg}: {type(exc).__name__}")
                continue
            results.append((us, cfg))
        ref = x.float() @ ws[-1].float().t()
        results.sort()
        us, cfg = results[0]
        gemv(x, ws[-1], out, cfg, True)
        torch.cuda.synchronize()
        err = (out.float() - ref).abs().max().item()
        best_cfgs[name] = cfg
        if us < cub:
            wins[name] = cfg
        floor = n * k * 2 / bw / 1e3  # bytes / (GB/s) -> us
        print(f"| {name} | {n} x {k} | {cub:.2f} | {us:.2f} {cfg} (err {err:.3g}; pre=0 best "
              f"{min((u for u, c in results if c[4] == 0), default=float('nan')):.2f}) | {floor:.2f} |")

    # 2. the whole stack
    weight_bytes = sum(w.numel() * 2 for lw in layers for w in lw.values())
    floor_ms = weight_bytes / bw / 1e6
    print(f"\n32-layer batch-1 chain, {weight_bytes / 1e9:.2f} GB of weights, floor {floor_ms:.3f} ms")
    print("| mode | ms | of floor | output against cuBLAS without PDL |")
    print("| --- | --- | --- | --- |")
    start = bufs["x"].clone()
    outs = {}
    modes = (("cublas", False), ("cublas", True), ("triton-nopdl", False), ("triton", True), ("mixed", False))
    print(f"mixed: Triton for {sorted(wins) or 'no shape'} (faster than cuBLAS above), cuBLAS for the rest")
    for mode, pdl_small in modes:
        fn = functools.partial(layer_chain, layers, bufs, mode, wins if mode == "mixed" else best_cfgs, pdl_small)
        ms = replay_us(fn) / 1e3
        bufs["x"].copy_(start)  # every mode's output from the same input
        outs[(mode, pdl_small)] = fn().clone()
        torch.cuda.synchronize()
        bufs["x"].copy_(start)
        diff = (outs[(mode, pdl_small)].float() - outs[("cublas", False)].float()).abs().max().item()
        print(f"| {mode}, small kernels PDL {pdl_small} | {ms:.3f} | {ms / floor_ms:.2f}x | max diff {diff:.3g} |")

if __name__ == "__main__":
    main()
