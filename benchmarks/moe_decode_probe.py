"""Decode-sized fused MoE, as a model step runs it: a chain of MoE layers (distinct expert weights per layer, each
layer's output the next one's input) replayed from one CUDA graph, per tile config, against the floor of the
expert bytes the routing touches. For choosing decode tiles (split-K among them) where the tuner's one-launch
timings are dominated by launch latency.

    python3 benchmarks/moe_decode_probe.py [--only v2-lite,v3] [--tokens 1 8] [--pairs 0 5] [--buckets]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.roofline import capture_one_call, measure_bandwidth  # noqa: E402
from benchmarks.tuning import bench  # noqa: E402

# name: (routed, shared, hidden, inter, top_k, fp8, layers in the chain)
MODELS = {"v2-lite": (64, 2, 2048, 1408, 6, False, 26), "v3": (256, 1, 7168, 2048, 8, True, 4)}


def _tma(bn: int, bk: int, warps: int, stages: int, **extra) -> dict:
    return dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, tma=True, **extra)


# (gate/up tile, down tile) pairs tried after the table's config; None = the table's own
PAIRS = [(_tma(128, 128, 8, 3), _tma(128, 128, 4, 4)), (_tma(128, 128, 8, 3), None),
         (None, _tma(128, 128, 4, 4)), (_tma(64, 256, 4, 3), _tma(128, 128, 4, 4)),
         (_tma(128, 64, 8, 4), _tma(128, 128, 4, 4)), (_tma(128, 128, 4, 3), _tma(128, 128, 4, 4)),
         (_tma(256, 64, 8, 3), _tma(128, 128, 4, 4)), (_tma(128, 128, 8, 3), _tma(256, 128, 8, 3)),
         (_tma(128, 128, 8, 4), _tma(128, 128, 8, 4)),
         # tiles that fit 64-row blocks' shared memory (a 64 x 128 x 128 gate/up tile at 3 stages does not)
         (_tma(64, 128, 4, 4), _tma(128, 128, 4, 3)), (_tma(128, 64, 8, 3), _tma(256, 64, 8, 3)),
         (_tma(64, 128, 4, 3), _tma(128, 128, 8, 3))]


def _candidates(current: dict, pairs: list[int] | None = None,
                others: dict[str, dict] | None = None) -> list[tuple[str, dict]]:
    """(label, config): the table's config first and again last (the spread of the two is the noise); between
    them the ``others`` (the table's configs of the other buckets: whether the bucket boundaries sit right), then
    the PAIRS (every key of both tiles given: a down tile does not inherit the gate/up's)."""
    from dsinfer.ops.triton.moe import down_config

    table_up = {"tma": False, **{k: v for k, v in current.items() if k != "down"}}
    table_down = {"tma": False, "fuse_gu": False, **down_config(current)}
    out = [("table", current)]
    out += [(f"bucket {name}", cfg) for name, cfg in (others or {}).items() if cfg != current]
    for up, down in (PAIRS if pairs is None else [PAIRS[i] for i in pairs]):
        g = {**table_up, "fuse_gu": False, **up} if up else table_up
        d = {**table_down, **down} if down else table_down
        label = f"gate/up {up or 'table'}, down {down or 'table'}"
        out.append((label, {**g, "down": {k: v for k, v in d.items() if g.get(k) != v or k == "tma"}}))
    out.append(("table again", current))
    return out


def run_model(model: str, token_counts: list[int], bw: float, pairs: list[int] | None = None,
              buckets: bool = False) -> None:
    from dsinfer import envs
    from dsinfer.models.deepseek.blocks import FUSED_SHARED_MAX_TOKENS, FUSED_SHARED_MAX_TOKENS_BESIDE
    from dsinfer.ops.moe import with_shared
    from dsinfer.ops.triton.moe import _config_table, moe_config
    from dsinfer.ops.triton.moe_fused import fused_moe_triton

    routed, shared, hidden, inter, top_k, fp8, num_layers = MODELS[model]
    e = routed + shared
    wdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    block = (128, 128) if fp8 else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    def rand(*shape):  # filled 16 experts at a time (a float32 temporary of a whole V3 stack is 30 GB)
        w = torch.empty(*shape, device="cuda", dtype=wdt)
        for i in range(0, shape[0], 16):
            w[i:i + 16] = torch.randn(min(16, shape[0] - i), *shape[1:], device="cuda", generator=gen) * (
                1.0 if fp8 else 0.02)
        return w

    for _ in range(num_layers):
        w13, w2 = rand(e, 2 * inter, hidden), rand(e, hidden, inter)
        scales = ((torch.rand(e, 2 * inter // 128, hidden // 128, device="cuda") * 1e-3,
                   torch.rand(e, hidden // 128, inter // 128, device="cuda") * 1e-3) if fp8 else (None, None))
        layers.append((w13, w2, *scales))
    key = f"{e},{inter},{hidden},{'fp8' if fp8 else 'bfloat16'}"
    wbytes = 1 if fp8 else 2
    others = _config_table().get(key, {}) if buckets else None
    for tokens in token_counts:
        x0 = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        # as the model runs it: the shared experts are slots of the grouped GEMM up to FUSED_SHARED_MAX_TOKENS,
        # dense GEMMs beside it past that (not timed here: only the grouped GEMM's routed slots)
        fused_max = FUSED_SHARED_MAX_TOKENS_BESIDE if envs.SIDE_STREAM.get() else FUSED_SHARED_MAX_TOKENS
        in_stack = shared if tokens <= fused_max else 0
        routes = []
        for _ in range(num_layers):
            scores = torch.randn(tokens, routed, device="cuda", generator=gen).softmax(-1)
            routes.append(with_shared(*scores.topk(top_k, dim=-1), routed, in_stack))
        touched = sum(int(ids.unique().numel()) for _, ids in routes)
        floor_us = touched * 3 * hidden * inter * wbytes / bw * 1e6 / num_layers
        current = moe_config(key, tokens * (top_k + in_stack) / e, fp8, True)
        print(f"\n{model} T={tokens}: {num_layers} layers, {touched / num_layers:.1f} experts per layer, floor "
              f"{floor_us:.2f} us per layer (copy {bw / 1e12:.2f} TB/s); table config {current}")
        print("| config | us per layer | of floor | max diff vs table |")
        print("| --- | --- | --- | --- |")
        ref = None
        for label, cfg in _candidates(current, pairs, others):
            def chain(cfg=cfg, x0=x0, routes=routes, layers=layers):
                x = x0
                for (w13, w2, s13, s2), (weights, ids) in zip(layers, routes):
                    x = fused_moe_triton(x, w13, w2, weights, ids, w13_scale_inv=s13, w2_scale_inv=s2,
                                         block_size=block, config=cfg)
                return x
            try:
                out = chain().float()
                torch.cuda.synchronize()
                graph = capture_one_call(chain)
                us = bench(graph.replay, 50) * 1e3 / num_layers
            except Exception as exc:  # noqa: BLE001 (a tile that does not compile or fit)
                print(f"| {label} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} | | |")
                continue
            ref = out if ref is None else ref
            diff = (out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            print(f"| {label} | {us:.2f} | {us / floor_us:.2f}x | {diff:.2e} |", flush=True)
            del graph
        torch.cuda.empty_cache()


def main() -> None:  # one model at a time: run_model's weights are freed when it returns
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="v2-lite,v3")
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--pairs", type=int, nargs="*", default=None, help="indices into PAIRS (default: all)")
    p.add_argument("--buckets", action="store_true", help="also time the other buckets' configs of the table")
    args = p.parse_args()
    bw = measure_bandwidth()
    for model in args.only.split(","):
        run_model(model, args.tokens, bw, args.pairs, args.buckets)


if __name__ == "__main__":
    main()
