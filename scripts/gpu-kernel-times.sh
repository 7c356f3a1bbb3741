#!/usr/bin/env bash
# Device time of every kernel of one decode step, measured by Nsight Compute at real clocks with
# warm caches (scripts/kernel_times.py explains why not the --profile trace, and how the step is
# found). Default: batch-1 MiMo-V2-Flash shape (8 experts, dummy weights) at a 4K context.
#
#   scripts/gpu-kernel-times.sh [MODEL_DIR [extra `xinfer bench` arguments]]
#
# Expects build/bin/xinfer and its CUDA plugin; writes $OUT (or ./gpu-kernel-times-out):
# ncu.csv.gz (every kernel of the run) and bench.log, and prints the decode step's table.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-kernel-times-out}
model=${1:-bench/models/mimo_v2_flash_e8}
[ $# -gt 0 ] && shift
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1 || true)
[ -n "$ncu" ] || { echo "gpu-kernel-times: ncu (Nsight Compute) not found on PATH or in /usr/local/cuda*/bin" >&2; exit 1; }
mkdir -p "$OUT"
# Two decode tokens: the prefill, then decode steps; ncu replays each kernel (~1 minute in all).
"$ncu" --metrics gpu__time_duration.sum --csv --print-units base --clock-control none --cache-control none \
    --log-file "$OUT/ncu.csv" build/bin/xinfer bench --model "$model" --load-format dummy --device cuda \
    --prompt-len 4096 --gen-len 2 "$@" >"$OUT/bench.log" 2>&1
gzip -f "$OUT/ncu.csv"
python3 scripts/kernel_times.py "$OUT/ncu.csv.gz"
