#!/usr/bin/env bash
# The GPU machine's performance record (issues 4, 5, 6): MiMo-V2-Flash shapes with dummy weights,
# every figure next to the limit measured in the same run (xinfer bench prints both).
#   1. batch-1 decode + 4K prefill, 8 experts top-8 (reads what the 256-expert model reads), in
#      bf16 and with FP8 block-scaled weights;
#   2. speculative step costs at batch 1: verify of 8 tokens vs one decode step, DFlash drafter
#      (5 layers, hidden 4096, block 8) and MTP heads, with the speedup model;
#   3. serving at concurrency 1, 8, 32, 64 (512 in / 256 out), 32 experts top-8.
# Expects build/bin/{xinfer,libxinfer-cuda.so}; writes $OUT (or ./gpu-perf-out).
#
#   scripts/gpu-perf.sh [--quick]     (--quick: shorter runs, for a smoke test)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-perf-out}
mkdir -p "$OUT"
summary=$OUT/summary.txt
: >"$summary"
gen=64 out_len=256 levels=1,8,32,64
[ "${1:-}" = --quick ] && gen=16 out_len=64 levels=1,8
note() { echo "$*" | tee -a "$summary"; }
x=build/bin/xinfer
# A `git archive` copy (how the GPU machine gets a clean tree) has no .git of its own: it names its
# commit in a COMMIT file, or git would report whatever repository encloses it.
if [ -f COMMIT ]; then commit=$(cat COMMIT); else
    commit="$(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+dirty')"; fi
note "# gpu-perf $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $commit"
note "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"

run() {  # name, then the xinfer arguments
    local name=$1
    shift
    local start=$(date +%s)
    "$x" "$@" >"$OUT/$name.log" 2>&1
    note "## $name (rc $?, $(( $(date +%s) - start )) s): xinfer $*"
    grep -vE '^\{' "$OUT/$name.log" | tail -25 >>"$summary"
}

e8=bench/models/mimo_v2_flash_e8
e32=bench/models/mimo_v2_flash_e32
run decode-4k bench --model $e8 --load-format dummy --device cuda --prompt-len 4096 --gen-len $gen
run decode-fp8-weights bench --model bench/models/mimo_v2_flash_e8_fp8 --load-format dummy --device cuda \
    --prompt-len 4096 --gen-len $gen
run decode-4k-profile bench --model $e8 --load-format dummy --device cuda --prompt-len 4096 --gen-len 4 \
    --profile "$OUT/decode-4k-profile.json"
run spec-dflash bench --model $e8 --load-format dummy --device cuda --prompt-len 4096 \
    --speculative-config '{"method":"dflash","model":"bench/models/dflash_mimo_b8"}'
run spec-mtp bench --model $e8 --load-format dummy --device cuda --prompt-len 4096 \
    --speculative-config '{"method":"mtp","num_speculative_tokens":3}'
run serving-e32 bench --model $e32 --load-format dummy --device cuda --concurrency $levels \
    --input-len 512 --output-len $out_len
note "# done"
# The headline figures on stdout too: a caller that gets only the output back (a remote runner with
# a cap on returned files) still has every measured number.
echo "# headline figures"
grep -E 'achieved|decode step|verify step|drafter|^\| [0-9]' "$summary"
