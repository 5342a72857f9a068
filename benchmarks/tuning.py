"""What the kernel tuners share (``tune_deepseek.py``, ``tune_mla.py``): the device, timing, the ceilings of the
run, error checks, time budgets and the sweep loop, and the log and table every measurement goes to.

``DEV`` and ``SMOKE`` are set once by the tuner's ``main`` (``--smoke``: tiny shapes on any device, CPU included)
before anything is measured.
"""

from __future__ import annotations

import functools
import time

import torch

DEV = "cuda"
SMOKE = False
LOG: list[dict] = []  # every measurement, written to tune_results.json
TABLE: list[str] = []  # one markdown row per tuned shape


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


def bench(fn, rep_ms: int = 20) -> float:
    """Median ms of fn() (triton do_bench: events, L2 flushed before each run)."""
    from triton.testing import do_bench

    if SMOKE:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return float(do_bench(fn, warmup=5, rep=rep_ms, return_mode="median"))


def graph_bench(fn, rep_ms: int = 20) -> float:
    """Median ms of a CUDA-graph replay of one fn() call (no launch overhead)."""
    if SMOKE:
        return bench(fn)
    from benchmarks.roofline import capture_one_call

    return bench(capture_one_call(fn).replay, rep_ms)


@functools.cache
def ceilings() -> dict:
    if SMOKE:
        return dict(copy=1e11, bf16=1e12, fp8=2e12)
    n = 8192
    src = torch.randn(1 << 28, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 4 / (bench(lambda: dst.copy_(src), 100) * 1e-3)
    src = dst = None
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    bf16 = 2 * n**3 / (bench(lambda: a @ b, 100) * 1e-3)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=DEV)
    fp8 = 2 * n**3 / (bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                        out_dtype=torch.bfloat16), 100) * 1e-3)
    return dict(copy=copy_bw, bf16=bf16, fp8=fp8)


def rate_note(ms: float, num_bytes: float, flops: float, fp8: bool) -> str:
    c = ceilings()
    peak = c["fp8"] if fp8 else c["bf16"]
    t_floor = max(num_bytes / c["copy"], flops / peak) * 1e3
    gbs, tfs = num_bytes / ms / 1e6, flops / ms / 1e9
    return (f"{gbs:,.0f} GB/s ({gbs * 1e9 / c['copy']:.0%} BW), {tfs:,.0f} TFLOP/s ({tfs * 1e12 / peak:.0%} "
            f"{'fp8' if fp8 else 'bf16'}), floor {t_floor:.4f} ms ({t_floor / ms:.0%})")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def sweep(label: str, candidates: list[dict], run, check, budget: Budget, timer=bench) -> list[tuple[float, dict]]:
    """[(ms, cfg)] for each candidate that compiles and passes ``check`` (the first is always tried)."""
    results = []
    for i, cfg in enumerate(candidates):
        if i and budget.left() <= 0:
            print(f"  {label}: budget spent, skipped {len(candidates) - i} candidates", flush=True)
            break
        t0 = time.monotonic()
        try:
            run(cfg)
            sync()
            err = check()
            if not err < 2e-2:
                print(f"  {label} {cfg}: WRONG (rel err {err:.3g})", flush=True)
                LOG.append(dict(label=label, cfg=cfg, error=f"rel err {err}"))
                continue
            ms = timer(functools.partial(run, cfg))
        except Exception as exc:  # noqa: BLE001 (a config that does not compile or does not fit)
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            print(f"  {label} {cfg}: failed {msg}", flush=True)
            LOG.append(dict(label=label, cfg=cfg, error=msg))
            continue
        results.append((ms, cfg))
        LOG.append(dict(label=label, cfg=cfg, ms=ms, err=err))
        print(f"  {label} {cfg}: {ms:.4f} ms (err {err:.1e}, {time.monotonic() - t0:.1f} s)", flush=True)
    return results
