"""Few-row dense linears: cuBLAS against the grouped GEMM kernel's tiles (split-K included), per weight shape.

For each shape of the models named (Llama-3.1-8B's qkv, o, gate/up, down and LM head; DeepSeek-V2-Lite's fused
q + kv_a, o, dense MLP and LM head; DeepSeek-V3's LM head) at each row count, the candidates and cuBLAS
(``F.linear``) run as a chain over distinct copies of the weight (at least 512 MB, so L2 holds none of it), each
copy after an RMSNorm of the GEMV's input, in one CUDA graph, as a decode step streams its layers (with PDL where
the GPU has it, as in the engine: a Triton tile overlaps the norm before it, cuBLAS does not). The table gets
the best tile where it beat cuBLAS by at least ``--margin`` (default 0: any win), else ``{"cublas": true}``;
``ops.linear`` then takes the tile on CUDA for rows in the bucket's range (``moe.nearest_config``: within 4x) that
fit the tile's one row tile. Every candidate's output is checked against float64.

    python benchmarks/tune_gemv.py [--models llama,v2-lite,v3] [--rows 1 16] [--budget-s 120] [--out DIR]
                                   [--smoke]

Writes DIR/moe.json (DIR = --out, else $OUT, else /tmp): the repo's ``dsinfer/ops/triton/configs/moe.json`` with
the tuned entries replaced, ready to copy over.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import tuning  # noqa: E402
from benchmarks.tuning import Budget, rel_err, sweep  # noqa: E402

CONFIG = ROOT / "dsinfer" / "ops" / "triton" / "configs" / "moe.json"
SHAPES = {  # (name, N, K) of the weights a decode step streams through F.linear
    "llama": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
              ("lm_head", 128256, 4096)],
    "v2-lite": [("q+kv_a", 3648, 2048), ("o", 2048, 2048), ("dense gate_up", 21888, 2048),
                ("dense down", 2048, 10944), ("lm_head", 102400, 2048)],
    "v3": [("lm_head", 129280, 7168)],
}
CHAIN_BYTES = 512 << 20


def candidates(rows: int, n: int, sms: int) -> list[dict]:
    """Column tiles of 32-128, K tiles of 128 (and 256 without TMA), K split 1-8; one row tile of 16 or 64.
    Ordered by how near their programs come to two per SM (the budget may cut the list short)."""
    bm = 16 if rows <= 16 else 64
    out = []
    for split in (1, 2, 4, 8):
        for bn, bk, tma in ((32, 128, False), (64, 128, False), (128, 128, False), (32, 256, False),
                            (32, 128, True), (64, 128, True), (128, 128, True)):
            out.append(dict(block_m=bm, block_n=bn, block_k=bk, group_m=1, num_warps=4, num_stages=4, tma=tma,
                            split_k=split))
    return sorted(out, key=lambda c: abs(math.log2(-(-n // c["block_n"]) * c["split_k"] / (2 * sms))))


def tune_shape(label: str, n: int, k: int, rows: int, budget: Budget, table: dict, margin: float) -> None:
    from dsinfer.ops import rms_norm
    from dsinfer.ops.triton.gemv import linear_triton, table_key
    from dsinfer.ops.triton.utils import num_sms

    dev, dtype = tuning.DEV, torch.bfloat16
    copies = 2 if tuning.SMOKE else max(2, min(64, math.ceil(CHAIN_BYTES / (n * k * 2))))
    gen = torch.Generator(device=dev).manual_seed(n + k)
    ws = [torch.randn(n, k, device=dev, dtype=dtype, generator=gen) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device=dev, dtype=dtype, generator=gen)
    norm_w = 1 + 0.1 * torch.randn(k, device=dev, dtype=dtype, generator=gen)
    out = torch.empty(rows, n, device=dev, dtype=dtype)
    ref = (rms_norm(x, norm_w, 1e-6).double() @ ws[-1].double().t()).float()

    def chain(linear) -> None:
        """Every copy in turn, each after an RMSNorm of its input, as a decode step streams its layers (a GEMV
        there follows a small kernel: a norm, the attention's reduce, SiLU-mul); the last output lands in
        ``out``. With PDL the norm and a Triton tile overlap at their boundary; cuBLAS waits for the norm."""
        for w in ws[:-1]:
            linear(rms_norm(x, norm_w, 1e-6), w)
        out.copy_(linear(rms_norm(x, norm_w, 1e-6), ws[-1]))

    def per_call_ms(fn) -> float:
        return tuning.graph_bench(fn) / copies

    cublas_ms = per_call_ms(functools.partial(chain, F.linear))
    res = sweep(f"{label} {rows}x{n}x{k}", candidates(rows, n, num_sms(torch.device(dev))),
                lambda cfg: chain(lambda a, w: linear_triton(a, w, None, cfg)),
                lambda: rel_err(out, ref), budget, timer=per_call_ms)
    floor_ms = n * k * 2 / tuning.ceilings()["copy"] * 1e3
    key, bucket = table_key(n, k, dtype), str(rows)
    best_ms, best = min(res, key=lambda r: r[0]) if res else (math.inf, None)
    wins = best_ms < cublas_ms * (1 - margin)
    table.setdefault(key, {})[bucket] = best if wins else {"cublas": True}
    tuning.TABLE.append(f"| {label} | {rows}x{n}x{k} | {cublas_ms * 1e3:.2f} | {best_ms * 1e3:.2f} | "
                        f"{floor_ms * 1e3:.2f} | {'Triton' if wins else 'cuBLAS'} | {best} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,v2-lite,v3")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--budget-s", type=float, default=120.0)
    # 0 since PDL (ops/triton/pdl.py): the chain times each GEMV after a norm, as the engine runs it (session 18)
    parser.add_argument("--margin", type=float, default=0.0, help="how much faster a tile must be than cuBLAS")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (CPU interpreter)")
    args = parser.parse_args()
    shapes = [(f"{m} {name}", n, k) for m in args.models.split(",") for name, n, k in SHAPES[m]]
    if args.smoke:
        tuning.SMOKE, tuning.DEV = True, "cuda" if torch.cuda.is_available() else "cpu"
        shapes, args.rows = [("smoke", 48, 256)], [1]
    elif not torch.cuda.is_available():
        sys.exit("tune_gemv.py needs a CUDA device")
    table = json.loads(CONFIG.read_text())
    start = time.monotonic()
    c = tuning.ceilings()
    print(f"copy {c['copy'] / 1e12:.2f} TB/s", flush=True)
    jobs = [(s, rows) for s in shapes for rows in args.rows]
    for i, ((label, n, k), rows) in enumerate(jobs):
        left = args.budget_s - (time.monotonic() - start)
        tune_shape(label, n, k, rows, Budget(left / (len(jobs) - i)), table, args.margin)
        tuning.empty_cache()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "moe.json").write_text(json.dumps(table, indent=1) + "\n")
    print("| weight | rows x N x K | norm + cuBLAS us | norm + best tile us | GEMV floor us | kept | tile |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for line in tuning.TABLE:
        print(line)
    print(f"{out_dir / 'moe.json'} written; {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
