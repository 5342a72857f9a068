"""The short table ``gpu_check.sh`` prints last: each headline figure beside its floor, its target and vLLM's.

    python benchmarks/gpu_summary.py OUT_DIR [SMI_CSV]

Reads, where present, OUT_DIR/latency.json + throughput.json (Llama-3.1-8B), throughput-fp8kv.json (the same
with an FP8 KV cache), latency-v2-lite.json + throughput-v2-lite.json (DeepSeek-V2-Lite), latency-v3.json +
throughput-v3.json (DeepSeek-V3 with fewer layers, FP8) and latency-v4.json / latency-v4-16k.json (a 4-layer
DeepSeek-V4-Flash slice at 1k and 16k context); a model whose files are missing (``--only``) is left out. SMI_CSV
(``gpu_check.sh``'s nvidia-smi samples) adds a line on the clocks while the GPU was busy: a run at the power limit
runs slower clocks, and its figures read against a floor measured by short, cooler runs.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# vLLM 0.26.0 on the same H200 kind (shared/tools/peer-vllm/README.md), for reference
VLLM_LLAMA = {"decode1": "4.95 ms (1.37x)", "decode64": "7.29 ms (1.29x)", "decode256": "17.85 ms (1.51x)",
              "offline": "9,152 tok/s"}
VLLM_V2_LITE = {"decode1": "3.36 ms (2.87x)", "decode64": "10.62 ms (1.36x)", "decode256": "12.50 ms (1.34x)",
                "offline": "6,556 tok/s"}


@dataclass
class Model:
    title: str
    latency: str  # file names under OUT_DIR
    throughput: str
    decode_targets: dict[int, float] = field(default_factory=dict)  # batch -> max step / floor
    prefill_target: float | None = None  # min fraction of the measured matmul rate (prefill 8x2048)
    idle_target: float | None = None  # max % GPU idle between decode steps
    offline_target: float | None = None  # min output tok/s
    hf_target: float | None = None  # min dsinfer / HF ratio
    vllm: dict[str, str] = field(default_factory=dict)


MODELS = [
    Model("Llama-3.1-8B bf16, dummy", "latency.json", "throughput.json", {1: 1.2, 256: 1.3}, 0.55, 5.0, 1e4, 10.0,
          VLLM_LLAMA),
    # the same offline workload with vLLM's --kv-cache-dtype fp8 (bf16 weights; K and V stored in FP8)
    Model("Llama-3.1-8B bf16, FP8 KV cache, dummy", "latency-fp8kv.json", "throughput-fp8kv.json",
          offline_target=1e4),
    Model("DeepSeek-V2-Lite bf16, dummy", "latency-v2-lite.json", "throughput-v2-lite.json",
          {1: 1.5, 64: 1.3, 256: 1.3}, None, 5.0, 3700.0, None, VLLM_V2_LITE),
    Model("DeepSeek-V3 FP8, dummy", "latency-v3.json", "throughput-v3.json"),
    # the 4-layer V4-Flash slice: decode only (its throughput file is never written)
    Model("DeepSeek-V4-Flash bf16, dummy", "latency-v4.json", "throughput-v4.json"),
    Model("DeepSeek-V4-Flash bf16, dummy, 16k context", "latency-v4-16k.json", "throughput-v4-16k.json"),
]


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _ok(flag: bool) -> str:
    return "MET" if flag else "MISSED"


def _target(value: float, limit: float | None, at_most: bool, text: str) -> str:
    if limit is None:
        return ""
    return f"{text} {_ok(value <= limit if at_most else value >= limit)}"


def rows(model: Model, lat: dict, thr: dict) -> list[tuple[str, str, str, str, str, str]]:
    out = []
    for d in lat.get("decode", []):
        batch, limit = d["batch"], model.decode_targets.get(d["batch"])
        name = f"decode B={batch} ctx={d['context']}"
        if "experts_touched" in d:
            name += f" ({d['experts_touched']:.1f}/{d['num_experts']} experts)"
        out.append((name, f"{d['step_ms']:.2f} ms", f"{d['floor_ms']:.2f} ms", f"{d['ratio']:.2f}x",
                    _target(d["ratio"], limit, True, f"<= {limit}x"), model.vllm.get(f"decode{batch}", "")))
    for p in lat.get("prefill", []):
        if p["prefill"] == "8x2048":
            limit = model.prefill_target
            out.append(("prefill 8 x 2048", f"{p['ms']:.0f} ms", f"{p['floor_ms']:.0f} ms",
                        f"{100 * p['of_peak']:.0f}% of mm",
                        _target(p["of_peak"], limit, False, f">= {100 * (limit or 0):.0f}%"), ""))
    if "idle" in lat:
        idle = lat["idle"]["idle_pct"]
        out.append((f"GPU idle, decode B={lat['idle']['batch']}", f"{idle:.2f}%", "", "",
                    _target(idle, model.idle_target, True, f"<= {model.idle_target:g}%"), ""))
    if thr.get("output_throughput"):  # `dsinfer bench throughput --output-json`
        n = thr["num_prompts"]
        limit = model.offline_target
        roof = thr.get("roofline_fraction")
        out.append((f"offline {n}x{thr['prompt_tokens'] // n}/{thr['output_tokens'] // n}",
                    f"{thr['output_throughput']:,.0f} out tok/s", f"{thr['total_token_throughput']:,.0f} total",
                    f"{100 * roof:.0f}% of roofline" if roof else "",
                    _target(thr["output_throughput"], limit, False, f">= {limit or 0:,.0f}"),
                    model.vllm.get("offline", "")))
    if "hf_output_throughput" in thr:
        out.append((f"vs HF, same {thr['hf_num_prompts']}x{thr['prompt_tokens'] // thr['num_prompts']}/"
                    f"{thr['hf_output_len']}", f"{thr['ratio_vs_hf']:.1f}x",
                    f"{thr['dsinfer_subset_output_throughput']:,.0f} vs {thr['hf_output_throughput']:,.0f}",
                    f"{thr['identical_outputs']}/{thr['hf_num_prompts']} same",
                    _target(thr["ratio_vs_hf"], model.hf_target, False, f">= {model.hf_target or 0:g}x"), ""))
        out.append(("full run vs HF subset", f"{thr['ratio_full_vs_hf_subset']:.1f}x", "", "",
                    _target(thr["ratio_full_vs_hf_subset"], model.hf_target, False, f">= {model.hf_target or 0:g}x"),
                    ""))
    return out


# nvidia-smi's clocks_event_reasons (formerly clocks_throttle_reasons) bits that lower the clocks under load
CLOCK_REASONS = {0x4: "power cap", 0x8: "HW slowdown", 0x20: "SW thermal", 0x40: "HW thermal", 0x80: "power brake"}


def clock_line(path: Path) -> str | None:
    """SM clock percentiles, power and the clock-lowering reasons over the samples with the GPU >= 90% busy.
    Sample lines: utilization %, SM MHz, memory MHz, power W, power limit W, temperature C, reasons bitmask."""
    busy = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = [p.strip() for p in line.split(",")]
        try:
            util, sm, _mem, power, limit, temp = (float(p) for p in parts[:6])
            reasons = int(parts[6], 16)
        except (ValueError, IndexError):  # a header, "[N/A]" or a line cut by the sampler's end
            continue
        if util >= 90:
            busy.append((sm, power, limit, temp, reasons))
    if not busy:
        return None
    clocks = sorted(b[0] for b in busy)
    seen = Counter(name for *_, r in busy for bit, name in CLOCK_REASONS.items() if r & bit)
    why = ", ".join(f"{name} {100 * n / len(busy):.0f}%" for name, n in seen.most_common()) or "none"
    return (f"GPU busy in {len(busy)} samples: SM clock p10/p50/p90 {clocks[len(clocks) // 10]:.0f} / "
            f"{statistics.median(clocks):.0f} / {clocks[9 * len(clocks) // 10]:.0f} MHz, power up to "
            f"{max(b[1] for b in busy):.0f} of {busy[0][2]:.0f} W, up to {max(b[3] for b in busy):.0f} C; "
            f"clocks lowered by: {why}")


def title(model: Model, lat: dict, thr: dict) -> str:
    layers = lat.get("num_hidden_layers") or (thr.get("hf_overrides") or {}).get("num_hidden_layers")
    return f"{model.title}, {layers} layers" if layers else model.title


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    header = ("workload", "measured", "floor", "ratio", "target", "vLLM 0.26")
    table: list[tuple[str, ...]] = [header]
    ceilings = None
    for model in MODELS:
        lat, thr = load(out_dir / model.latency), load(out_dir / model.throughput)
        if not (lat or thr):
            continue
        ceilings = ceilings or lat
        table.append((f"-- {title(model, lat, thr)}", "", "", "", "", ""))
        table += rows(model, lat, thr)
    if ceilings:
        fp8 = ceilings.get("fp8_matmul_rate")
        print(f"ceilings measured in this run: copy {ceilings['bandwidth'] / 1e12:.2f} TB/s, "
              f"bf16 matmul {ceilings['matmul_rate'] / 1e12:.0f} TFLOP/s"
              + (f", FP8 matmul {fp8 / 1e12:.0f} TFLOP/s" if fp8 else ""))
    clocks = clock_line(Path(sys.argv[2])) if len(sys.argv) > 2 else None
    if clocks:
        print(clocks)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
