"""The short table ``gpu_check.sh`` prints last: each headline figure beside its floor, its target and vLLM's.

    python benchmarks/gpu_summary.py OUT_DIR   # reads OUT_DIR/latency.json and OUT_DIR/throughput.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# vLLM 0.26.0 on the same H200 kind (shared/tools/peer-vllm/README.md), for reference
VLLM = {"decode1": "4.95 ms (1.37x)", "decode256": "17.85 ms (1.51x)", "offline": "9,152 tok/s"}


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def rows(lat: dict, thr: dict) -> list[tuple[str, str, str, str, str, str]]:
    out = []
    for d in lat.get("decode", []):
        if d["batch"] in (1, 256):
            target = 1.2 if d["batch"] == 1 else 1.3
            out.append((f"decode B={d['batch']} ctx={d['context']}", f"{d['step_ms']:.2f} ms",
                        f"{d['floor_ms']:.2f} ms", f"{d['ratio']:.2f}x", f"<= {target}x {_ok(d['ratio'] <= target)}",
                        VLLM.get(f"decode{d['batch']}", "")))
    for p in lat.get("prefill", []):
        if p["prefill"] == "8x2048":
            out.append(("prefill 8 x 2048", f"{p['ms']:.0f} ms", f"{p['floor_ms']:.0f} ms",
                        f"{100 * p['of_peak']:.0f}% of mm", f">= 55% {_ok(p['of_peak'] >= 0.55)}", ""))
    if "idle" in lat:
        idle = lat["idle"]["idle_pct"]
        out.append((f"GPU idle, decode B={lat['idle']['batch']}", f"{idle:.2f}%", "", "", f"<= 5% {_ok(idle <= 5)}",
                    ""))
    if thr.get("results"):
        r = thr["results"][0]
        a = thr["args"]
        out.append((f"offline {a['num_prompts']}x{a['input_len']}/{a['output_len']}",
                    f"{r['output_tok_s']:,.0f} tok/s", "", "", f">= 10,000 {_ok(r['output_tok_s'] >= 1e4)}",
                    VLLM["offline"]))
    if "subset" in thr:
        s = thr["subset"]
        out.append((f"vs HF, same {s['num_prompts']}x{thr['args']['input_len']}/{s['output_len']}",
                    f"{s['ratio']:.1f}x", "", f"{s['identical_outputs']}/{s['num_prompts']} same",
                    f">= 10x {_ok(s['ratio'] >= 10)}", ""))
        out.append(("full run vs HF subset", f"{thr['ratio_full_vs_hf_subset']:.1f}x", "", "",
                    f">= 10x {_ok(thr['ratio_full_vs_hf_subset'] >= 10)}", ""))
    return out


def _ok(flag: bool) -> str:
    return "MET" if flag else "MISSED"


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    lat, thr = load(out_dir / "latency.json"), load(out_dir / "throughput.json")
    if lat:
        print(f"ceilings measured in this run: copy {lat['bandwidth'] / 1e12:.2f} TB/s, "
              f"bf16 matmul {lat['matmul_rate'] / 1e12:.0f} TFLOP/s")
    header = ("workload (Llama-3.1-8B bf16, dummy)", "measured", "floor", "ratio", "target", "vLLM 0.26")
    table = [header, *rows(lat, thr)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
