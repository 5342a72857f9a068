"""The two ceilings every benchmark prints beside its numbers, measured on the device in hand (the measurements
live in ``dsinfer/bench/ceilings.py``, which ``dsinfer bench`` uses too), and the kernel benchmarks' helpers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsinfer.bench.ceilings import (  # noqa: E402, F401  (re-exported to the kernel benchmarks)
    bench_ms,
    measure_bandwidth,
    measure_bf16_matmul,
    measure_fp8_matmul,
)


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


def floor_ms(num_bytes: float = 0.0, flops: float = 0.0) -> float:
    """The roofline floor: the larger of bytes / bandwidth and FLOPs / bf16 matmul rate, in ms."""
    t_mem = num_bytes / measure_bandwidth() if num_bytes else 0.0
    t_math = flops / measure_bf16_matmul() if flops else 0.0
    return 1e3 * max(t_mem, t_math)


if __name__ == "__main__":
    print(f"copy bandwidth {measure_bandwidth() / 1e12:.2f} TB/s (read + write)")
    print(f"bf16 matmul    {measure_bf16_matmul() / 1e12:.0f} TFLOP/s (8192^3, random)")
