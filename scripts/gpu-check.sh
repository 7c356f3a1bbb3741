#!/usr/bin/env bash
# The one script the GPU machine runs (DESIGN.md, "Working with the GPU machine"):
#   1. the CUDA plugin: uses a carried build-cuda/ if its library loads there, else builds it
#      (standalone CMake of plugins/cuda, all cores);
#   2. cuda-op-check: every op of libxinfer-cuda.so against host references, graph capture,
#      and timings on MiMo-V2-Flash shapes;
#   3. the engine's checks: `xinfer ops-test --backend cuda` (every op against the CPU oracle,
#      fp8 KV caches included), golden fixtures on cuda, decode graphs (replay vs eager),
#      speculative decoding's losslessness, an fp8-KV generation, xray, and a batch-1 decode
#      bench with and without graphs (scripts/gpu-perf.sh records the MiMo-shape figures);
# and writes everything under $OUT (or ./gpu-check-out): summary.txt first, logs beside it.
#
#   scripts/gpu-check.sh [--no-timing] [--rebuild] [--skip-engine]
#
# Exit status: 0 when every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
summary=$OUT/summary.txt
: >"$summary"
timing_flag="" rebuild=0 engine=1
for arg in "$@"; do
    case $arg in
        --no-timing) timing_flag=--no-timing ;;
        --rebuild) rebuild=1 ;;
        --skip-engine) engine=0 ;;
        *) echo "usage: $0 [--no-timing] [--rebuild] [--skip-engine]" >&2; exit 2 ;;
    esac
done
status=0
note() { echo "$*" | tee -a "$summary"; }
# Another ops-test pass with environment settings (a switch that keeps an older kernel path
# reachable, an opt-in path, or opt-in cases):
#   ops_test_with VAR=VALUE[,VAR=VALUE...] LOG WHAT [ops-test arguments...]
ops_test_with() {
    local setting=$1 log=$2 what=$3
    shift 3
    local -a settings
    IFS=, read -ra settings <<<"$setting"
    env "${settings[@]}" build/bin/xinfer ops-test --backend cuda "$@" >"$OUT/$log" 2>&1
    local rc=$?
    [ "$rc" = 0 ] || status=1
    note "xinfer ops-test --backend cuda $*, $what ($setting): rc $rc: $(grep -E 'passed' "$OUT/$log" | tail -1)"
    grep -E '^FAIL' "$OUT/$log" | head -20 >>"$summary"
}
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# A `git archive` copy (how the GPU machine gets a clean tree) has no .git of its own: it names its
# commit in a COMMIT file, or git would report whatever repository encloses it.
if [ -f COMMIT ]; then commit=$(cat COMMIT); else
    commit="$(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+dirty')"; fi
note "# gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $commit"
note "$(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>&1 | head -4)"
note "nvcc: $(nvcc --version 2>/dev/null | tail -1)"

# ---- 1. plugin build ------------------------------------------------------------------------------
gen=""
command -v ninja >/dev/null && gen="-G Ninja"
plugin=build-cuda/bin/libxinfer-cuda.so
checker=build-cuda/bin/cuda-op-check
loads() { [ -f "$plugin" ] && [ -x "$checker" ] && ! ldd "$plugin" 2>/dev/null | grep -q "not found"; }
if [ $rebuild = 1 ] || ! loads; then
    note "building plugins/cuda (carried build missing, unloadable or --rebuild)"
    rm -rf build-cuda
    start=$(date +%s)
    if ! { cmake -S plugins/cuda -B build-cuda $gen -DCMAKE_BUILD_TYPE=Release >"$OUT/build-cuda.log" 2>&1 &&
           cmake --build build-cuda -j"$(nproc)" >>"$OUT/build-cuda.log" 2>&1; }; then
        note "FAIL  plugin build (see build-cuda.log)"
        tail -30 "$OUT/build-cuda.log"
        exit 1
    fi
    note "plugin built in $(( $(date +%s) - start )) s"
else
    note "using the carried build-cuda/"
fi

# ---- 2. the plugin's own op checks -------------------------------------------------------------
set -o pipefail
"$checker" --plugin "$plugin" --summary "$OUT/cuda-op-check.txt" $timing_flag 2>&1 | tee "$OUT/cuda-op-check.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || status=1
note "$(grep -E '^[0-9]+ checks' "$OUT/cuda-op-check.log" | tail -1) (cuda-op-check rc $rc)"
grep -E '^(FAIL|TIME)' "$OUT/cuda-op-check.log" >>"$summary"

# ---- 3. engine checks ------------------------------------------------------------------------------
if [ $engine = 1 ]; then
    if grep -rqs "ops-test" tools/ 2>/dev/null; then
        if [ ! -x build/bin/xinfer ]; then
            note "building the engine (scripts/build.sh)"
            scripts/build.sh >"$OUT/build-engine.log" 2>&1 || { note "FAIL  engine build (see build-engine.log)"; status=1; }
        fi
        # The engine dlopens plugins from next to its executable.
        [ -x build/bin/xinfer ] && [ ! -f build/bin/libxinfer-cuda.so ] && cp "$plugin" build/bin/
        if [ -x build/bin/xinfer ]; then
            build/bin/xinfer ops-test --backend cuda 2>&1 | tee "$OUT/ops-test.log"
            rc=${PIPESTATUS[0]}
            [ "$rc" = 0 ] || status=1
            note "xinfer ops-test --backend cuda: rc $rc"
            grep -iE 'fail|pass.*total|summary' "$OUT/ops-test.log" | tail -20 >>"$summary"
            # Prefill-sized FP8 dense matmuls (widened to bf16, then cuBLASLt) and few-token ones on the
            # tensor-core GEMV (N 8464 / 8704) against the CPU reference on dequantized weights; opt-in
            # cases, since the CPU backend runs no FP8 MATMUL.
            ops_test_with XINFER_OPS_TEST_DECODE_MATMULS=1 ops-test-fp8-matmul.log "fp8 cases" \
                --op matmul --filter '^matmul\((T=(520|600),|T=[0-9]+, N=(8464|8704),)'
            # The norm inside the FP8 projection's GEMV (one row: norm_stream_gemv's FP8 sibling in
            # mma_gemv_kernel), opt-in for the same reason.
            ops_test_with XINFER_OPS_TEST_DECODE_MATMULS=1 ops-test-fp8-norm-matmul.log "fp8 norm cases" \
                --op add_rmsnorm_matmul --filter 'w=f8_e4m3'
            # bf16 matmuls of up to 8 rows run on the tensor-core GEMV; the streaming GEMV stays their
            # fallback (and the f32 routers' path).
            ops_test_with XINFER_CUDA_BF16_MMA_GEMV=0 ops-test-bf16-stream-gemv.log "bf16 streaming GEMV" --op matmul
            # The split-KV kernel runs nearly every attention; the flash kernel it replaced stays the
            # path for FP8 caches and wide heads, so it is checked on the whole attention grid too.
            ops_test_with XINFER_CUDA_DECODE_ATTENTION=0 ops-test-flash-attention.log "flash kernel" --op attention
            # Decode-shaped batches of 192/128 and 128/128 heads run on per-warp key streams
            # (attention_stream.cu); the split-KV kernel they replaced and both block sizes of the
            # streams are checked on the whole grid too.
            ops_test_with XINFER_CUDA_ATTN_STREAM=0 ops-test-split-kv-attention.log "split-KV kernel" --op attention
            ops_test_with XINFER_CUDA_ATTN_STREAM=4 ops-test-stream4-attention.log "4-warp streams" --op attention
            ops_test_with XINFER_CUDA_ATTN_STREAM=8 ops-test-stream8-attention.log "8-warp streams" --op attention
            # The prefill kernel (192-row tiles) takes long query tiles only; here it takes every
            # bf16 192/128 and 128/128 case of the grid (decode, sliding, sinks, non-causal, pages).
            ops_test_with XINFER_CUDA_ATTN_PREFILL=all ops-test-prefill-attention.log "prefill kernel" --op attention
            # The grouped expert kernels' whole rounds (still the path with more than one token tile).
            ops_test_with XINFER_CUDA_MOE_PIPELINE=0 ops-test-moe-unpipelined.log "unpipelined rounds" \
                --op moe_experts
            # FP8 experts with one token tile stream through shared-memory rings; their pipelined
            # register path stays the fallback.
            ops_test_with XINFER_CUDA_MOE_RING=0 ops-test-moe-no-ring.log "register rounds" --op moe_experts
            # One FP8 token's experts split by I (moe_split_i.cu, opt-in until measured faster), with its
            # bf16 and f16 down rounds.
            ops_test_with XINFER_CUDA_MOE_SPLIT_I=1 ops-test-moe-split-i.log "split by I" \
                --op moe_experts,moe_route_experts
            ops_test_with XINFER_CUDA_MOE_SPLIT_I=1,XINFER_CUDA_MOE_SPLIT_I_F16=1 ops-test-moe-split-i-f16.log \
                "split by I, f16 down" --op moe_experts,moe_route_experts
            # Kernels that read host-written inputs and older keys before pdl_wait, in the old order.
            ops_test_with XINFER_CUDA_EARLY_READS=0 ops-test-late-reads.log "reads after pdl_wait" \
                --op attention,rmsnorm,add_rmsnorm,rope,kv_store,moe_experts
        fi
    else
        note "SKIP  xinfer ops-test --backend cuda (not in tools/ yet)"
    fi
    if [ -x build/bin/test_models ]; then
        # Test binaries bake in the build machine's fixture path; point them at this checkout.
        export XINFER_FIXTURES_DIR=$PWD/tests/fixtures
        # --dtype auto: f32 fixtures in f32 (the exact attention path), mimo_hub_fp8 (a bf16
        # checkpoint) in bf16 with the bf16 tolerance; then every fixture with f32 activations.
        XINFER_TEST_DEVICE=cuda build/bin/test_models --gtest_filter='Fixtures/Golden.*' \
            >"$OUT/golden-cuda.log" 2>&1
        rc=$?
        [ "$rc" = 0 ] || status=1
        note "golden fixtures on cuda (--dtype auto: mimo_hub_fp8 in bf16, the rest in f32): rc $rc"
        grep -E '^\[ (logits|greedy|batched)|FAILED  \]' "$OUT/golden-cuda.log" >>"$summary"
        XINFER_TEST_DEVICE=cuda XINFER_TEST_DTYPE=float32 build/bin/test_models --gtest_filter='Fixtures/Golden.*' \
            >"$OUT/golden-cuda-f32.log" 2>&1
        rc=$?
        [ "$rc" = 0 ] || status=1
        note "golden fixtures on cuda (--dtype float32, all): rc $rc"
        grep -E '^\[ (logits|greedy)|FAILED  \]' "$OUT/golden-cuda-f32.log" >>"$summary"
        # Decode graphs: a replay equals the eager padded step it was captured from bit for bit,
        # and greedy decoding with graphs follows eager decoding (src/runtime/graph_runner.h).
        XINFER_TEST_DEVICE=cuda build/bin/test_models --gtest_filter='DeviceGraphs.*' >"$OUT/graphs-cuda.log" 2>&1
        rc=$?
        [ "$rc" = 0 ] || status=1
        note "decode graphs on cuda (replay vs eager): rc $rc"
        grep -E '^\[ graphs|FAILED  \]' "$OUT/graphs-cuda.log" >>"$summary"
        # The engine's equivalences (batched = alone, chunked = one-shot, preemption, prefix
        # cache, overlapped decode), with f32 and fp8 KV caches.
        XINFER_TEST_DEVICE=cuda build/bin/test_models --gtest_filter='Fixtures/EngineTest.*:Fixtures/Fp8Kv.*' \
            >"$OUT/engine-cuda.log" 2>&1
        rc=$?
        [ "$rc" = 0 ] || status=1
        note "engine equivalences on cuda (f32 and fp8 KV): rc $rc: $(grep -E 'PASSED' "$OUT/engine-cuda.log" | tail -1)"
        grep -E 'FAILED  \]' "$OUT/engine-cuda.log" >>"$summary"
        # A 16-sequence serving batch (staged experts, graphs) against the CPU oracle.
        XINFER_TEST_DEVICE=cuda build/bin/test_models --gtest_filter='DeviceBatch.*' >"$OUT/batch-cuda.log" 2>&1
        rc=$?
        [ "$rc" = 0 ] || status=1
        note "serving batch on cuda vs cpu: rc $rc"
        grep -E '^\[ batch|FAILED  \]' "$OUT/batch-cuda.log" >>"$summary"
    fi
    if [ -x build/bin/test_spec ]; then
        # Speculative decoding is lossless on the device too: greedy with oracle, adversarial,
        # n-gram, MTP and DFlash drafts equals greedy without (alone, batched, chunked, prefix
        # cache, preemption); DFlash's proposals equal the z-lab reference's at every step.
        # In f32 (the bf16 mimo_hub_fp8 run reorders near-tie routing between a verify chain and
        # single-token steps, like the golden run above).
        XINFER_TEST_DEVICE=cuda XINFER_TEST_DTYPE=float32 build/bin/test_spec \
            --gtest_filter='Fixtures/SpecEngineTest.*:SpecSampling.*:Fixtures/MtpEngineTest.*:DFlashReference.*ThroughEngine*' \
            >"$OUT/spec-cuda.log" 2>&1
        rc=$?
        [ "$rc" = 0 ] || status=1
        note "speculative decoding on cuda: rc $rc: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/spec-cuda.log" | tr '\n' ' ')"
    fi
    if [ -x build/bin/test_http ]; then
        # `xinfer serve` on the device: completions equal the engine's, streaming, disconnects,
        # metrics, and a --profile trace with the device (CUDA event) timeline.
        XINFER_TEST_DEVICE=cuda build/bin/test_http --gtest_filter='ServerTest.*:ProfiledServerTest.*' \
            >"$OUT/server-cuda.log" 2>&1
        rc=$?
        [ "$rc" = 0 ] || status=1
        note "server on cuda: rc $rc: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/server-cuda.log" | tr '\n' ' ')"
    else
        note "SKIP  server on cuda: build/bin/test_http not built (cpp-httplib missing on this machine)"
    fi
    if [ -x build/bin/xinfer ]; then
        # FP8 KV cache end to end: greedy tokens with an fp8 cache vs the activation-dtype cache.
        prompt=$(python3 -c "import json;print(','.join(map(str,json.load(open('tests/fixtures/qwen3_f32/reference.json'))['prompt_ids'])))")
        for kv in auto fp8; do
            build/bin/xinfer generate --model tests/fixtures/qwen3_f32 --device cuda --prompt-ids "$prompt" \
                --max-tokens 32 --kv-cache-dtype $kv >"$OUT/generate-kv-$kv.log" 2>&1
        done
        same=$(cmp -s <(grep ids "$OUT/generate-kv-auto.log") <(grep ids "$OUT/generate-kv-fp8.log") && echo identical || echo DIFFERENT)
        note "qwen3_f32 greedy 32 tokens on cuda, fp8 vs auto KV cache: $same"
    fi
    if [ -x build/bin/xinfer ] && [ -z "$timing_flag" ]; then
        # Batch-1 decode with and without graphs on a small dense model (dummy weights).
        for mode in graphs eager; do
            flag=""
            [ $mode = eager ] && flag=--enforce-eager
            build/bin/xinfer bench --model bench/models/qwen3_1_7b --load-format dummy --device cuda \
                --prompt-len 512 --gen-len 64 $flag >"$OUT/bench-qwen3-$mode.log" 2>&1
            note "bench qwen3_1_7b batch-1 decode ($mode): $(grep -E '^decode:' "$OUT/bench-qwen3-$mode.log" | head -1)"
        done
    fi
    if [ -x build/bin/xinfer ]; then
        # auto dtype: f32 for the f32 fixtures, bf16 for the fp8 one; and the fp8 one in f32.
        for run in "mimo_hub_f32 auto 1" "qwen3_f32 auto 1" "mimo_hub_fp8 float32 1" "mimo_hub_fp8 auto 1"; do
            set -- $run
            fixture=$1 dtype=$2 gated=$3
            prompt=$(python3 -c "import json;print(','.join(map(str,json.load(open('tests/fixtures/$fixture/reference.json'))['prompt_ids'])))")
            build/bin/xinfer xray --model tests/fixtures/$fixture --prompt-ids "$prompt" --a cpu --b cuda \
                --dtype $dtype >"$OUT/xray-$fixture-$dtype.log" 2>&1
            rc=$?
            [ "$rc" = 0 ] || [ "$gated" = 0 ] || status=1
            note "xray cpu vs cuda $fixture --dtype $dtype$([ "$gated" = 0 ] && echo ' (reported)'): rc $rc: $(tail -1 "$OUT/xray-$fixture-$dtype.log")"
        done
    fi
fi

note "# gpu-check status $status"
exit $status
