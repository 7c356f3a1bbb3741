#!/bin/bash
# FP8 block-scaled weights resident on the GPU (issue 6), one device call: golden fixtures and
# resident-vs-dequantized logits, xray cpu vs cuda in both --fp8-weights modes, the fp8 ops-test
# cases, and batch-1 decode of MiMo-V2-Flash shapes (8 experts, top-8) in both modes plus a profile.
# Usage (repository root, binaries built here and carried): scripts/gpu-fp8-weights.sh [BIN_DIR]
set -u
B=${1:-build-fp8w/bin}
OUT=${OUT:-/tmp/fp8-weights-out}
mkdir -p "$OUT"
export XINFER_FIXTURES_DIR=$PWD/tests/fixtures
PROMPT=$(python3 -c "import json; print(','.join(map(str, json.load(open('tests/fixtures/mimo_hub_fp8/reference.json'))['prompt_ids'])))")
step() {  # step NAME SECONDS CMD...: output and exit status into $OUT/NAME.txt
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "rc=$? seconds=$((SECONDS - t0))" >> "$OUT/$name.txt"
    tail -1 "$OUT/$name.txt" | sed "s/^/$name: /"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; git rev-parse HEAD 2>/dev/null; date -u; } > "$OUT/device.txt" 2>&1
# Most important first; limits sum to 240 s.
for mode in auto dequantize; do
    step "bench_$mode" $([ $mode = auto ] && echo 60 || echo 50) "$B/xinfer" bench --model bench/models/mimo_v2_flash_e8_fp8 \
        --device cuda --load-format dummy --prompt-len 512 --gen-len 32 --fp8-weights "$mode"
done
XINFER_TEST_DEVICE=cuda step golden 40 "$B/test_models" --gtest_filter='Fixtures/Golden.*:Fp8Weights.Device*'
for mode in auto dequantize; do
    step "xray_$mode" 20 "$B/xinfer" xray --model tests/fixtures/mimo_hub_fp8 --prompt-ids "$PROMPT" --a cpu --b cuda --fp8-weights "$mode"
done
step ops_fp8 15 "$B/xinfer" ops-test --backend cuda --op matmul,moe_experts --filter 'f8'
step bench_auto_profile 35 "$B/xinfer" bench --model bench/models/mimo_v2_flash_e8_fp8 --device cuda --load-format dummy \
    --prompt-len 512 --gen-len 8 --profile "$OUT/fp8_decode_trace.json"
