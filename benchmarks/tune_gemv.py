"""Few-row dense linears: cuBLAS against the grouped GEMM kernel's tiles (split-K included), per weight shape.

For each shape of the models named (Llama-3.1-8B's qkv, o, gate/up, down and LM head; DeepSeek-V2-Lite's fused
q + kv_a, o, dense MLP and LM head; DeepSeek-V3's LM head) at each row count, the candidates and cuBLAS
(``F.linear``) run as a chain over distinct copies of the weight (at least 512 MB, so L2 holds none of it), each
copy after an RMSNorm of the GEMV's input, in one CUDA graph, as a decode step streams its layers (with PDL where
the GPU has it, as in the engine: a Triton tile overlaps the norm before it, cuBLAS does not). The table gets
the best tile where it beat cuBLAS by at least ``--margin`` (default 0: any win), else ``{"cublas": true}``;
``ops.linear`` then takes the tile on CUDA for rows in the bucket's range (``moe.nearest_config``: within 4x) that
fit the tile's one row tile. Every candidate's output is checked against float64.

MLP gate/up projections are tuned twice: as above, and fused with their SiLU(gate) * up (``GATED``: the
kernel's two-accumulator mode, no split-K) against the unfused pair as the engine runs it now (the repo table's
choice for the projection, then the SiLU-mul kernel). The winner goes under ``dense_silu_mul,N,K,<dtype>``: the
tile, or ``{"unfused": true}``.

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
GATED = {  # (name, N, K): merged gate/up weights of 2N x K whose N outputs are SiLU(gate) * up
    "llama": [("gate_up+silu", 14336, 4096)],
    "v2-lite": [("dense gate_up+silu", 10944, 2048)],
}
CHAIN_BYTES = 512 << 20


def candidates(rows: int, n: int, sms: int, gated: bool = False) -> list[dict]:
    """Column tiles of 32-128, K tiles of 128 (and 256 without TMA), K split 1-8 (1 when gated); one row tile of
    16 or 64. Ordered by how near their programs come to two per SM (the budget may cut the list short)."""
    bm = 16 if rows <= 16 else 64
    out = []
    for split in (1,) if gated else (1, 2, 4, 8):
        for bn, bk, tma in ((32, 128, False), (64, 128, False), (128, 128, False), (32, 256, False),
                            (32, 128, True), (64, 128, True), (128, 128, True)):
            out.append(dict(block_m=bm, block_n=bn, block_k=bk, group_m=1, num_warps=4, num_stages=4, tma=tma,
                            split_k=split))
    return sorted(out, key=lambda c: abs(math.log2(-(-n // c["block_n"]) * c["split_k"] / (2 * sms))))


def tune_shape(label: str, n: int, k: int, rows: int, budget: Budget, table: dict, margin: float,
               gated: bool = False) -> None:
    """Tune one N x K weight (``gated``: a 2N x K gate/up weight and its SiLU-mul) at ``rows`` rows."""
    from dsinfer.ops import rms_norm, silu_and_mul
    from dsinfer.ops.linear import linear
    from dsinfer.ops.triton.gemv import linear_silu_mul_triton, linear_triton, table_key
    from dsinfer.ops.triton.utils import num_sms

    dev, dtype = tuning.DEV, torch.bfloat16
    rows_w = 2 * n if gated else n
    copies = 2 if tuning.SMOKE else max(2, min(64, math.ceil(CHAIN_BYTES / (rows_w * k * 2))))
    gen = torch.Generator(device=dev).manual_seed(n + k)
    ws = [torch.randn(rows_w, k, device=dev, dtype=dtype, generator=gen) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device=dev, dtype=dtype, generator=gen)
    norm_w = 1 + 0.1 * torch.randn(k, device=dev, dtype=dtype, generator=gen)
    out = torch.empty(rows, n, device=dev, dtype=dtype)
    ref = (rms_norm(x, norm_w, 1e-6).double() @ ws[-1].double().t()).float()
    if gated:
        gate, up = ref.double().chunk(2, dim=-1)
        ref = (gate * torch.sigmoid(gate) * up).float()

    def chain(linear) -> None:
        """Every copy in turn, each after an RMSNorm of its input, as a decode step streams its layers (a GEMV
        there follows a small kernel: a norm, the attention's reduce, SiLU-mul); the last output lands in
        ``out``. With PDL the norm and a Triton tile overlap at their boundary; cuBLAS waits for the norm."""
        for w in ws[:-1]:
            linear(rms_norm(x, norm_w, 1e-6), w)
        out.copy_(linear(rms_norm(x, norm_w, 1e-6), ws[-1]))

    def per_call_ms(fn) -> float:
        return tuning.graph_bench(fn) / copies

    if gated:  # the baseline: the engine's unfused pair (the repo table's projection, then SiLU-mul)
        base_ms = per_call_ms(functools.partial(chain, lambda a, w: silu_and_mul(linear(a, w))))
        run = lambda cfg: chain(lambda a, w: linear_silu_mul_triton(a, w, cfg))  # noqa: E731
    else:
        base_ms = per_call_ms(functools.partial(chain, F.linear))
        run = lambda cfg: chain(lambda a, w: linear_triton(a, w, None, cfg))  # noqa: E731
    res = sweep(f"{label} {rows}x{n}x{k}", candidates(rows, n, num_sms(torch.device(dev)), gated), run,
                lambda: rel_err(out, ref), budget, timer=per_call_ms)
    floor_ms = rows_w * k * 2 / tuning.ceilings()["copy"] * 1e3
    key, bucket = table_key(n, k, dtype, gated), str(rows)
    best_ms, best = min(res, key=lambda r: r[0]) if res else (math.inf, None)
    wins = best_ms < base_ms * (1 - margin)
    table.setdefault(key, {})[bucket] = best if wins else {"unfused": True} if gated else {"cublas": True}
    kept = "Triton" if wins else "unfused" if gated else "cuBLAS"
    tuning.TABLE.append(f"| {label} | {rows}x{rows_w}x{k} | {base_ms * 1e3:.2f} | {best_ms * 1e3:.2f} | "
                        f"{floor_ms * 1e3:.2f} | {kept} | {best} |")


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
    models = args.models.split(",")
    shapes = ([(f"{m} {name}", n, k, False) for m in models for name, n, k in SHAPES[m]]
              + [(f"{m} {name}", n, k, True) for m in models for name, n, k in GATED.get(m, [])])
    if args.smoke:
        tuning.SMOKE, tuning.DEV = True, "cuda" if torch.cuda.is_available() else "cpu"
        shapes, args.rows = [("smoke", 48, 256, False), ("smoke gated", 24, 256, True)], [1]
    elif not torch.cuda.is_available():
        sys.exit("tune_gemv.py needs a CUDA device")
    table = json.loads(CONFIG.read_text())
    start = time.monotonic()
    c = tuning.ceilings()
    print(f"copy {c['copy'] / 1e12:.2f} TB/s", flush=True)
    jobs = [(s, rows) for s in shapes for rows in args.rows]
    for i, ((label, n, k, gated), rows) in enumerate(jobs):
        left = args.budget_s - (time.monotonic() - start)
        tune_shape(label, n, k, rows, Budget(left / (len(jobs) - i)), table, args.margin, gated)
        tuning.empty_cache()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "moe.json").write_text(json.dumps(table, indent=1) + "\n")
    print("| weight | rows x N x K | norm + cuBLAS (gated: + the unfused pair) us | norm + best tile us "
          "| GEMV floor us | kept | tile |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for line in tuning.TABLE:
        print(line)
    print(f"{out_dir / 'moe.json'} written; {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
