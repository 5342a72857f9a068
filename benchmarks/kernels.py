"""Kernel benchmarks on CUDA: each Triton op against its torch reference at Llama-3.1-8B shapes.

Llama-3.1-8B: 32 query heads, 8 KV heads, head dim 128, hidden 4096, intermediate 14336, vocab 128256; bf16.
Every row prints the Triton time twice (events around a Python call, which include launch overhead when the
kernel is short; and the replay of a one-call CUDA graph, what the engine's decode graphs pay), the torch
reference time, the achieved rate (GB/s, or TFLOP/s for prefill attention) and the roofline floor from
``benchmarks/roofline.py`` (fewest bytes / measured copy bandwidth, or FLOPs / measured bf16 matmul rate).

    python benchmarks/kernels.py [--sweep] [--only NAME]

``--sweep`` also times a few decode/prefill attention configs and split counts (tuning notes).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.roofline import bench_ms, floor_ms, measure_bandwidth, measure_bf16_matmul  # noqa: E402

HQ, HKV, D, HIDDEN, INTER, VOCAB = 32, 8, 128, 4096, 14336, 128256
BF16 = torch.bfloat16
BLOCK_SIZE = 16


@dataclass
class Case:
    name: str
    shape: str
    triton: Callable[[], object]
    ref: Callable[[], object] | None
    num_bytes: float = 0.0
    flops: float = 0.0


@dataclass
class Row:
    case: Case
    triton_ms: float
    graph_ms: float
    ref_ms: float
    floor: float

    @property
    def best_ms(self) -> float:
        return min(self.triton_ms, self.graph_ms)

    @property
    def rate(self) -> str:
        if self.case.flops:
            return f"{self.case.flops / self.best_ms / 1e9:7.1f} TFLOP/s"
        return f"{self.case.num_bytes / self.best_ms / 1e6:7.0f} GB/s"


def graph_ms(fn: Callable[[], object]) -> float:
    """Median replay time of a CUDA graph holding one call of fn (no Python launch cost)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


# ---- cases ----

def _elementwise_cases() -> list[Case]:
    from dsinfer.ops.activation import silu_and_mul_ref
    from dsinfer.ops.kv_cache import store_kv_ref
    from dsinfer.ops.norm import rms_norm_ref
    from dsinfer.ops.rotary import apply_rotary_ref, rotary_store_kv_ref
    from dsinfer.ops.triton.activation import silu_and_mul_triton
    from dsinfer.ops.triton.kv_cache import store_kv_triton
    from dsinfer.ops.triton.norm import rms_norm_triton
    from dsinfer.ops.triton.rotary import apply_rotary_triton, rotary_store_kv_triton

    cases = []
    for t in (256, 16384):
        x = torch.randn(t, HIDDEN, device="cuda", dtype=BF16)
        r = torch.randn_like(x)
        w = torch.randn(HIDDEN, device="cuda", dtype=BF16)
        cases.append(Case("rms_norm+residual", f"{t}x{HIDDEN}",
                          lambda x=x, r=r, w=w: rms_norm_triton(x, w, 1e-5, r),
                          lambda x=x, r=r, w=w: rms_norm_ref(x, w, 1e-5, r), num_bytes=4 * x.numel() * 2))
        g = torch.randn(t, 2 * INTER, device="cuda", dtype=BF16)
        cases.append(Case("silu_and_mul", f"{t}x2x{INTER}", lambda g=g: silu_and_mul_triton(g),
                          lambda g=g: silu_and_mul_ref(g), num_bytes=1.5 * g.numel() * 2))
        q = torch.randn(t, HQ, D, device="cuda", dtype=BF16)
        k = torch.randn(t, HKV, D, device="cuda", dtype=BF16)
        pos = torch.randint(0, 8192, (t,), device="cuda")
        inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
        ang = torch.outer(torch.arange(8192, device="cuda").float(), inv)
        cs = torch.cat((ang.cos(), ang.sin()), -1)
        cases.append(Case("rotary(neox)", f"{t}x({HQ}+{HKV})x{D}",
                          lambda q=q, k=k, pos=pos, cs=cs: apply_rotary_triton(pos, q, k, cs, True),
                          lambda q=q, k=k, pos=pos, cs=cs: apply_rotary_ref(pos, q, k, cs, True),
                          num_bytes=2 * (q.numel() + k.numel()) * 2 + t * D * 4))
        num_blocks = max(2 * t // BLOCK_SIZE, 64)
        cache = torch.randn(2, num_blocks, BLOCK_SIZE, HKV, D, device="cuda", dtype=BF16)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:t]
        kk, vv = torch.randn(2, t, HKV, D, device="cuda", dtype=BF16)
        cases.append(Case("store_kv", f"{t}x{HKV}x{D}",
                          lambda kk=kk, vv=vv, c=cache, s=slots: store_kv_triton(kk, vv, c, s),
                          lambda kk=kk, vv=vv, c=cache, s=slots: store_kv_ref(kk, vv, c, s),
                          num_bytes=4 * kk.numel() * 2))
        # the fused op of a Llama layer: q rotated into a new tensor, k rotated and v copied into the cache
        qkv = torch.randn(t, HQ + 2 * HKV, D, device="cuda", dtype=BF16)
        q3, k3, v3 = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
        cases.append(Case("rotary+store_kv", f"{t}x({HQ}+2x{HKV})x{D}",
                          lambda a=(pos, q3, k3, v3, cs, True, cache, slots): rotary_store_kv_triton(*a),
                          lambda a=(pos, q3, k3, v3, cs, True, cache, slots): rotary_store_kv_ref(*a),
                          num_bytes=(2 * q3.numel() + 4 * k3.numel()) * 2 + t * D * 4))
    return cases


def _sampling_cases() -> list[Case]:
    from dsinfer.ops.sampling import gumbel_argmax_ref
    from dsinfer.ops.triton.sampling import gumbel_argmax_triton

    cases = []
    for b in (1, 64, 256):
        logits = 3 * torch.randn(b, VOCAB, device="cuda")
        seeds = torch.randint(0, 2**62, (b,), device="cuda")
        pos = torch.randint(0, 2**20, (b,), device="cuda")
        temp = torch.full((b,), 0.7, device="cuda")
        args = (logits, seeds, pos, temp)
        cases.append(Case("gumbel_argmax", f"{b}x{VOCAB}", lambda a=args: gumbel_argmax_triton(*a),
                          lambda a=args: gumbel_argmax_ref(*a), num_bytes=logits.numel() * 4))
    return cases


def _attention_batch(q_lens: list[int], ctx_lens: list[int]):
    """q, cache, block_tables, query_start_loc, seq_lens over shuffled blocks holding exactly the contexts."""
    per_seq = [math.ceil(n / BLOCK_SIZE) for n in ctx_lens]
    ids = torch.randperm(sum(per_seq), device="cuda", dtype=torch.int32)
    width = max(per_seq)
    block_tables = torch.zeros(len(ctx_lens), width, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(per_seq):
        block_tables[b, :n] = ids[start : start + n]
        start += n
    cache = torch.randn(2, sum(per_seq), BLOCK_SIZE, HKV, D, device="cuda", dtype=BF16)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), HQ, D, device="cuda", dtype=BF16)
    return q, cache, block_tables, qsl, torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")


def _attention_cases() -> list[Case]:
    from dsinfer.ops.attention import paged_attention_ref
    from dsinfer.ops.triton.attention import paged_attention_triton

    cases, scale = [], D**-0.5
    for ctx in (1024, 4096):
        for b in (1, 64, 256):
            args = _attention_batch([1] * b, [ctx] * b)
            kv_bytes = 2 * b * ctx * HKV * D * 2 + 2 * b * HQ * D * 2
            cases.append(Case("attn decode", f"B={b} ctx={ctx}",
                              lambda a=args, c=ctx: paged_attention_triton(
                                  *a, scale, max_query_len=1, max_seq_len=c),
                              lambda a=args: paged_attention_ref(*a, scale), num_bytes=kv_bytes))
    for b in (64, 256):  # an FP8 cache (kv_cache_dtype="fp8"): half the bytes of the same decode
        q, cache, *rest = _attention_batch([1] * b, [4096] * b)
        args = (q, cache.to(torch.float8_e4m3fn), *rest)
        kv_bytes = 2 * b * 4096 * HKV * D + 2 * b * HQ * D * 2
        cases.append(Case("attn decode fp8", f"B={b} ctx=4096",
                          lambda a=args: paged_attention_triton(*a, scale, max_query_len=1, max_seq_len=4096),
                          lambda a=args: paged_attention_ref(*a, scale), num_bytes=kv_bytes))
    n, length = 8, 2048
    args = _attention_batch([length] * n, [length] * n)
    flops = 4 * HQ * D * n * length * (length + 1) / 2
    cases.append(Case("attn prefill", f"{n}x{length}",
                      lambda a=args: paged_attention_triton(*a, scale, max_query_len=length),
                      lambda a=args: paged_attention_ref(*a, scale), flops=flops))
    return cases


# ---- tuning sweep ----

def sweep() -> None:
    import dsinfer.ops.triton.attention as attn

    scale = D**-0.5
    print("\n# decode configs (BLOCK_N, warps, stages) -> graph ms")
    default_decode = attn._decode_config
    for b, ctx in ((1, 4096), (64, 4096), (256, 1024)):
        args = _attention_batch([1] * b, [ctx] * b)
        kv = 2 * b * ctx * HKV * D * 2
        for cfg in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 3), (64, 8, 3), (128, 8, 3)):
            attn._decode_config = lambda *_, cfg=cfg: cfg
            ms = graph_ms(lambda a=args, c=ctx: attn.paged_attention_triton(
                *a, scale, max_query_len=1, max_seq_len=c))
            print(f"  B={b:3d} ctx={ctx} cfg={cfg}: {ms:.4f} ms  {kv / ms / 1e6:6.0f} GB/s")
        attn._decode_config = default_decode
        for splits in (1, 2, 4, 8, 16, 32, 64):
            ms = graph_ms(lambda a=args, s=splits: attn.paged_attention_triton(*a, scale, max_query_len=1,
                                                                                 num_splits=s))
            print(f"  B={b:3d} ctx={ctx} splits={splits}: {ms:.4f} ms  {kv / ms / 1e6:6.0f} GB/s")
        print(f"  heuristic splits: {attn._num_splits(b, HKV, ctx, torch.device('cuda'))}")
    print("\n# prefill configs (BLOCK_M, BLOCK_N, warps, stages) -> ms")
    default_prefill = attn._prefill_config
    args = _attention_batch([2048] * 8, [2048] * 8)
    flops = 4 * HQ * D * 8 * 2048 * 2049 / 2
    for cfg in ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 8, 4),
                (128, 64, 8, 2), (128, 128, 8, 2)):
        attn._prefill_config = lambda *_, cfg=cfg: cfg
        try:
            ms = bench_ms(lambda a=args: attn.paged_attention_triton(*a, scale, max_query_len=2048))
            print(f"  cfg={cfg}: {ms:.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s")
        except Exception as exc:  # an out-of-resources config: report and go on
            print(f"  cfg={cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})")
    attn._prefill_config = default_prefill


def sweep_fp8() -> None:
    """Decode over an FP8 cache: tile configs, with the value tiles converted to fp16 in registers before the product
    (``FP8_V_CVT``, the default) or converted by Triton after the shared-memory load (byte reads)."""
    import dsinfer.ops.triton.attention as attn

    scale = D**-0.5
    print("\n# FP8-cache decode configs (BLOCK_N, warps, stages) x value conversion -> graph ms")
    default_decode, default_cvt = attn._decode_config, attn.FP8_V_CVT
    for b, ctx in ((1, 4096), (64, 4096), (256, 4096), (256, 1024)):
        q, cache, *rest = _attention_batch([1] * b, [ctx] * b)
        args = (q, cache.to(torch.float8_e4m3fn), *rest)
        kv = 2 * b * ctx * HKV * D
        for cvt in (True, False):
            attn.FP8_V_CVT = cvt
            for cfg in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (64, 8, 2), (128, 8, 2)):
                attn._decode_config = lambda *_, cfg=cfg: cfg
                ms = graph_ms(lambda a=args, c=ctx: attn.paged_attention_triton(
                    *a, scale, max_query_len=1, max_seq_len=c))
                print(f"  B={b:3d} ctx={ctx} v_cvt={cvt:d} cfg={cfg}: {ms:.4f} ms  {kv / ms / 1e6:6.0f} GB/s")
    attn._decode_config, attn.FP8_V_CVT = default_decode, default_cvt


# ---- main ----

def run_case(case: Case) -> Row:
    triton_ms = bench_ms(case.triton)
    g_ms = graph_ms(case.triton)
    ref_ms = bench_ms(case.ref) if case.ref is not None else float("nan")
    return Row(case, triton_ms, g_ms, ref_ms, floor_ms(case.num_bytes, case.flops))


def print_table(rows: list[Row]) -> None:
    print(f"\n{'kernel':<18} {'shape':<20} {'triton':>8} {'graph':>8} {'torch':>8} {'x':>6} "
          f"{'achieved':>16} {'floor':>8} {'of floor':>8}")
    for r in rows:
        print(f"{r.case.name:<18} {r.case.shape:<20} {r.triton_ms:8.4f} {r.graph_ms:8.4f} {r.ref_ms:8.3f} "
              f"{r.ref_ms / r.best_ms:6.1f} {r.rate:>16} {r.floor:8.4f} {100 * r.floor / r.best_ms:7.0f}%")
    print("times in ms (median); x = torch / best Triton; of floor = floor / best Triton time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time attention configs and split counts")
    parser.add_argument("--sweep-fp8", action="store_true", help="also time FP8-cache decode configs")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA device")
    torch.manual_seed(0)
    bw, mm = measure_bandwidth(), measure_bf16_matmul()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s (read+write), "
          f"bf16 matmul {mm / 1e12:.0f} TFLOP/s (8192^3 random)")
    if opts.sweep:
        sweep()
    if opts.sweep_fp8:
        sweep_fp8()
    rows = []
    for make in (_elementwise_cases, _sampling_cases, _attention_cases):
        for case in make():
            if opts.only in case.name:
                rows.append(run_case(case))
                print(f"  {case.name} {case.shape}: {rows[-1].best_ms:.4f} ms", flush=True)
        torch.cuda.empty_cache()
    print_table(rows)


if __name__ == "__main__":
    main()
