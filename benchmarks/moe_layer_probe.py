"""Whole DeepSeek MoE blocks as a decode step runs them (router, routed experts, shared experts), a chain of layers
with distinct dummy weights replayed from one CUDA graph, in each way the shared experts can run: inside the
grouped GEMM ("fused"), as dense GEMMs after it on the same stream ("after"), or as dense GEMMs on a side stream
beside the router and the routed experts ("beside", ``DSINFER_SIDE_STREAM``).

    python3 benchmarks/moe_layer_probe.py [--model benchmarks/configs/deepseek-v2-lite] [--tokens 1 64 256]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.roofline import capture_one_call  # noqa: E402
from benchmarks.tuning import bench  # noqa: E402

MODES = {"fused": (10**9, False), "after": (0, False), "beside": (0, True)}  # (shared fused up to, overlap)


def build_layers(cfg: dict, num_layers: int) -> list[torch.nn.Module]:
    from dsinfer.layers.fp8_linear import Fp8Config
    from dsinfer.models.deepseek.blocks import DeepseekMoE, router_config
    from dsinfer.models.deepseek.model import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from dsinfer.models.weights import init_dummy_weights

    variant = (DeepseekV3ForCausalLM if "V3" in cfg["architectures"][0] else DeepseekV2ForCausalLM).variant
    quant = Fp8Config.from_hf(cfg)
    layers = []
    for i in range(num_layers):
        with torch.device("cuda"):
            layer = DeepseekMoE(cfg, quant, router_config(cfg, variant["router"]))
        init_dummy_weights(layer, float(cfg.get("initializer_range", 0.02)), seed=i)
        for module in layer.modules():
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        layers.append(layer)
    return layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="benchmarks/configs/deepseek-v2-lite")
    p.add_argument("--layers", type=int, default=26, help="MoE layers in the chain (distinct weights)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512])
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    from dsinfer.layers.streams import SideStream
    from dsinfer.models.deepseek import blocks

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    torch.set_default_dtype(torch.bfloat16)
    layers = build_layers(cfg, args.layers)
    hidden = cfg["hidden_size"]
    side = SideStream()
    print(f"\n{cfg['architectures'][0]}: {args.layers} MoE layers; us per layer, CUDA-graph replay of the chain")
    modes = args.modes.split(",")
    print("| tokens | " + " | ".join(modes) + " | one layer's max diff to 'after' (relative) |")
    print("| --- | " + " | ".join("---" for _ in modes) + " | --- |")
    for tokens in args.tokens:
        x0 = torch.randn(tokens, hidden, device="cuda") * 0.5
        row, outs = [], {}
        for mode in modes:
            blocks.FUSED_SHARED_MAX_TOKENS = blocks.FUSED_SHARED_MAX_TOKENS_BESIDE = MODES[mode][0]
            for layer in layers:
                layer.side_stream = side if MODES[mode][1] else None
            # graphed=True: the path a CUDA graph takes (here eagerly, then captured)
            outs[mode] = layers[0](x0, graphed=True).float()  # one layer: a chain's routing amplifies rounding

            def chain(x0=x0):
                x = x0
                for layer in layers:  # the residual keeps the scale (and so the routing) from collapsing
                    x = x + layer(x, graphed=True)
                return x

            graph = capture_one_call(chain)
            row.append(bench(graph.replay, 100) * 1e3 / len(layers))
            del graph
        ref = outs.get("after")
        diff = ", ".join(f"{m} {(o - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30):.1e}"
                         for m, o in outs.items() if m != "after") if ref is not None else ""
        print(f"| {tokens} | " + " | ".join(f"{us:.2f}" for us in row) + f" | {diff} |", flush=True)


if __name__ == "__main__":
    main()
