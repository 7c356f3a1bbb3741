#!/usr/bin/env bash
# Batch-1 decode A/B on the GPU machine: this build (build/bin) against another build's xinfer and
# libxinfer-cuda.so in BASE_DIR (e.g. the previous commit's bundle), and optionally this build under
# environment settings (one variant each), alternating run by run on the same machine, FP8 then
# bf16 weights (bench/models/mimo_v2_flash_e8[_fp8], dummy weights, 4,096-token prompt, 64 steps).
# Prints each run's `decode achieved` and `decode step` lines; the whole outputs go to $OUT.
#
#   scripts/gpu-decode-ab.sh BASE_DIR [ROUNDS [VARIANT ...]]
#
# A VARIANT is one or more VAR=VALUE settings joined by commas, e.g.
#   scripts/gpu-decode-ab.sh .dev/head 2 XINFER_CUDA_QKV_ROPE=0 XINFER_CUDA_QKV_ROPE=0,XINFER_CUDA_MOE_DOWN_L2=0
# runs new, base, variant1 and variant2 per model and round. AB_MODELS (default both bench models,
# FP8 first: on a budget its runs matter most) picks the models.
#
# Runs whose start would pass AB_SECONDS (default 330) seconds of the script are skipped, so that
# the script fits one device call with other checks.
set -uo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: $0 BASE_DIR [ROUNDS [VARIANT ...]]}
rounds=${2:-2}
shift $(($# < 2 ? $# : 2))
variants=("$@")
models=${AB_MODELS:-mimo_v2_flash_e8_fp8 mimo_v2_flash_e8}
OUT=${OUT:-$PWD/gpu-decode-ab-out}
mkdir -p "$OUT"
start=$(date +%s)
run() {  # label binary model round [VAR=VALUE,...]
    local label=$1 bin=$2 model=$3 round=$4 settings=${5:-}
    if [ $(($(date +%s) - start)) -gt "${AB_SECONDS:-330}" ]; then
        echo "skipped $label $model round $round (time)"
        return
    fi
    local log=$OUT/bench-$label-$model-$round.txt
    local -a env_settings
    IFS=, read -ra env_settings <<<"$settings"
    env "${env_settings[@]}" timeout 120 "$bin" bench --model "bench/models/$model" --load-format dummy --device cuda \
        --prompt-len 4096 --gen-len 64 >"$log" 2>&1
    local rc=$?  # (read first: the $(date) below would reset $?)
    echo "[$(($(date +%s) - start)) s] $label${settings:+ ($settings)} $model round $round: rc $rc"
    grep -E '^decode (achieved|step)|rror' "$log"
}
for round in $(seq "$rounds"); do
    for model in $models; do
        # Alternate which side goes first, so that a machine warming up favours neither.
        if [ $((round % 2)) = 1 ]; then order="new base"; else order="base new"; fi
        for side in $order; do
            if [ $side = new ]; then run new build/bin/xinfer $model $round; else run base "$base/xinfer" $model $round; fi
        done
        for i in "${!variants[@]}"; do run "variant$((i + 1))" build/bin/xinfer $model $round "${variants[$i]}"; done
    done
done
