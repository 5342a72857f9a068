#!/usr/bin/env bash
# Every GPU test and benchmark (one H200; a short summary table last, after a line on the SM clock, power and
# clock-lowering reasons while the GPU was busy). All parts take longer than one device call allows (600 s): run
# `--only tests,kernels` (~4 min), `--only llama` (~6 min) and `--only deepseek` (~3 min) as three calls.
#
#   bash benchmarks/gpu_check.sh                  # everything; logs + JSON under $OUT (the device tool's) or /tmp
#   bash benchmarks/gpu_check.sh --only deepseek  # one part, or several: --only tests,kernels
#
# Parts (in this order):
#   tests     pytest on every test file with a `gpu` mark
#   kernels   roofline.py (the ceilings); kernels.py (each Triton op vs its torch reference); deepseek_kernels.py
#             (MLA decode/prefill, fused MoE bf16/FP8, FP8 GEMM)
#   llama     Llama-3.1-8B dummy bf16: `dsinfer bench latency --batch-sizes/--prefill` ("latency": decode step vs
#             batch at 1k context, prefill vs length, GPU idle between engine steps); `dsinfer bench throughput`
#             (512 x 1000 in / 1000 out, two runs, the faster kept, with its roofline; HF on 32 x 1000 / 1000, the
#             workload's lengths, beside dsinfer on the same subset); the same 512 x 1000 / 1000 with an FP8 KV
#             cache
#   deepseek  DeepSeek-V2-Lite dummy bf16 and DeepSeek-V3 dummy FP8 cut to 5 layers (3 dense + 2 MoE, no MTP):
#             "latency" (decode B=1/64/256 at 1k context vs the floor of the experts actually routed to, prefill);
#             "throughput" (V2-Lite 512 x 1000 / 100 with HF on 32 prompts; V3 256 x 1000 / 100; two runs
#             each, the faster kept: a fresh machine still JIT-compiles a few kernels in the first one)
#   v4        DeepSeek-V4-Flash cut to 4 layers (benchmarks/configs/deepseek-v4-flash-4l: sliding, CSA, CSA, HCA at
#             the real widths, 256 experts top-6, hash routing in the first) dummy bf16: "latency" decode B=1/64/256
#             at 1k context in CUDA graphs vs the floor (weights of the experts routed to + window keys and the
#             compressed entries a step reads), and a 1k-token prefill (eager) (~3 min)
#   v4-16k    the same slice at 16k context, decode only (~3 min)
#   pareto    not in "all": benchmarks/pareto_vs_vllm.py, Llama-3.1-8B dummy bf16 served by dsinfer then by vLLM 0.26
#             (`vllm serve`, from ../shared/tools/peer-vllm's wheels installed in /tmp/peer-vllm/pkgs by its
#             device_install.sh; uvicorn, watchfiles, prometheus-fastapi-instrumentator and
#             model-hosting-container-standards carried in .whl and installed in /tmp/site), a concurrency sweep of
#             `dsinfer bench sweep`'s client, one Pareto PNG; without vLLM installed, dsinfer alone (~5 min)
#   pareto-v2-lite  not in "all": the same for DeepSeek-V2-Lite on a random checkpoint with transformers' init
#             (make_random_ckpt.py into /tmp/ckpt, realistic routing) (~7 min)
#   ops       not in "all": the CPU-sized op tests (no `gpu` mark) on CUDA through their `device` fixture, which
#             takes the GPU when there is one (session 7 found an FP8 tile that compiled only in the interpreter)
#   profile   not in "all": profile_decode.py --replay (the kernels of the decode graph replays, per step) for
#             Llama-3.1-8B at B=1 and 256 and DeepSeek-V2-Lite at B=1, 64 and 256, and --prefill of one
#             1024-token prompt for both (eager: GPU busy against wall shows the host's share) (~3 min)
set -uo pipefail
cd "$(dirname "$0")/.."
ONLY=all
while [ $# -gt 0 ]; do
    case $1 in
        --only) ONLY=${2:?--only needs tests, kernels, llama or deepseek (comma-separated)}; shift 2 ;;
        --only=*) ONLY=${1#--only=}; shift ;;
        -h|--help) sed -n '2,/^set -uo/{/^set -uo/d;p}' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
for part in ${ONLY//,/ }; do
    case $part in all|tests|kernels|llama|deepseek|v4|v4-16k|ops|profile|pareto|pareto-v2-lite) ;; *) echo "unknown part: $part" >&2; exit 2 ;; esac
done
want() { [[ ,$ONLY, == *,all,* || ,$ONLY, == *,$1,* ]]; }
OUT=${OUT:-/tmp/dsinfer-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
LLAMA=benchmarks/configs/llama-3.1-8b
V2LITE=benchmarks/configs/deepseek-v2-lite
V3=benchmarks/configs/deepseek-v3
V3_5L='{"num_hidden_layers": 5, "first_k_dense_replace": 3, "num_nextn_predict_layers": 0}'
V4_4L=benchmarks/configs/deepseek-v4-flash-4l
DUMMY=(--device cuda --dtype bfloat16 --load-format dummy)
# `dsinfer bench latency` with the runner's step tables: dummy bf16 weights, 85% of the GPU, 8k tokens a sequence
LATENCY=("$PY" -m dsinfer.bench latency "${DUMMY[@]}" --gpu-memory-utilization 0.85 --max-model-len 8192)
THROUGHPUT=("$PY" -m dsinfer.bench throughput "${DUMMY[@]}" --disable-tqdm)
# The device tool stops a command at 600 s: steps get what is left of GPU_CHECK_BUDGET_S, so the summary of the
# steps that finished is always printed.
BUDGET_S=${GPU_CHECK_BUDGET_S:-575}
status=0
step() {  # step NAME CMD...: run, log to $OUT/NAME.log, remember a failure
    local name=$1; shift
    local left=$((BUDGET_S - SECONDS))
    if [ "$left" -lt 30 ]; then
        echo "=== $name: SKIPPED, ${left} s of the ${BUDGET_S} s budget left (run it alone with --only)"
        status=1
        return
    fi
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout -k 5 "$left" "$@" 2>&1 | tee "$OUT/$name.log" || status=1
    echo "=== $name took $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
# Busy clocks, power and why clocks dropped, sampled every 200 ms (summarized by gpu_summary.py; outside $OUT,
# whose file count the device tool limits)
SMI_CSV=$(mktemp --suffix=.csv /tmp/dsinfer-smi-XXXXXX)
REASONS=clocks_event_reasons.active
nvidia-smi --query-gpu=$REASONS --format=csv,noheader >/dev/null 2>&1 || REASONS=clocks_throttle_reasons.active
nvidia-smi --query-gpu=utilization.gpu,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,$REASONS \
    --format=csv,noheader,nounits -lms 200 > "$SMI_CSV" 2>/dev/null &
SMI_PID=$!
trap 'kill $SMI_PID 2>/dev/null' EXIT
if want tests; then
    # two processes, ops and the rest: run as one (session 12, 103 tests) the process died twice without a
    # summary line, while each half passed on its own
    mapfile -t GPU_OPS < <(grep -rl "mark.gpu" tests/ops --include='*.py' | sort -u)
    mapfile -t GPU_REST < <(grep -rl "mark.gpu" tests --include='*.py' | grep -v '^tests/ops/' | sort -u)
    step pytest "$PY" -m pytest "${GPU_REST[@]}" -m gpu  # pyproject's addopts: -q (a second -q hides the count)
    step pytest-gpu-ops "$PY" -m pytest "${GPU_OPS[@]}" -m gpu
fi
if [[ ,$ONLY, == *,ops,* ]]; then
    step pytest-ops "$PY" -m pytest tests/ops -m "not gpu"
fi
if want kernels; then
    step roofline "$PY" benchmarks/roofline.py
    step kernels "$PY" benchmarks/kernels.py
    step deepseek_kernels "$PY" benchmarks/deepseek_kernels.py
fi
if want llama; then
    step latency "${LATENCY[@]}" --model "$LLAMA" --batch-sizes 1 64 256 --prefill 2048 8x2048 \
        --output-json "$OUT/latency.json"
    step throughput "${THROUGHPUT[@]}" --model "$LLAMA" \
        --num-prompts 512 --input-len 1000 --output-len 1000 --max-num-seqs 256 \
        --gpu-memory-utilization 0.8 --compare-hf --hf-num-prompts 32 --hf-output-len 1000 --num-iters 2 \
        --output-json "$OUT/throughput.json"
    step throughput-fp8kv "${THROUGHPUT[@]}" --model "$LLAMA" \
        --num-prompts 512 --input-len 1000 --output-len 1000 --max-num-seqs 256 \
        --gpu-memory-utilization 0.8 --kv-cache-dtype fp8 --output-json "$OUT/throughput-fp8kv.json"
fi
if want deepseek; then
    step latency-v2-lite "${LATENCY[@]}" --model "$V2LITE" --batch-sizes 1 64 256 \
        --prefill 256 1024 4096 8x2048 --steps 30 --output-json "$OUT/latency-v2-lite.json"
    # dsinfer's KV cache stops at max_num_seqs x max_model_len (9 GB here), which leaves room for HF's weights
    step throughput-v2-lite "${THROUGHPUT[@]}" --model "$V2LITE" \
        --num-prompts 512 --input-len 1000 --output-len 100 --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --gpu-memory-utilization 0.8 --compare-hf --hf-num-prompts 32 --hf-output-len 100 --num-iters 2 \
        --output-json "$OUT/throughput-v2-lite.json"
    step latency-v3 "${LATENCY[@]}" --model "$V3" --hf-overrides "$V3_5L" --batch-sizes 1 64 256 \
        --prefill 1024 8x2048 --steps 30 --idle-batch 0 --output-json "$OUT/latency-v3.json"
    step throughput-v3 "${THROUGHPUT[@]}" --model "$V3" --hf-overrides "$V3_5L" \
        --num-prompts 256 --input-len 1000 --output-len 100 --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --gpu-memory-utilization 0.8 --num-iters 2 --output-json "$OUT/throughput-v3.json"
fi
# V4's decode graphs gather max_model_len / rate entries a step: max_model_len just above the context
if want v4; then
    step latency-v4 "${LATENCY[@]}" --model "$V4_4L" --batch-sizes 1 64 256 --context 1024 \
        --max-model-len 1152 --prefill 1024 --steps 20 --idle-batch 0 --output-json "$OUT/latency-v4.json"
fi
if want v4-16k; then
    step latency-v4-16k "${LATENCY[@]}" --model "$V4_4L" --batch-sizes 1 64 256 --context 16384 \
        --max-model-len 16512 --prefill --steps 10 --idle-batch 0 --output-json "$OUT/latency-v4-16k.json"
fi
# vLLM's server beside ours: its wheels' packages first on the path (they include fastapi and pydantic)
PARETO_ENGINES=(dsinfer)
[ -d /tmp/peer-vllm/pkgs/vllm ] && PARETO_ENGINES+=(vllm)
PARETO_ENV=(env PYTHONPATH="/tmp/peer-vllm/pkgs:/tmp/site:$PYTHONPATH" VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0)
pack() {  # pack DIR: its JSONs and logs as DIR.tgz, its PNG beside (the device tool returns 8 files at most)
    [ -d "$OUT/$1" ] || return 0
    cp "$OUT/$1/pareto.png" "$OUT/$1.png" 2>/dev/null
    tar -czf "$OUT/$1.tgz" -C "$OUT" "$1" && rm -rf "${OUT:?}/$1"
}
if [[ ,$ONLY, == *,pareto,* ]]; then
    step pareto-llama "${PARETO_ENV[@]}" "$PY" benchmarks/pareto_vs_vllm.py --model "$LLAMA" \
        --engines "${PARETO_ENGINES[@]}" --label-prefix "llama-3.1-8b " --result-dir "$OUT/pareto-llama" \
        --title "Llama-3.1-8B bf16, one H200, 1024 in / 256 out"
    pack pareto-llama
fi
if [[ ,$ONLY, == *,pareto-v2-lite,* ]]; then
    [ -f /tmp/ckpt/deepseek-v2-lite/config.json ] || (cd ../shared/tools/peer-vllm 2>/dev/null || cd .peer-vllm/small
        "$PY" make_random_ckpt.py deepseek-v2-lite /tmp/ckpt)
    step pareto-v2-lite "${PARETO_ENV[@]}" "$PY" benchmarks/pareto_vs_vllm.py --model "$V2LITE" \
        --ckpt /tmp/ckpt/deepseek-v2-lite --engines "${PARETO_ENGINES[@]}" --label-prefix "deepseek-v2-lite " \
        --result-dir "$OUT/pareto-v2-lite" --title "DeepSeek-V2-Lite bf16 (random init), one H200, 1024 in / 256 out"
    pack pareto-v2-lite
fi
if [[ ,$ONLY, == *,profile,* ]]; then
    for b in 1 256; do step "profile-llama-b$b" "$PY" benchmarks/profile_decode.py --replay --batch "$b" --top 20; done
    for b in 1 64 256; do
        step "profile-v2-lite-b$b" "$PY" benchmarks/profile_decode.py --replay --model "$V2LITE" --batch "$b" --top 30
    done
    step profile-llama-prefill "$PY" benchmarks/profile_decode.py --prefill --batch 1 --context 1024 --steps 4 --top 20
    step profile-v2-lite-prefill "$PY" benchmarks/profile_decode.py --prefill --model "$V2LITE" --batch 1 \
        --context 1024 --steps 4 --top 30
fi
echo
if want tests; then
    for log in pytest pytest-gpu-ops; do echo "$log: $(grep -E "passed|failed|error" "$OUT/$log.log" | tail -1)"; done
fi
if [[ ,$ONLY, == *,ops,* ]]; then grep -E "passed|failed|error" "$OUT/pytest-ops.log" | tail -1; fi
kill $SMI_PID 2>/dev/null
"$PY" benchmarks/gpu_summary.py "$OUT" "$SMI_CSV" || status=1
exit $status
