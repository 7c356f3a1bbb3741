#!/usr/bin/env bash
# Nsight Compute sections (SpeedOfLight, SchedulerStats, WarpStateStats, Occupancy) and stall reasons of the kernels
# whose names match REGEX in a short `xinfer bench` run, averaged per (kernel, grid, block) by
# scripts/kernel_stalls.py: issue slots busy, eligible warps, cycles per issued instruction, DRAM
# and SM throughput. Default: the FP8 bench model's weight-stream kernels at batch 1.
#
#   scripts/gpu-kernel-stalls.sh [REGEX [MODEL_DIR [extra `xinfer bench` arguments]]]
#
# Expects build/bin/xinfer and its CUDA plugin; writes $OUT (or ./gpu-kernel-stalls-out): ncu.csv.gz
# and bench.log. Each matching launch is replayed once per section pass, so keep REGEX narrow; at
# most $LAUNCHES (default 200) matching launches are profiled.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-kernel-stalls-out}
regex=${1:-mma_gemv|moe_grouped_gate_up|moe_down_slots}
model=${2:-bench/models/mimo_v2_flash_e8_fp8}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] && shift
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1 || true)
[ -n "$ncu" ] || { echo "gpu-kernel-stalls: ncu (Nsight Compute) not found on PATH or in /usr/local/cuda*/bin" >&2; exit 1; }
mkdir -p "$OUT"
# The sections' CSV has no stall breakdown, so the stall reasons (cycles per issued instruction, by
# reason) and the instruction counts are asked for as metrics too.
stalls='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,smsp__inst_executed.sum,smsp__warps_launched.sum'
"$ncu" --kernel-name "regex:$regex" --section SpeedOfLight --section SchedulerStats --section WarpStateStats \
    --section Occupancy --metrics "$stalls" --launch-count "${LAUNCHES:-200}" --csv --print-units base --clock-control none --cache-control none \
    --log-file "$OUT/ncu.csv" build/bin/xinfer bench --model "$model" --load-format dummy --device cuda \
    --prompt-len 512 --gen-len 2 "$@" >"$OUT/bench.log" 2>&1
gzip -f "$OUT/ncu.csv"
python3 scripts/kernel_stalls.py "$OUT/ncu.csv.gz"
