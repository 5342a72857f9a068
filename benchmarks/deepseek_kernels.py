"""DeepSeek kernel benchmarks on CUDA: MLA (decode, prefill, latent store), fused MoE (bf16, FP8 block-scaled),
the FP8 block-scaled dense GEMM, each against its floor measured in the same run.

Ceilings (same run): copy bandwidth and bf16 matmul (``benchmarks/roofline.py``), and an FP8 e4m3 matmul
(``torch._scaled_mm``, 8192^3, random). Floor = max(fewest bytes / bandwidth, FLOPs / matmul rate of the
kernel's precision). MoE rows run the models' stacks with the shared experts fused in (V3: 256 routed + 1 shared,
V2-Lite: 64 + 2; every token takes the shared ones with weight 1), report the distinct experts touched (random
routing over the routed experts, like a trained router's spread, plus the shared ones) and count only their
weights as bytes.

    python benchmarks/deepseek_kernels.py [--sweep] [--out DIR]

``--sweep`` times a few tile configs for MLA decode and the FP8 MoE GEMMs and writes the best to
DIR/mla_decode.json, DIR/moe.json (the format of dsinfer/ops/triton/configs/).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.roofline import bench_ms, capture_one_call, measure_bandwidth, measure_bf16_matmul  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
R, P = 512, 64  # kv_lora_rank, qk_rope_head_dim (V2-Lite and V3)
BLOCK = (128, 128)


@functools.cache
def measure_fp8_matmul(n: int = 8192) -> float:
    """FP8 e4m3 matrix-product rate (FLOP/s), torch._scaled_mm with unit scales, bf16 output."""
    a = torch.randn(n, n, device="cuda").to(FP8)
    b = torch.randn(n, n, device="cuda").to(FP8).t()
    one = torch.ones((), device="cuda")
    ms = bench_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=BF16))
    return 2 * n**3 / (ms * 1e-3)


@dataclass
class Row:
    name: str
    shape: str
    ms: float
    num_bytes: float
    flops: float
    fp8: bool = False
    note: str = ""

    @property
    def floor_ms(self) -> float:
        rate = measure_fp8_matmul() if self.fp8 else measure_bf16_matmul()
        return 1e3 * max(self.num_bytes / measure_bandwidth(), self.flops / rate)

    def line(self) -> str:
        gbs = self.num_bytes / self.ms / 1e6
        tfs = self.flops / self.ms / 1e9
        bw = gbs * 1e9 / measure_bandwidth()
        peak = tfs * 1e12 / (measure_fp8_matmul() if self.fp8 else measure_bf16_matmul())
        return (f"| {self.name} | {self.shape} | {self.ms:.4f} | {gbs:,.0f} GB/s ({bw:.0%}) | "
                f"{tfs:,.1f} TFLOP/s ({peak:.0%}) | {self.floor_ms:.4f} | {self.floor_ms / self.ms:.0%} | "
                f"{self.note} |")


def graph_ms(fn: Callable[[], object]) -> float:
    """Median replay time of a CUDA graph holding one call of fn (no launch cost); events, L2 flushed."""
    return bench_ms(capture_one_call(fn).replay)


# ---- MLA ----

def _latent_cache(batch: int, ctx: int, block_size: int = 64, dtype: torch.dtype = BF16):
    blocks = batch * (ctx // block_size)
    cache = torch.randn(blocks, block_size, R + P, device="cuda", dtype=BF16).to(dtype)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return cache, tables, seq_lens


def mla_decode_rows(sweep: bool, best: dict) -> list[Row]:
    from dsinfer.ops.triton.mla import decode_config, mla_decode_triton

    rows = []
    fp8 = torch.float8_e4m3fn  # an FP8 latent cache (kv_cache_dtype="fp8"): half the bytes per token
    for heads, batch, ctx, dtype in ((16, 128, 4096, BF16), (16, 1, 4096, BF16), (128, 128, 4096, BF16),
                                     (128, 32, 4096, BF16), (16, 128, 4096, fp8), (16, 256, 1024, BF16),
                                     (16, 256, 1024, fp8), (128, 128, 4096, fp8)):
        cache, tables, seq_lens = _latent_cache(batch, ctx, dtype=dtype)
        qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, heads, R, device="cuda", dtype=BF16)
        qp = torch.randn(batch, heads, P, device="cuda", dtype=BF16)
        nbytes = batch * ctx * (R + P) * dtype.itemsize + batch * heads * (2 * R + P) * 2
        flops = 2 * batch * heads * ctx * (R + P + R)
        configs = [None]
        if sweep and batch >= 32 and dtype == BF16:
            configs += [dict(block_h=bh, block_n=bn, num_warps=w, num_stages=s)
                        for bh, bn, w, s in ((16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2), (64, 32, 8, 2),
                                             (64, 16, 8, 2), (32, 64, 8, 2)) if bh <= max(16, heads)]
        results = []
        for cfg in configs:
            fn = functools.partial(mla_decode_triton, q, qp, cache, tables, qsl, seq_lens, 192**-0.5,
                                   max_seq_len=ctx, config=cfg)
            try:
                results.append((graph_ms(fn), cfg or decode_config(heads, True, dtype != BF16)))
            except Exception as exc:  # noqa: BLE001 (a config that does not compile)
                print(f"  mla decode h={heads} cfg={cfg}: failed {type(exc).__name__}: {str(exc)[:100]}")
            if sweep and cfg is not None:
                print(f"  mla decode h={heads} B={batch} cfg={cfg}: {results[-1][0]:.4f} ms", flush=True)
        ms, cfg = min(results, key=lambda r: r[0])
        if batch >= 32 and dtype == BF16:
            best.setdefault(str(heads), cfg)
        name = "mla decode" if dtype == BF16 else "mla decode, FP8 cache"
        rows.append(Row(name, f"H={heads} B={batch} ctx={ctx}", ms, nbytes, flops, note=str(cfg)))
        del cache
    return rows


def mla_uv_rows() -> list[Row]:
    """Decode + W_UV at few rows: the one-kernel split combine + W_UV against the combine kernel + cuBLAS bmm
    (``ops.triton.mla_uv``; the fused path's default is up to ``FUSED_UV_MAX_HEAD_ROWS`` rows x heads)."""
    from dsinfer.ops.triton.mla_uv import FUSED_UV_MAX_HEAD_ROWS, mla_decode_uv_triton

    rows = []
    ctx, v_dim = 1024, 128
    for heads in (16, 128):
        w_uv = torch.randn(heads, 2 * v_dim, R, device="cuda", dtype=BF16)[:, v_dim:] * 0.04
        for batch in (1, 2, 4, 8, 16):
            cache, tables, seq_lens = _latent_cache(batch, ctx)
            qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            q = torch.randn(batch, heads, R, device="cuda", dtype=BF16)
            qp = torch.randn(batch, heads, P, device="cuda", dtype=BF16)
            times = {}
            for fused in (True, False):
                times[fused] = graph_ms(functools.partial(mla_decode_uv_triton, q, qp, cache, tables, qsl, seq_lens,
                                                          192**-0.5, w_uv, max_seq_len=ctx, fused=fused))
            nbytes = batch * ctx * (R + P) * 2 + heads * v_dim * R * 2
            flops = 2 * batch * heads * (ctx * (2 * R + P) + R * v_dim)
            default = "fused" if batch * heads <= FUSED_UV_MAX_HEAD_ROWS else "two launches"
            rows.append(Row("mla decode + W_UV, fused combine", f"H={heads} B={batch} ctx={ctx}", times[True],
                            nbytes, flops, note=f"two launches {times[False]:.4f} ms; default: {default}"))
    return rows


def mla_other_rows() -> list[Row]:
    from dsinfer.ops.mla import mla_prefill, store_mla_kv

    rows = []
    tokens = 16384
    cache = torch.empty(tokens // 64 + 1, 64, R + P, device="cuda", dtype=BF16)
    kv_c = torch.randn(tokens, R, device="cuda", dtype=BF16)
    k_pe = torch.randn(tokens, P, device="cuda", dtype=BF16)
    slots = torch.arange(tokens, device="cuda")
    ms = graph_ms(lambda: store_mla_kv(kv_c, k_pe, cache, slots))
    rows.append(Row("mla store", f"T={tokens}", ms, 2 * tokens * (R + P) * 2 + tokens * 8, 0))
    heads, seqs, n = 16, 4, 2048
    cache, tables, seq_lens = _latent_cache(seqs, n)
    qsl = torch.arange(0, seqs * n + 1, n, device="cuda", dtype=torch.int32)
    qn = torch.randn(seqs * n, heads, 128, device="cuda", dtype=BF16)
    qp = torch.randn(seqs * n, heads, P, device="cuda", dtype=BF16)
    w = torch.randn(heads, 256, R, device="cuda", dtype=BF16) * 0.04
    ms = bench_ms(lambda: mla_prefill(qn, qp, cache, tables, qsl, seq_lens, w, 192**-0.5))
    attn = seqs * heads * n * (n + 1) / 2 * 2 * (192 + 128)
    expand = 2 * seqs * n * R * heads * 256
    rows.append(Row("mla prefill", f"H={heads} {seqs}x{n} causal", ms, 0, attn + expand))
    return rows


# ---- MoE ----

def _fp8_experts(num_experts: int, rows: int, cols: int):
    w = torch.empty(num_experts, rows, cols, device="cuda", dtype=FP8)
    for e in range(0, num_experts, 16):
        w[e : e + 16] = (torch.randn(min(16, num_experts - e), rows, cols, device="cuda", dtype=BF16) * 100).to(FP8)
    s = torch.rand(num_experts, rows // 128, cols // 128, device="cuda") * 1e-4 + 1e-4
    return w, s


def _routing(tokens: int, num_experts: int, top_k: int, num_shared: int):
    """Random top-k of the routed experts, then the shared experts' columns (``ops.moe.with_shared``)."""
    from dsinfer.ops.moe import with_shared

    logits = torch.randn(tokens, num_experts, device="cuda")
    weights, ids = with_shared(*logits.softmax(-1).topk(top_k, dim=-1), num_experts, num_shared)
    return weights, ids, int(ids.unique().numel())


def moe_rows(sweep: bool, best: dict) -> list[Row]:
    from benchmarks.tune_deepseek import MoeGemms
    from dsinfer.ops.moe import fused_moe
    from dsinfer.ops.triton.moe import down_config, moe_config

    rows = []
    # DeepSeek-V3 experts, FP8: E=256 routed + 1 shared, H=7168, I=2048, top-8 (+ the shared one).
    routed, shared, h, i, top_k = 256, 1, 7168, 2048, 8
    e, k = routed + shared, top_k + shared  # stacked experts, pairs per token
    w13, s13 = _fp8_experts(e, 2 * i, h)
    w2, s2 = _fp8_experts(e, h, i)
    per_expert = 3 * h * i + 3 * (h // 128) * (i // 128) * 4
    for tokens in (64, 8192):
        x = torch.randn(tokens, h, device="cuda", dtype=BF16)
        weights, ids, touched = _routing(tokens, routed, top_k, shared)
        pairs = tokens * k
        kw = dict(w13_scale_inv=s13, w2_scale_inv=s2, block_size=BLOCK)
        fn = functools.partial(fused_moe, x, w13, w2, weights, ids, **kw)
        ms = graph_ms(fn) if tokens <= 256 else bench_ms(fn)
        flops = 6 * pairs * h * i
        rows.append(Row("moe fp8 (all)", f"V3 T={tokens}", ms, touched * per_expert + 4 * tokens * h, flops,
                        fp8=True, note=f"{touched} experts"))
        if tokens < 1024:
            continue
        # The two grouped GEMMs alone, per config (sorted tiles: gate/up timed with the copy into expert order).
        key = f"{e},{i},{h},fp8"
        inter = torch.randn(pairs, i, device="cuda", dtype=BF16)
        gemms = MoeGemms(x, inter, w13, s13, w2, s2, ids, weights, k, fp8=True)
        configs = [moe_config(key, pairs / e, True, True)]
        if sweep:
            configs += [dict(block_m=bm, block_n=bn, block_k=128, group_m=gm, num_warps=w, num_stages=s)
                        for bm, bn, gm, w, s in ((64, 128, 8, 4, 4), (128, 128, 8, 8, 3), (64, 64, 8, 4, 4),
                                                 (128, 64, 8, 4, 3), (64, 128, 32, 8, 3))]
        results = []
        for cfg in configs:
            cfg2 = down_config(cfg)  # the down GEMM's own tile (tuned separately)
            try:
                t1 = bench_ms(functools.partial(gemms.gate_up, cfg))
                t2 = bench_ms(functools.partial(gemms.down, cfg2))
            except Exception as exc:  # noqa: BLE001
                print(f"  moe cfg={cfg}: failed {type(exc).__name__}: {str(exc)[:100]}")
                continue
            results.append((t1, t2, cfg))
            if sweep:
                print(f"  moe fp8 T={tokens} cfg={cfg}: gate/up {t1:.3f} ms, down {t2:.3f} ms", flush=True)
        t1, t2, cfg = min(results, key=lambda r: r[0] + r[1])
        best.setdefault(key, {})[str(round(pairs / e))] = cfg
        w_bytes = touched * per_expert
        rows.append(Row("moe fp8 gate/up", f"V3 T={tokens}", t1, 2 / 3 * w_bytes + tokens * h + pairs * i * 2,
                        4 * pairs * h * i, fp8=True, note=str(cfg)))
        rows.append(Row("moe fp8 down", f"V3 T={tokens}", t2, 1 / 3 * w_bytes + pairs * i + pairs * h * 2,
                        2 * pairs * h * i, fp8=True))
        del inter, gemms
    del w13, w2
    # DeepSeek-V2-Lite experts, bf16: E=64 routed + 2 shared, H=2048, I=1408, top-6 (+ the two shared).
    routed, shared, h, i, top_k = 64, 2, 2048, 1408, 6
    e, k = routed + shared, top_k + shared
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=BF16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=BF16) * 0.02
    for tokens in (64, 8192):
        x = torch.randn(tokens, h, device="cuda", dtype=BF16)
        weights, ids, touched = _routing(tokens, routed, top_k, shared)
        fn = functools.partial(fused_moe, x, w13, w2, weights, ids)
        ms = graph_ms(fn) if tokens <= 256 else bench_ms(fn)
        rows.append(Row("moe bf16 (all)", f"V2-Lite T={tokens}", ms, touched * 3 * h * i * 2 + 4 * tokens * h,
                        6 * tokens * k * h * i, note=f"{touched} experts"))
    return rows


def fp8_dense_rows() -> list[Row]:
    from dsinfer.ops.fp8 import fp8_block_linear

    rows = []
    n, k = 7168, 16384  # V3 o_proj
    w, s = _fp8_experts(1, n, k)
    w, s = w[0], s[0]
    for m in (64, 4096):
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        fn = functools.partial(fp8_block_linear, x, w, s, BLOCK)
        ms = graph_ms(fn) if m <= 256 else bench_ms(fn)
        rows.append(Row("fp8 dense", f"{m}x{n}x{k}", ms, n * k + m * k * 2 + m * n * 2, 2 * m * n * k, fp8=True))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None, help="mla | mla_uv | moe | fp8")
    args = parser.parse_args()
    bw, bf16, fp8 = measure_bandwidth(), measure_bf16_matmul(), measure_fp8_matmul()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 {bf16 / 1e12:.0f} TFLOP/s, "
          f"fp8 {fp8 / 1e12:.0f} TFLOP/s", flush=True)
    best_mla: dict = {}
    best_moe: dict = {}
    rows: list[Row] = []
    groups = {"mla": lambda: mla_decode_rows(args.sweep, best_mla) + mla_other_rows(), "mla_uv": mla_uv_rows,
              "moe": lambda: moe_rows(args.sweep, best_moe), "fp8": fp8_dense_rows}
    for name, make in groups.items():
        if args.only in (None, name):
            try:
                rows += make()
            except Exception as exc:  # noqa: BLE001 (report the other groups)
                print(f"{name}: failed {type(exc).__name__}: {exc}", flush=True)
            torch.cuda.empty_cache()
    print("\n| kernel | shape | ms | bytes rate (of BW) | FLOP rate (of peak) | floor ms | of floor | note |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(r.line())
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 {bf16 / 1e12:.0f} TFLOP/s, fp8 {fp8 / 1e12:.0f} TFLOP/s")
    if args.out:
        Path(args.out, "mla_decode.json").write_text(json.dumps(best_mla, indent=1))
        Path(args.out, "moe.json").write_text(json.dumps(best_moe, indent=1))


if __name__ == "__main__":
    main()
