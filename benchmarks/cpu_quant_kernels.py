"""The CPU linear kernels at a model's shapes, weights cold in cache: one token's (or batch's) matmuls.

    python benchmarks/cpu_quant_kernels.py [--threads 2] [--rows 1 32 512] [--layers 30]

Allocates ``--layers`` distinct copies of SmolLM2-135M's linears (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536) and its 49152x576 LM head, so the weights stream from memory as in a real decode step, and times
all of them for each kernel: dense float32 and bfloat16 (``F.linear``), torch's weight-only kernels
(``_weight_int8pack_mm`` per channel, ``_weight_int4pack_mm_for_cpu`` group 32, bfloat16 activations), and
dsinfer's block-32 kernels (``ops.cpu_quant``: int4 as Q4_1, int8 as Q8_0, int8 activations). The LM head runs
at most 32 rows (a prefill samples from its last rows only). Prints ms per call of the whole stack (best of
``--repeat``) and the weight bytes it read.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsinfer.ops import cpu_quant  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)


def _dense(dtype):
    def make(w):
        return w.to(dtype)

    def run(x, w):
        return F.linear(x.to(dtype), w)

    return make, run, lambda w: w.numel() * w.element_size()


def _torch_int8():
    def make(w):
        scale = w.abs().amax(1) / 127
        return torch.round(w / scale[:, None]).to(torch.int8), scale.bfloat16()

    def run(x, w):
        return torch._weight_int8pack_mm(x.bfloat16(), w[0], w[1])

    return make, run, lambda w: w[0].numel() + 2 * w[1].numel()


def _torch_int4(group: int = 32):
    def make(w):
        blocks = w.reshape(w.shape[0], -1, group)
        low, high = blocks.amin(-1), blocks.amax(-1)
        scale = (high - low).clamp(min=1e-6) / 15
        q = torch.round((blocks - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(w.shape), 1)
        zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
        return packed, torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()

    def run(x, w):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), w[0], group, w[1])

    return make, run, lambda w: w[0].numel() + 2 * w[1].numel()


def _ours(fmt: str):
    def make(w):
        return cpu_quant.quantize(w, fmt)

    def run(x, w):
        return cpu_quant.quant_linear(x, w)

    def nbytes(w):
        return sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.mins) if t is not None)

    return make, run, nbytes


def kernels() -> dict:
    found = {"fp32": _dense(torch.float32), "bf16": _dense(torch.bfloat16), "torch_int8": _torch_int8(),
             "torch_int4_g32": _torch_int4()}
    if cpu_quant.native_available():
        found["dsinfer_int4"], found["dsinfer_int8"] = _ours("int4"), _ours("int8")
    return found


def time_stack(run, weights, head, rows: int, repeat: int) -> float:
    xs = {k: torch.randn(rows, k) for k in {shape[1] for shape in SHAPES}}
    x_head = torch.randn(min(rows, 32), LM_HEAD[1])
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for layer in weights:
            for (_, k), w in zip(SHAPES, layer):
                run(xs[k], w)
        run(x_head, head)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--only", nargs="*", default=None, help="kernel names to run")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"features {sorted(k for k, v in cpu_quant.cpu_features().items() if v)}")
    gen = torch.Generator().manual_seed(0)
    dense = [[torch.randn(shape, generator=gen) * 0.02 for shape in SHAPES] for _ in range(args.layers)]
    head = torch.randn(LM_HEAD, generator=gen) * 0.02
    for name, (make, run, nbytes) in kernels().items():
        if args.only and name not in args.only:
            continue
        weights = [[make(w) for w in layer] for layer in dense]
        packed_head = make(head)
        total = sum(nbytes(w) for layer in weights for w in layer) + nbytes(packed_head)
        cells = []
        for rows in args.rows:
            seconds = time_stack(run, weights, packed_head, rows, args.repeat)
            cells.append(f"M={rows}: {seconds * 1e3:8.2f} ms")
        print(f"{name:16s} {total / 2**20:7.1f} MiB  " + "  ".join(cells), flush=True)
        del weights, packed_head
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
