"""Tile-config tuner for the DeepSeek kernels on one CUDA GPU (issue 7 targets), bounded to ~5 minutes.

Sweeps a pruned grid of configs for
- the FP8 MoE grouped GEMMs of DeepSeek-V3 experts (256 routed + 1 shared fused in, hidden 7168, inter 2048,
  top-8 + the shared one; 128x128 scale blocks), gate/up and down tuned separately, at T = 8192, 512, 64 and 1 tokens;
- the bf16 MoE GEMMs of DeepSeek-V2-Lite experts (64 routed + 2 shared, hidden 2048, inter 1408, top-6 + 2) at
  the same T;
- the dense FP8 block-scaled GEMM 4096x7168x16384 (V3 o_proj);
- MLA decode (absorbed, latent rows 512 + 64 bf16, block 64) at 16 and 128 heads, B in {1, 64, 128, 256},
  context 1k and 4k: tile configs first at B=128 ctx 4k, then the best few with several grid fills
  (``programs_per_sm`` of the split heuristic) over all shapes, CUDA-graph timed (``tune_mla.py``).
What the sections share (device, timing, ceilings, budgets, the sweep loop) is in ``tuning.py``.

Ceilings measured in the same run: copy bandwidth, bf16 matmul, FP8 ``torch._scaled_mm``. Every candidate's
output is checked once against a torch reference (MoE: the rows of two experts, dequantized, float32; MLA:
``mla_decode_ref``); failing or non-compiling candidates are reported and dropped. Each section has a time
budget: when it runs out, the remaining candidates are skipped (the current config is always measured first).

    python benchmarks/tune_deepseek.py [--out DIR] [--budget-s 230] [--only moe,mla,dense,lite]

Writes DIR/moe.json and DIR/mla_decode.json (DIR = --out, else $OUT, else /tmp): the repo's
``dsinfer/ops/triton/configs/`` tables with the tuned entries replaced, ready to copy over; also
DIR/tune_results.json (every timing) and prints the table and both JSON files.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import tuning  # noqa: E402
from benchmarks.tune_mla import SHAPES as MLA_SHAPES  # noqa: E402
from benchmarks.tune_mla import tune_mla  # noqa: E402
from benchmarks.tuning import LOG, TABLE, Budget, ceilings, rate_note, rel_err, sweep  # noqa: E402

CONFIG_DIR = ROOT / "dsinfer" / "ops" / "triton" / "configs"
BLOCK = (128, 128)


# ---- MoE ----

def _cfg(bm, bn, bk, gm, w, st, mode=None) -> dict:
    """mode: None (the default GEMM), "fuse" (gate/up in one dot), "two" (two dots), "tma" (weights through TMA
    descriptors, two dots), each optionally with "+bkN" (K tile N instead of the grid's) and "+sorted"
    (activations copied into expert order first; with "tma" they are TMA tiles too; gate/up and down must then
    share block_m)."""
    cfg = dict(block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=w, num_stages=st)
    flags = set((mode or "").split("+"))
    if flags & {"fuse", "two"}:
        cfg["fuse_gu"] = "fuse" in flags
    elif "tma" in flags:
        cfg["tma"] = True
    for flag in flags:
        if flag.startswith("bk"):  # "bk128": a K tile of its own
            cfg["block_k"] = int(flag[2:])
        elif flag.startswith("sk"):  # "sk4": K split over 4 programs (dense only, ``ops.triton.split_k``)
            cfg["split_k"] = int(flag[2:])
    if "sorted" in flags:
        cfg["sorted"] = True
    return cfg


def moe_grids(fp8: bool, rows_per_expert: float) -> tuple[list[dict], list[dict]]:
    """(gate/up candidates, down candidates), most promising first, after the current config; block_n = output
    columns per tile (the fused gate/up dot is twice as wide). FP8 tiles keep BLOCK_M x dot width / threads
    <= 64 (the scaled ``acc += dot * s`` holds two float32 tiles); bf16 accumulates in place, so it gets wider
    tiles."""
    bk = 128 if fp8 else 64
    if rows_per_expert >= 128 and fp8:
        # "sorted": the dense FP8 GEMM (A through TMA) reaches ~70% of the FP8 rate with 128 x 128 tiles, the
        # gathered grouped one 42-47%
        gate_up = [(64, 64, 8, 4, 4, "tma+sorted"), (64, 64, 8, 4, 4, "fuse+sorted"), (64, 64, 8, 4, 5, "tma+sorted"),
                   (64, 64, 8, 4, 3, "tma+sorted"), (64, 64, 1, 4, 4, "tma+sorted"),
                   (64, 64, 32, 4, 4, "tma+sorted"), (64, 64, 8, 4, 4, "fuse"), (128, 128, 8, 8, 4, "tma+sorted"),
                   (64, 128, 8, 8, 4, "fuse+sorted"), (128, 64, 8, 8, 4, "tma+sorted")]
        down = [(64, 128, 8, 4, 3), (128, 128, 8, 8, 4, "tma+sorted"), (64, 128, 8, 4, 4, "tma+sorted"),
                (128, 64, 8, 8, 4, "tma+sorted"), (64, 64, 8, 4, 4, "tma+sorted"), (64, 128, 8, 4, 3, "tma"),
                (128, 128, 8, 8, 3, "tma+sorted"), (128, 128, 8, 8, 4, "tma"), (64, 256, 8, 8, 3),
                (64, 128, 8, 4, 4)]
    elif rows_per_expert >= 100:
        gate_up = [(64, 64, 8, 4, 3, "fuse"), (128, 128, 8, 8, 3, "tma+sorted"), (64, 128, 8, 4, 3, "tma+sorted"),
                   (128, 64, 8, 8, 3, "fuse"), (128, 128, 8, 8, 3, "fuse"), (128, 64, 8, 8, 3, "tma+sorted"),
                   (64, 64, 8, 4, 3, "tma+sorted"), (64, 128, 8, 4, 3, "fuse"), (128, 64, 8, 8, 4, "fuse")]
        down = [(64, 128, 8, 4, 3), (128, 128, 8, 8, 3, "tma+sorted"), (64, 128, 8, 4, 3, "tma+sorted"),
                (128, 256, 8, 8, 3, "tma+sorted"), (64, 64, 8, 4, 3, "tma+sorted"), (128, 64, 8, 8, 3, "tma+sorted"),
                (128, 128, 8, 8, 3), (128, 256, 8, 8, 3), (64, 256, 8, 8, 3)]
    elif rows_per_expert >= 12:  # decode batches (weight-bandwidth bound): narrow tiles, deep K pipelines
        gate_up = [(32, 64, 1, 4, 3, "fuse"), (32, 64, 1, 4, 3, "tma"), (32, 64, 8, 4, 4, "fuse"),
                   (64, 64, 8, 4, 3, "fuse"), (32, 128, 8, 4, 3, "fuse"), (32, 64, 1, 4, 3, "two"),
                   (32, 32, 1, 4, 4, "fuse+bk128"), (32, 64, 1, 4, 4, "fuse+bk128"), (32, 32, 1, 4, 5, "two+bk128"),
                   (32, 64, 1, 4, 4, "tma+bk128"), (32, 32, 1, 4, 4, "tma+bk128"), (32, 64, 1, 8, 3, "fuse+bk128"),
                   (64, 32, 1, 4, 4, "fuse+bk128")]
        down = [(32, 128, 1, 4, 3), (32, 128, 1, 4, 3, "tma"), (64, 128, 8, 4, 3), (32, 64, 1, 4, 4),
                (32, 256, 8, 8, 3), (32, 64, 1, 4, 4, "bk128"), (32, 128, 1, 4, 4, "bk128"),
                (32, 64, 1, 4, 4, "tma+bk128"), (32, 32, 1, 4, 5, "bk128"), (32, 128, 1, 8, 3, "bk128"),
                (64, 64, 1, 4, 4, "bk128")]
    else:
        gate_up = [(16, 64, 1, 4, 4, "fuse"), (16, 64, 1, 4, 4, "tma"), (16, 128, 1, 4, 4, "fuse"),
                   (16, 32, 1, 4, 5, "fuse"), (16, 64, 1, 4, 5, "two"), (32, 64, 1, 4, 4, "fuse"),
                   (16, 32, 1, 4, 4, "fuse+bk128"), (16, 64, 1, 4, 4, "fuse+bk128"), (16, 32, 1, 4, 5, "tma+bk128"),
                   (16, 64, 1, 4, 4, "tma+bk128"), (16, 32, 1, 4, 4, "two+bk256"), (16, 64, 1, 8, 3, "fuse+bk256"),
                   (16, 32, 1, 4, 6, "two+bk128"), (16, 16, 1, 4, 6, "two+bk128"),  # batch 1: more programs
                   # batch 1: wide TMA weight tiles (V2-Lite's best in a layer chain, docs/benchmarks.md)
                   (16, 128, 1, 4, 3, "tma+bk128"), (16, 128, 1, 8, 3, "tma+bk128")]
        down = [(16, 128, 1, 4, 4), (16, 128, 1, 4, 4, "tma"), (16, 64, 1, 4, 5), (16, 256, 1, 8, 3),
                (32, 128, 1, 4, 4), (16, 64, 1, 4, 4, "bk128"), (16, 128, 1, 4, 4, "bk128"),
                (16, 64, 1, 4, 4, "tma+bk128"), (16, 32, 1, 4, 5, "bk128"), (16, 64, 1, 4, 3, "bk256"),
                (16, 128, 1, 8, 3, "bk256"), (16, 32, 1, 4, 6, "bk128"), (16, 128, 1, 4, 4, "tma+bk128")]
    return ([_cfg(bm, bn, bk, gm, w, st, *mode) for bm, bn, gm, w, st, *mode in gate_up],
            [_cfg(bm, bn, bk, gm, w, st, *mode) for bm, bn, gm, w, st, *mode in down])


def _fp8_weights(e: int, rows: int, cols: int):
    w = torch.empty(e, rows, cols, device=tuning.DEV, dtype=torch.float8_e4m3fn)
    for i in range(0, e, 16):
        chunk = torch.randn(min(16, e - i), rows, cols, device=tuning.DEV, dtype=torch.bfloat16)
        w[i:i + 16] = (chunk * 64).to(w.dtype)
    # a scale per 128 x 128 block, the last ones partial (V3's fused q_a + kv_a projection has 2112 rows)
    s = torch.rand(e, -(-rows // BLOCK[0]), -(-cols // BLOCK[1]), device=tuning.DEV) * 2e-4 + 1e-4
    return w, s


def _dequant_w(w, s, e):
    return w[e].float() * s[e].repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)


def _dequant_a(a, a_s):
    return a.float() * a_s.repeat_interleave(BLOCK[1], 1)[:, : a.shape[1]] if a_s is not None else a.float()


class MoeGemms:
    """One token count's GEMM inputs, outputs and reference rows, and the two ways to run a candidate:

    - gathered (the default tiles): gate/up reads the quantized hidden rows by ``pair // k``, down the quantized
      intermediate by pair (quantization outside the timing);
    - ``sorted``: gate/up is the fused MoE's own ``sorted_gate_up`` (the copy of the hidden rows into expert order,
      quantized on the way, timed with the GEMM), its output in that order; down takes the intermediate already in
      that order and quantized (outside the timing, as the gathered one) and stores in pair order.

    ``check(rows, ref1, ref2)`` sets the pair rows ``*_err`` compare and their gate/up and down references.
    """

    def __init__(self, x, h_in, w13, s13, w2, s2, ids, weights, k, fp8):
        from dsinfer.ops.triton.fp8 import per_token_group_quant
        from dsinfer.ops.triton.moe import grouped_gemm
        from dsinfer.ops.triton.moe_align import moe_align
        from dsinfer.ops.triton.moe_fused import sorted_gate_up
        from dsinfer.ops.triton.moe_permute import permute_rows

        self.gemm, self.sorted_gate_up, self.permute = grouped_gemm, sorted_gate_up, permute_rows
        self.x, self.h_in, self.w13, self.s13, self.w2, self.s2 = x, h_in, w13, s13, w2, s2
        self.k, self.fp8, self.pairs = k, fp8, h_in.shape[0]
        self.group, self.block = (BLOCK[1], BLOCK) if fp8 else (None, None)
        self.a, self.a_s = per_token_group_quant(x, BLOCK[1]) if fp8 else (x, None)
        self.a2, self.a2_s = per_token_group_quant(h_in, BLOCK[1]) if fp8 else (h_in, None)
        self.weights = weights.reshape(-1).float()
        self.align = functools.cache(functools.partial(moe_align, ids, w13.shape[0]))
        self.inter = torch.empty(self.pairs, w2.shape[2], device=tuning.DEV, dtype=torch.bfloat16)
        self.down_out = torch.empty(self.pairs, w2.shape[1], device=tuning.DEV, dtype=torch.bfloat16)
        self.sorted_inter, self.sorted_down_in = {}, {}
        self.check_rows = self.ref1 = self.ref2 = None
        self.last_gate_up = self.inter, None

    def check(self, rows, ref1, ref2) -> None:
        self.check_rows, self.ref1, self.ref2 = rows, ref1, ref2

    def gate_up(self, cfg):
        al = self.align(cfg["block_m"])
        if not cfg.get("sorted"):
            self.gemm(self.a, self.w13, self.inter, cfg, a_scale=self.a_s, b_scale=self.s13, block_size=self.block,
                      align=al, a_div=self.k, gated=True)
            self.last_gate_up = self.inter, None
            return
        out = self.sorted_gate_up(self.x, self.w13, cfg, al, self.k, self.s13, self.block,
                                  out=self.sorted_inter.get(cfg["block_m"]))
        self.sorted_inter[cfg["block_m"]] = out  # the next call of this block_m writes into it
        self.last_gate_up = out, al[0]

    def gate_up_err(self) -> float:
        out, sorted_ids = self.last_gate_up
        if sorted_ids is None:
            return rel_err(out[self.check_rows], self.ref1)
        ids = sorted_ids.long()
        position = torch.full((self.pairs,), -1, dtype=torch.long, device=ids.device)  # pair -> sorted row
        real = ids < self.pairs
        position[ids[real]] = torch.nonzero(real).squeeze(1)
        return rel_err(out[position[self.check_rows]], self.ref1)

    def down(self, cfg):
        al = self.align(cfg["block_m"])
        if not cfg.get("sorted"):
            self.gemm(self.a2, self.w2, self.down_out, cfg, a_scale=self.a2_s, b_scale=self.s2,
                      block_size=self.block, align=al, topk_weights=self.weights)
            return
        if cfg["block_m"] not in self.sorted_down_in:  # the pair rows of h_in in expert order (a_div 1)
            self.sorted_down_in[cfg["block_m"]] = self.permute(self.h_in, al, group=self.group)
        a2, a2_s = self.sorted_down_in[cfg["block_m"]]
        self.gemm(a2, self.w2, self.down_out, cfg, a_scale=a2_s, b_scale=self.s2, block_size=self.block, align=al,
                  topk_weights=self.weights, sorted_a=True)

    def down_err(self) -> float:
        return rel_err(self.down_out[self.check_rows], self.ref2)


def _best_pair(res1, res2):
    """The fastest (gate/up, down) pair that can run together: both gathered (any block_m each), or both sorted
    with one block_m (the intermediate stays in gate/up's order)."""
    pairs = [(t1 + t2, r1, r2) for r1 in res1 for r2 in res2 for t1, t2 in [(r1[0], r2[0])]
             if bool(r1[1].get("sorted")) == bool(r2[1].get("sorted"))
             and (not r1[1].get("sorted") or r1[1]["block_m"] == r2[1]["block_m"])]
    if not pairs:
        return None
    _, r1, r2 = min(pairs, key=lambda p: p[0])
    return r1, r2


def tune_moe(name: str, routed: int, h: int, inter: int, top_k: int, num_shared: int, fp8: bool, token_counts,
             budget: Budget, table: dict) -> None:
    """The model's stack as it runs: ``routed`` experts then ``num_shared`` shared ones (``layers.moe.FusedExperts``),
    each token a random top-k of the routed ones plus every shared one (weight 1), keyed by the stacked count."""
    from dsinfer.ops.moe import with_shared
    from dsinfer.ops.triton.moe import down_config, moe_config

    dtype = "fp8" if fp8 else "bfloat16"
    e, k = routed + num_shared, top_k + num_shared  # stacked experts, pairs per token
    key = f"{e},{inter},{h},{dtype}"
    if fp8:
        w13, s13 = _fp8_weights(e, 2 * inter, h)
        w2, s2 = _fp8_weights(e, h, inter)
    else:
        w13 = torch.randn(e, 2 * inter, h, device=tuning.DEV, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(e, h, inter, device=tuning.DEV, dtype=torch.bfloat16) * 0.02
        s13 = s2 = None
    wbytes = 1 if fp8 else 2
    for ti, tokens in enumerate(token_counts):
        # the first T gets most of the time, the last what is left
        sub = Budget(budget.left() * (1.0 if ti == len(token_counts) - 1 else (0.6, 0.55, 0.5)[min(ti, 2)]))
        pairs = tokens * k
        rpe = pairs / e
        x = torch.randn(tokens, h, device=tuning.DEV, dtype=torch.bfloat16)
        scores = torch.randn(tokens, routed, device=tuning.DEV).softmax(-1)
        weights, ids = with_shared(*scores.topk(top_k, dim=-1), routed, num_shared)
        touched = int(ids.unique().numel())
        h_in = torch.randn(pairs, inter, device=tuning.DEV, dtype=torch.bfloat16)
        case = MoeGemms(x, h_in, w13, s13, w2, s2, ids, weights, k, fp8)
        # Reference on the pairs of two experts, from the GEMMs' own quantized inputs.
        flat = ids.reshape(-1)
        chk = flat[:2].tolist()
        sel = [(flat == ex).nonzero().squeeze(1) for ex in chk]
        ref1, ref2 = [], []
        a_deq, a2_deq = _dequant_a(case.a, case.a_s), _dequant_a(case.a2, case.a2_s)
        for ex, p in zip(chk, sel):
            w13e = _dequant_w(w13, s13, ex) if fp8 else w13[ex].float()
            w2e = _dequant_w(w2, s2, ex) if fp8 else w2[ex].float()
            gu = a_deq[p // k] @ w13e.T
            ref1.append(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:])
            ref2.append((a2_deq[p] @ w2e.T) * case.weights[p, None])
        del a_deq, a2_deq
        case.check(torch.cat(sel), torch.cat(ref1), torch.cat(ref2))

        current = moe_config(key, rpe, fp8, True)
        grid1, grid2 = moe_grids(fp8, rpe)
        cur1 = {k: v for k, v in current.items() if k != "down"}
        cur2 = down_config(current)
        cands1 = [cur1] + [c for c in grid1 if c != cur1]
        cands2 = [cur2] + [c for c in grid2 if c != cur2]
        label = f"{name} T={tokens}"
        half = Budget(sub.left() * 0.6)
        # A few tokens' GEMMs take microseconds, less than an eager launch costs the host: time graph replays.
        timer = tuning.graph_bench if tokens <= 256 else tuning.bench
        res1 = sweep(f"{label} gate/up", cands1, case.gate_up, case.gate_up_err, half, timer=timer)
        res2 = sweep(f"{label} down", cands2, case.down, case.down_err, sub, timer=timer)
        best_pair = _best_pair(res1, res2)
        if best_pair is None:
            print(f"  {label}: no working config", flush=True)
            continue
        (t1, c1), (t2, c2) = best_pair
        base1 = res1[0][0] if res1[0][1] == cur1 else float("nan")
        base2 = res2[0][0] if res2[0][1] == cur2 else float("nan")
        best = dict(c1)
        diff = {k: v for k, v in c2.items() if c1.get(k) != v and k != "fuse_gu"}
        if c1.get("tma") and not c2.get("tma"):
            diff["tma"] = False
        if diff:
            best["down"] = diff
        table.setdefault(key, {})[_bucket(rpe)] = best
        w_touched = touched * 3 * h * inter * wbytes
        f1, f2 = 4 * pairs * h * inter, 2 * pairs * h * inter
        b1 = 2 / 3 * w_touched + tokens * h * (1 + (not fp8)) + pairs * inter * 2
        b2 = 1 / 3 * w_touched + pairs * inter * (1 + (not fp8)) + pairs * h * 2
        TABLE.append(f"| {name} gate/up | T={tokens} ({touched} experts) | {base1:.4f} | {t1:.4f} | "
                     f"{rate_note(t1, b1, f1, fp8)} | {c1} |")
        TABLE.append(f"| {name} down | T={tokens} | {base2:.4f} | {t2:.4f} | {rate_note(t2, b2, f2, fp8)} | {c2} |")
        tuning.empty_cache()


def _bucket(rows_per_expert: float) -> str:
    """A moe.json bucket name: whole rows, or two digits below one row per expert (batch-1 decode: 6 + 2 of 66
    stack slots is 0.12) so that ``nearest_config``'s 4x window finds it."""
    return str(round(rows_per_expert)) if rows_per_expert >= 1 else f"{rows_per_expert:.2g}"


# V3's FP8 linears that a decode step runs as dense GEMMs, (N, K): the fused q_a + kv_a projection, q_b, o_proj,
# the dense layers' gate/up and down. At decode sizes the untuned tile (64 columns a program) leaves the narrow
# ones with one program per SM or fewer (o_proj: 112 programs; 64 x 7168 x 16384 ran at 42% of the bandwidth).
DENSE_DECODE_SHAPES = [(2112, 7168), (24576, 1536), (7168, 16384), (36864, 7168), (7168, 18432)]


def dense_grid(rows: int) -> list[dict]:
    """FP8 dense candidates for ``rows`` activation rows: prefill tiles past 256 rows; below, weight-streaming
    tiles (narrower column tiles for more programs, K tiles of 128 or 256, deep pipelines, with and without TMA)."""
    if rows > 256:
        return [_cfg(*c) for c in ((128, 128, 128, 8, 8, 3), (64, 128, 128, 8, 4, 3, "tma"),
                                   (128, 128, 128, 8, 8, 3, "tma"), (128, 128, 128, 8, 8, 4), (64, 256, 128, 8, 8, 3),
                                   (64, 128, 128, 8, 4, 4), (128, 128, 128, 8, 8, 4, "tma"), (128, 64, 128, 8, 4, 4))]
    bm = max(16, min(64, 1 << (rows - 1).bit_length()))  # one row tile: the weights stream once
    grid = [(bm, 32, 128, 1, 4, 4), (bm, 16, 128, 1, 4, 5), (bm, 64, 128, 1, 4, 4, "bk256"),
            (bm, 32, 128, 1, 4, 4, "bk256"), (bm, 16, 128, 1, 4, 4, "bk256"), (bm, 32, 128, 1, 4, 6),
            (bm, 128, 128, 1, 4, 3), (bm, 64, 128, 1, 4, 4, "tma"), (bm, 32, 128, 1, 4, 4, "tma"),
            (bm, 128, 128, 1, 8, 3, "tma"), (bm, 32, 128, 1, 2, 5)]
    if bm > 16:  # several row tiles: more programs, the weight tile read again from L2
        grid += [(16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (32, 32, 128, 1, 4, 4)]
    if rows <= 64:  # K split: programs for the SMs the column tiles leave idle, each with a shorter loop
        grid += [(bm, bn, 128, 1, 4, 4, f"{mode}+sk{split}".lstrip("+")) for split in (2, 4, 8, 16)
                 for bn, mode in ((64, ""), (32, ""), (64, "tma"), (128, "tma"))]
    return [_cfg(*c) for c in grid]


def tune_dense(budget: Budget, table: dict, rows_list=(4096,)) -> None:
    """The FP8 block-scaled dense GEMM: V3's o_proj at prefill rows, every decode shape (``DENSE_DECODE_SHAPES``)
    at decode rows (timed as CUDA-graph replays: tens of microseconds). Entries merge into
    ``dense,N,K,fp8`` under the row count."""
    from dsinfer.ops.triton.fp8 import dense_config, per_token_group_quant
    from dsinfer.ops.triton.moe import grouped_gemm

    for m in rows_list:
        if tuning.SMOKE:
            shapes, m = [(256, 512)], min(m, 64)
        else:
            shapes = [(7168, 16384)] if m > 256 else DENSE_DECODE_SHAPES
        for n, k in shapes:
            w, s = _fp8_weights(1, n, k)
            w, s = w[0], s[0]
            x = torch.randn(m, k, device=tuning.DEV, dtype=torch.bfloat16)
            a, a_s = per_token_group_quant(x, BLOCK[1])
            out = torch.empty(m, n, device=tuning.DEV, dtype=torch.bfloat16)
            rows = torch.arange(0, m, 37, device=tuning.DEV)
            ref = _dequant_a(a[rows], a_s[rows]) @ (
                w.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).T
            current = dense_config(m, torch.device(tuning.DEV), n, k)
            cands = [current] + [c for c in dense_grid(m) if c != current]

            def run(cfg, a=a, a_s=a_s, w=w, s=s, out=out):
                grouped_gemm(a, w, out, cfg, a_scale=a_s, b_scale=s, block_size=BLOCK)

            timer = tuning.graph_bench if m <= 256 else tuning.bench
            res = sweep(f"fp8 dense {m}x{n}x{k}", cands, run, lambda out=out, rows=rows, ref=ref:
                        rel_err(out[rows], ref), budget, timer=timer)
            if not res:
                continue
            t, cfg = min(res, key=lambda r: r[0])
            table.setdefault(f"dense,{n},{k},fp8", {})[str(m)] = cfg
            TABLE.append(f"| fp8 dense | {m}x{n}x{k} | {res[0][0]:.4f} | {t:.4f} | "
                         f"{rate_note(t, n * k + m * k * 3 + m * n * 2, 2 * m * n * k, True)} | {cfg} |")


# ---- main ----

def _batch_by_context(spec: str) -> tuple[int, int]:
    batch, _, context = spec.partition("x")
    return int(batch), int(context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"), help="folder for the JSON files")
    parser.add_argument("--budget-s", type=float, default=230.0, help="seconds for all sweeps together")
    parser.add_argument("--only", default="moe,mla,lite,dense", help="comma list of moe, mla, lite, dense")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 512, 64, 1],
                        help="MoE token counts to tune (the first gets most of the budget)")
    parser.add_argument("--mla-shapes", type=_batch_by_context, nargs="+", default=MLA_SHAPES,
                        help="MLA decode shapes BxCTX (the first picks the tiles), e.g. 256x1024 256x4096")
    parser.add_argument("--dense-rows", type=int, nargs="+", default=[4096],
                        help="activation rows of the FP8 dense GEMM tuning: 4096 tunes V3's o_proj at prefill, "
                             "rows <= 256 every V3 decode shape (e.g. --dense-rows 1 16 64)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (tests this script)")
    args = parser.parse_args()
    mla_shapes = args.mla_shapes
    if args.smoke:  # --smoke: tiny shapes on whatever device (CPU interpreter), to test this script
        tuning.SMOKE, mla_shapes = True, [(2, 128), (1, 64)]
        tuning.DEV = "cuda" if torch.cuda.is_available() else "cpu"
    elif not torch.cuda.is_available():
        sys.exit("tune_deepseek.py needs a CUDA device")
    start = time.monotonic()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    moe_table = json.loads((CONFIG_DIR / "moe.json").read_text())
    mla_table = json.loads((CONFIG_DIR / "mla_decode.json").read_text())
    c = ceilings()
    device = torch.cuda.get_device_name() if tuning.DEV == "cuda" else "cpu"
    head = (f"{device}: copy {c['copy'] / 1e12:.2f} TB/s, bf16 {c['bf16'] / 1e12:.0f} "
            f"TFLOP/s, fp8 _scaled_mm {c['fp8'] / 1e12:.0f} TFLOP/s ({time.monotonic() - start:.0f} s)")
    print(head, flush=True)
    only = set(args.only.split(","))

    def save() -> None:
        (out_dir / "moe.json").write_text(json.dumps(moe_table, indent=1) + "\n")
        (out_dir / "mla_decode.json").write_text(json.dumps(mla_table, indent=1) + "\n")
        (out_dir / "tune_results.json").write_text(
            json.dumps(dict(ceilings=c, runs=LOG, table=TABLE), indent=1, default=str))

    share = {"moe": 0.45, "mla": 0.27, "lite": 0.15, "dense": 0.13}
    total = sum(share[s] for s in only if s in share)
    # (routed experts, hidden, inter, top_k, shared experts): the shared ones run as extra experts of the stack
    v3, lite, tokens = (((8, 256, 128, 2, 1), (4, 64, 48, 2, 2), (16,)) if tuning.SMOKE else
                        ((256, 7168, 2048, 8, 1), (64, 2048, 1408, 6, 2), tuple(args.tokens)))
    sections = [
        ("moe", lambda b: tune_moe("V3 fp8", *v3, fp8=True, token_counts=tokens, budget=b, table=moe_table)),
        ("mla", lambda b: tune_mla(b, mla_table, mla_shapes)),
        ("lite", lambda b: tune_moe("V2-Lite bf16", *lite, fp8=False, token_counts=tokens, budget=b,
                                    table=moe_table)),
        ("dense", lambda b: tune_dense(b, moe_table, args.dense_rows)),
    ]
    for name, fn in sections:
        if name not in only:
            continue
        seconds = args.budget_s * share[name] / total
        t0 = time.monotonic()
        print(f"== {name} (budget {seconds:.0f} s)", flush=True)
        try:
            fn(Budget(seconds))
        except Exception:  # noqa: BLE001 (report, keep the other sections)
            traceback.print_exc()
        tuning.empty_cache()
        save()  # after every section: a run cut short keeps what it found
        print(f"== {name} done in {time.monotonic() - t0:.0f} s (total {time.monotonic() - start:.0f} s)", flush=True)
    save()
    print(f"\n{head}")
    print("| kernel | shape | current ms | best ms | best: rates | best config |")
    print("| --- | --- | --- | --- | --- | --- |")
    for line in TABLE:
        print(line)
    print(f"\n{out_dir / 'moe.json'}:\n{json.dumps(moe_table)}")
    print(f"{out_dir / 'mla_decode.json'}:\n{json.dumps(mla_table)}")
    print(f"total {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
