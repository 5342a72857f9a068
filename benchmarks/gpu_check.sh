#!/usr/bin/env bash
# Every GPU test and benchmark in one device call (about 6-8 minutes on one H200); a short summary table last.
#
#   bash benchmarks/gpu_check.sh            # logs and JSON under $OUT (the device tool's folder) or /tmp
#
# Runs: pytest on every test file with a `gpu` mark; roofline.py (the two ceilings); kernels.py (each Triton op vs
# its torch reference); deepseek_kernels.py (MLA decode/prefill, fused MoE bf16/FP8, FP8 GEMM); latency.py (decode step vs batch at 1k context, prefill vs length, GPU idle between
# engine steps); throughput.py (Llama-3.1-8B dummy weights, 512 x 1000 in / 1000 out, and an HF subset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dsinfer-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
MODEL=benchmarks/configs/llama-3.1-8b
status=0
step() {  # step NAME CMD...: run, log to $OUT/NAME.log, remember a failure
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$OUT/$name.log" || status=1
    echo "=== $name took $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
mapfile -t GPU_TESTS < <(grep -rl "mark.gpu" tests --include='*.py' | sort -u)
step pytest "$PY" -m pytest "${GPU_TESTS[@]}" -m gpu -q -p no:cacheprovider
step roofline "$PY" benchmarks/roofline.py
step kernels "$PY" benchmarks/kernels.py
step deepseek_kernels "$PY" benchmarks/deepseek_kernels.py
step latency "$PY" benchmarks/latency.py --model "$MODEL" --json-out "$OUT/latency.json"
step throughput "$PY" benchmarks/throughput.py --device cuda --dtype bfloat16 --load-format dummy --model "$MODEL" \
    --num-prompts 512 --input-len 1000 --output-len 1000 --max-num-seqs 256 --max-num-batched-tokens 8192 \
    --gpu-memory-utilization 0.8 --compare-hf --hf-num-prompts 32 --hf-output-len 100 \
    --json-out "$OUT/throughput.json"
echo
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -1
"$PY" benchmarks/gpu_summary.py "$OUT" || status=1
exit $status
