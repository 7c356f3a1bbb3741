#!/usr/bin/env bash
# What each op type costs inside a graph-replayed decode step, launch and dependency included:
# `xinfer bench` once as it is, then once per op type with XINFER_CUDA_TIMING_SKIP set so that the
# type's ops launch nothing in the captured graphs (results wrong: timing only). The step-time
# difference is the type's in-graph cost, which ncu (kernels serialized) cannot show. A skipped
# type's outputs keep what the eager step before the capture wrote (MOE_ROUTE: that step's expert
# ids, still in range), so the ops after it run on stale but valid data.
# Default: batch-1 MiMo-V2-Flash shape (8 experts, dummy weights) at a 4K context.
#
#   scripts/gpu-op-costs.sh [MODEL_DIR ...]     (default: the bf16 and FP8 bench models)
#
# Expects build/bin/xinfer and its CUDA plugin; prints one table per model (also in $OUT, or
# ./gpu-op-costs-out). docs/perf/2026-12-01-h200-session19.md section 1 is its first table.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-op-costs-out}
mkdir -p "$OUT"
[ $# -gt 0 ] || set -- bench/models/mimo_v2_flash_e8 bench/models/mimo_v2_flash_e8_fp8
# xinfer_op_type bits (include/xinfer/backend_abi.h): RMSNORM 2, ADD_RMSNORM 3, MATMUL 4,
# ATTENTION 10, MOE_ROUTE 11, MOE_EXPERTS 12, ROPE_KV_STORE 16, MOE_ROUTE_EXPERTS 18 (one FP8 token's
# route and experts; moe_route alone is then the route of the other shapes).
masks=("0 nothing" "12 rmsnorm+add_rmsnorm" "65536 rope_kv_store" "1024 attention" "2048 moe_route"
       "4096 moe_experts" "262144 moe_route_experts" "16 matmul")
for model in "$@"; do
    table=$OUT/$(basename "$model").txt
    {
        echo "# $model: decode step without each op type (xinfer bench, 4,096-token prompt, 64 steps, graphs)"
        echo "| skipped | roofline fraction | step (ms) | in-graph cost (ms) |"
        echo "|---|---:|---:|---:|"
    } >"$table"
    base_ms=""
    for entry in "${masks[@]}"; do
        mask=${entry%% *} what=${entry#* }
        log=$OUT/$(basename "$model")-skip-$mask.log
        XINFER_CUDA_TIMING_SKIP=$mask build/bin/xinfer bench --model "$model" --load-format dummy --device cuda \
            --prompt-len 4096 --gen-len 64 >"$log" 2>&1 || { echo "| $what | failed: see $log | | |" >>"$table"; continue; }
        # "decode achieved X GB/s = F% of measured bandwidth (roofline R tokens/s)": step = 1 / (F · R).
        line=$(grep -m1 'decode achieved' "$log" || true)
        [ -n "$line" ] || { echo "| $what | no decode figure: see $log | | |" >>"$table"; continue; }
        fraction=$(sed -E 's/.*= ([0-9.]+)% of measured.*/\1/' <<<"$line")
        roofline=$(sed -E 's/.*roofline ([0-9.]+) tokens.*/\1/' <<<"$line")
        step_ms=$(python3 -c "print(f'{1e3 / ($fraction / 100 * $roofline):.3f}')")
        [ -z "$base_ms" ] && base_ms=$step_ms
        cost=$(python3 -c "print(f'{$base_ms - $step_ms:.3f}')")
        echo "| $what | $fraction% | $step_ms | $cost |" >>"$table"
    done
    cat "$table"
done
