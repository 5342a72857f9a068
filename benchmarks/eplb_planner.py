"""The EPLB planner on synthetic loads shaped like DeepSeek-V3's: moe_lb before and after.

Each of ``--layers`` MoE layers gets its own Zipf(s) popularity over the 256 experts (a random permutation per
layer: which experts are hot differs by layer), and ``--tokens`` tokens each pick ``--top-k`` distinct experts
by it (Gumbel top-k sampling without replacement, as a router picks k distinct experts). moe_lb of a layer is
its slowest EP rank's load over the mean rank load (1.0 is perfect); the figures are averaged over the layers.

Printed per EP size and Zipf exponent:
- ``static``: no EPLB, experts in order (rank r holds experts [r E / R, (r + 1) E / R));
- ``packed``: the planner without redundant experts (placement only);
- ``eplb +N``: the planner with N redundant experts per rank, the hierarchical policy (8 expert groups over
  nodes of 8 GPUs, as DeepSeek's prefill) and the global one (as DeepSeek's decode).

    python benchmarks/eplb_planner.py                      # EP 8 / 32 / 64, Zipf 1.0 / 1.2 / 1.5
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dsinfer.distributed.eplb.planner import moe_lb, rebalance_experts, static_placement


def zipf_loads(num_layers: int, num_experts: int, num_tokens: int, top_k: int, s: float,
               rng: np.random.Generator) -> np.ndarray:
    """[layers, experts] token counts: each token's k distinct experts drawn by a per-layer Zipf(s) popularity."""
    loads = np.zeros((num_layers, num_experts))
    for layer in range(num_layers):
        log_p = -s * np.log(rng.permutation(num_experts) + 1.0)
        keys = log_p + rng.gumbel(size=(num_tokens, num_experts))
        chosen = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
        loads[layer] = np.bincount(chosen.reshape(-1), minlength=num_experts)
    return loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--groups", type=int, default=8, help="expert groups (DeepSeek-V3's n_group)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=58, help="MoE layers (DeepSeek-V3: 58)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the load window")
    parser.add_argument("--ep", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--zipf", type=float, nargs="+", default=[1.0, 1.2, 1.5])
    parser.add_argument("--redundant-per-gpu", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    print(f"{args.experts} experts in {args.groups} groups, top-{args.top_k}, {args.layers} layers, "
          f"{args.tokens} tokens; {args.redundant_per_gpu} redundant expert(s) per GPU; moe_lb = max/mean rank load, "
          "mean over layers (worst layer)")
    print(f"{'EP':>3} {'zipf':>5} {'static':>14} {'packed':>14} {'eplb hier.':>14} {'eplb global':>14} {'plan s':>7}")
    for s in args.zipf:
        loads = zipf_loads(args.layers, args.experts, args.tokens, args.top_k, s, rng)
        for ep in args.ep:
            nodes = max(1, ep // args.gpus_per_node)
            physical = args.experts + args.redundant_per_gpu * ep
            static = moe_lb(loads, static_placement(args.layers, args.experts, args.experts), ep)
            packed = moe_lb(loads, rebalance_experts(loads, args.experts, args.groups, nodes, ep), ep)
            hier = moe_lb(loads, rebalance_experts(loads, physical, args.groups, nodes, ep, "hierarchical"), ep) \
                if args.groups % nodes == 0 else None
            start = time.perf_counter()
            flat = moe_lb(loads, rebalance_experts(loads, physical, args.groups, nodes, ep, "global"), ep)
            seconds = time.perf_counter() - start

            def cell(lb: np.ndarray | None) -> str:
                return "-" if lb is None else f"{lb.mean():.3f} ({lb.max():.3f})"

            print(f"{ep:>3} {s:>5.2f} {cell(static):>14} {cell(packed):>14} {cell(hier):>14} {cell(flat):>14} "
                  f"{seconds:>7.2f}")


if __name__ == "__main__":
    main()
