#!/usr/bin/env bash
# A change's speed against the tree before it, back to back on one GPU: each benchmark (`dsinfer bench latency`
# with the runner's step tables, `dsinfer bench throughput`; the old benchmarks/latency.py and throughput.py on a
# tree that still has them) runs on BEFORE (a copy of the old tree: dsinfer/ and benchmarks/, e.g.
# `git archive <commit> dsinfer benchmarks | tar -x -C .baseline`), then on this tree, in one call; the rows of
# each pair come one after the other.
#
#   bash benchmarks/before_after.sh .baseline decode      # Llama-3.1-8B and DeepSeek-V2-Lite decode b=1/64/256
#   bash benchmarks/before_after.sh .baseline offline     # Llama 512 x 1000/1000 and V2-Lite 512 x 1000/100
#   PROMPTS=256 bash benchmarks/before_after.sh .baseline offline-llama   # one of them, fewer prompts
#
# ORDER="after before" runs this tree first. Logs and JSON go to $OUT (the device tool's) or /tmp/dsinfer-before-after.
set -uo pipefail
BEFORE=${1:?the folder of the old tree}
PART=${2:?decode or offline}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/dsinfer-before-after}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LLAMA=$ROOT/benchmarks/configs/llama-3.1-8b
V2LITE=$ROOT/benchmarks/configs/deepseek-v2-lite
DUMMY=(--device cuda --dtype bfloat16 --load-format dummy --max-num-seqs 256 --gpu-memory-utilization 0.8)
# `dsinfer bench latency` with the runner's step tables at the old benchmarks/latency.py's defaults
LATENCY_CLI=(--device cuda --dtype bfloat16 --load-format dummy --gpu-memory-utilization 0.85 --max-model-len 8192)
run() {  # run NAME TIMEOUT latency|throughput ARGS...: on the old tree, then on this one
    local name=$1 limit=$2 bench=$3; shift 3
    for tree in ${ORDER:-before after}; do
        local dir=$ROOT
        [ "$tree" = before ] && dir=$(cd "$BEFORE" && pwd)
        # a tree from before `dsinfer bench` took the scripts over runs its benchmarks/$bench.py
        local cmd=(-m dsinfer.bench "$bench" --disable-tqdm)
        [ "$bench" = latency ] && cmd=(-m dsinfer.bench latency "${LATENCY_CLI[@]}")
        [ -f "$dir/benchmarks/$bench.py" ] && cmd=("benchmarks/$bench.py")
        echo "=== $name ($tree)"
        (cd "$dir" && PYTHONPATH=$dir timeout -k 5 "$limit" python3 "${cmd[@]}" "$@" 2>&1 | grep -v -i warn \
            | tee "$OUT/$name-$tree.log" | tail -12)
    done
}
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv,noheader || true
PROMPTS=${PROMPTS:-512}
case $PART in decode|offline|offline-llama|offline-v2-lite) ;;
    *) echo "unknown part: $PART (decode, offline, offline-llama or offline-v2-lite)" >&2; exit 2 ;; esac
case $PART in
    decode)
        run latency-llama 150 latency --model "$LLAMA" --batch-sizes 1 64 256 --prefill --steps 50
        run latency-v2-lite 120 latency --model "$V2LITE" --batch-sizes 1 64 256 --prefill \
            --steps 30 --idle-batch 0 ;;&
    offline|offline-llama)
        run throughput-llama 140 throughput "${DUMMY[@]}" --model "$LLAMA" --num-prompts "$PROMPTS" \
            --input-len 1000 --output-len 1000 ;;&
    offline|offline-v2-lite)
        run throughput-v2-lite 100 throughput "${DUMMY[@]}" --model "$V2LITE" --num-prompts "$PROMPTS" \
            --input-len 1000 --output-len 100 --max-num-batched-tokens 8192 ;;
esac
