#!/usr/bin/env bash
# A/B of the weight rings' shapes (chunks per round x slots per warp; plugins/cuda/README.md:
# XINFER_CUDA_MOE_GATE_RING, XINFER_CUDA_FP8_GEMV_RING, XINFER_CUDA_BF16_GEMV_RING) in the
# graph-replayed step of batch-1 decode, the DFlash verify of 8 tokens and serving at concurrency 8,
# alternating the settings, ROUNDS times (default 2). The settings force a shape at every row count,
# so the T = 1 rows show the shape against the rule's one-row default and the others show it where
# the rule differs at 2-8 rows (FP8 GEMV 2x4, gate_up 1x4; the bf16 GEMV is 4x2 everywhere since
# session 25).
#
#   scripts/gpu-ring-shapes.sh [decode|verify|serving] ["ENV=VALUE ..." ...]
#
# Default settings: the rule, then each one-row shape forced everywhere. Expects build/bin/xinfer
# and its CUDA plugin; prints one line per run.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
what=${1:-decode}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] || set -- "" "XINFER_CUDA_BF16_GEMV_RING=4x2" "XINFER_CUDA_FP8_GEMV_RING=4x2" \
    "XINFER_CUDA_MOE_GATE_RING=2x3" "XINFER_CUDA_BF16_GEMV_RING=2x4 XINFER_CUDA_FP8_GEMV_RING=2x4 XINFER_CUDA_MOE_GATE_RING=1x4"
e8=bench/models/mimo_v2_flash_e8
case $what in
    decode) runs=("$e8" "${e8}_fp8"); extra=(--prompt-len 4096 --gen-len 64); pattern='^decode step [0-9]' ;;
    verify) runs=("$e8"); extra=(--prompt-len 4096 --speculative-config '{"method":"dflash","model":"bench/models/dflash_mimo_b8"}')
            pattern='^(decode|verify) step \(' ;;
    serving) runs=(bench/models/mimo_v2_flash_e32); extra=(--concurrency 8 --input-len 512 --output-len 128)
             pattern='^\| 8 \|' ;;
    *) echo "gpu-ring-shapes: unknown case '$what' (decode, verify or serving)" >&2; exit 2 ;;
esac
for round in $(seq "${ROUNDS:-2}"); do
    for model in "${runs[@]}"; do
        for setting in "$@"; do
            # shellcheck disable=SC2086  # a setting is a list of VAR=VALUE words
            result=$(env $setting build/bin/xinfer bench --model "$model" --load-format dummy --device cuda "${extra[@]}" \
                2>&1 | grep -E "$pattern" | cut -c1-160 | tr '\n' ' ')
            echo "round $round $(basename "$model") [${setting:-the rule}]: ${result:-no figure (failed?)}"
        done
    done
done
