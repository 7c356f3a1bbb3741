#!/bin/bash
# Few-token dense matmuls (plugins/cuda/gemm.cu stream_gemv_kernel), one device call: the matmul
# ops-test grid against the CPU oracle, batch-1 decode of MiMo-V2-Flash shapes (bf16 and fp8)
# with the streaming GEMV and with the previous routing (XINFER_CUDA_DENSE_GEMV=0), then the
# matmul perf grid both ways. Steps run most important first under one deadline (140 s).
# Usage (repository root, binaries built here and carried): scripts/gpu-gemv.sh [BIN_DIR]
set -u
B=${1:-build-gemv/bin}
OUT=${OUT:-/tmp/gemv-out}
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${GEMV_BUDGET:-140}))
step() {  # step NAME CAP CMD...: output and exit status into $OUT/NAME.txt
    local name=$1 cap=$2; shift 2
    local left=$((DEADLINE - SECONDS)) t0=$SECONDS
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -le 2 ]; then echo "$name: skipped (deadline)"; return; fi
    timeout "$cap" "$@" > "$OUT/$name.txt" 2>&1
    echo "rc=$? seconds=$((SECONDS - t0))" >> "$OUT/$name.txt"
    echo "$name: $(tail -1 "$OUT/$name.txt")"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; git rev-parse HEAD 2>/dev/null; date -u; } > "$OUT/device.txt" 2>&1
head -2 "$OUT/device.txt" | tail -1
step ops 35 env XINFER_OPS_TEST_DECODE_MATMULS=1 "$B/xinfer" ops-test --backend cuda --op matmul
grep -E "passed|^FAIL" "$OUT/ops.txt" | head -20
for model in mimo_v2_flash_e8 mimo_v2_flash_e8_fp8; do
    for mode in 1 0; do
        step "bench_${model}_gemv$mode" 30 env XINFER_CUDA_DENSE_GEMV=$mode "$B/xinfer" bench --model bench/models/$model \
            --device cuda --load-format dummy --prompt-len 512 --gen-len 32
        grep -E "^decode|^prefill" "$OUT/bench_${model}_gemv$mode.txt"
    done
done
for mode in 1 0; do
    step "perf_gemv$mode" 20 env XINFER_CUDA_DENSE_GEMV=$mode "$B/xinfer" ops-test --backend cuda --perf --op matmul --seconds 0.02
    grep -E "^copy bandwidth" "$OUT/perf_gemv$mode.txt"
    grep -E "^PERF +matmul\(T=[138]," "$OUT/perf_gemv$mode.txt" |
        sed -E 's/^PERF +matmul\(([^)]*), act=[a-z0-9]+\) +([0-9.]+) ms \( *[0-9]+ runs\) +([0-9.]+) GB\/s \( *([0-9.]+)% of copy\).*/\1 \2ms \3GB\/s \4%/'
done
