"""The two ceilings every benchmark prints beside its numbers, measured on the device in hand.

``measure_bandwidth()``: a large device-to-device copy, counting bytes read plus bytes written (bytes/s).
``measure_bf16_matmul()``: an 8192^3 bf16 matrix product on random data (FLOP/s); ``measure_fp8_matmul()``: the
same in FP8 e4m3 (``torch._scaled_mm``, unit scales, bf16 output). All take the median of
``triton.testing.do_bench`` (event-timed, L2 flushed between runs). Results are cached per process.
"""

from __future__ import annotations

import functools

import torch


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of fn() on the current CUDA device (events; L2 flushed before each run)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def capture_one_call(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph holding one call of fn (warmed up once on a side stream first), to time without launch cost."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@functools.cache
def measure_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Device-memory bandwidth in bytes/s: copy num_bytes (random data) and count read + write."""
    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3)


@functools.cache
def measure_bf16_matmul(n: int = 8192) -> float:
    """Dense bf16 matrix-product rate in FLOP/s on random n x n operands."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3)


@functools.cache
def measure_fp8_matmul(n: int = 8192) -> float:
    """FP8 e4m3 matrix-product rate in FLOP/s (torch._scaled_mm, unit scales, bf16 output) on random operands."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = bench_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n**3 / (ms * 1e-3)


def floor_ms(num_bytes: float = 0.0, flops: float = 0.0) -> float:
    """The roofline floor: the larger of bytes / bandwidth and FLOPs / bf16 matmul rate, in ms."""
    t_mem = num_bytes / measure_bandwidth() if num_bytes else 0.0
    t_math = flops / measure_bf16_matmul() if flops else 0.0
    return 1e3 * max(t_mem, t_math)


if __name__ == "__main__":
    print(f"copy bandwidth {measure_bandwidth() / 1e12:.2f} TB/s (read + write)")
    print(f"bf16 matmul    {measure_bf16_matmul() / 1e12:.0f} TFLOP/s (8192^3, random)")
