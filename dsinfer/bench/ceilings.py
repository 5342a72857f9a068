"""The device's ceilings that roofline floors divide by, measured on the device in hand.

``measure_bandwidth()``: a large device-to-device copy, counting bytes read plus bytes written (bytes/s).
``measure_bf16_matmul()``: an 8192^3 bf16 matrix product on random data (FLOP/s); ``measure_fp8_matmul()``: the
same in FP8 e4m3 (``torch._scaled_mm``, unit scales, bf16 output). All take the median of
``triton.testing.do_bench`` (event-timed, L2 flushed between runs), cached per process. On CPU,
``measure_ceilings`` times small stand-ins (a smoke test's figures, not a roofline)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Ceilings:
    device: str  # the device's name
    bandwidth: float  # copy bandwidth, bytes/s (read + write)
    matmul_rate: float  # dense bf16 (CPU: float32) matmul, FLOP/s
    fp8_matmul_rate: float | None = None  # FP8 e4m3 matmul, FLOP/s; None: no FP8 tensor cores (or CPU)

    def describe(self) -> str:
        fp8 = f", FP8 matmul {self.fp8_matmul_rate / 1e12:.0f} TFLOP/s" if self.fp8_matmul_rate else ""
        return (f"{self.device}: copy {self.bandwidth / 1e12:.2f} TB/s, matmul {self.matmul_rate / 1e12:.1f} "
                f"TFLOP/s{fp8} (measured now)")


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of fn() on the current CUDA device (events; L2 flushed before each run)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


@functools.cache
def measure_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Device-memory bandwidth in bytes/s: copy num_bytes (random data) and count read + write."""
    import torch

    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3)


@functools.cache
def measure_bf16_matmul(n: int = 8192) -> float:
    """Dense bf16 matrix-product rate in FLOP/s on random n x n operands."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3)


@functools.cache
def measure_fp8_matmul(n: int = 8192) -> float:
    """FP8 e4m3 matrix-product rate in FLOP/s (torch._scaled_mm, unit scales, bf16 output) on random operands."""
    import torch

    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = bench_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n**3 / (ms * 1e-3)


def measure_ceilings(device_type: str) -> Ceilings:
    """The ceilings of ``device_type`` ("cuda": the current GPU, measured before an engine takes its memory, and
    the measurement's buffers given back; else small CPU stand-ins)."""
    import torch

    if device_type == "cuda":
        try:
            fp8 = measure_fp8_matmul()
        except (RuntimeError, AttributeError):  # no FP8 tensor cores
            fp8 = None
        ceilings = Ceilings(torch.cuda.get_device_name(), measure_bandwidth(), measure_bf16_matmul(), fp8)
        torch.cuda.empty_cache()
        return ceilings
    src = torch.randn(16 << 20)
    dst = torch.empty_like(src)
    copy_s = min(_wall_s(lambda: dst.copy_(src)) for _ in range(5))
    a = torch.randn(512, 512)
    mm_s = min(_wall_s(lambda: a @ a) for _ in range(5))
    return Ceilings("CPU", 2 * src.numel() * 4 / copy_s, 2 * 512**3 / mm_s)


def _wall_s(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started
