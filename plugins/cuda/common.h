// Shared pieces of the CUDA backend plugin: the per-context state, error reporting, the
// scratch workspace, tensor helpers for validation, and the op entry points each family file
// defines.
//
// Every op entry point has the signature `int op_x(Context*, const xinfer_op*, bool run)`:
// with run = false it only validates (supports_op; tensor data may be NULL) and with run =
// true it validates again and enqueues the kernels on the context's stream. Validation failures
// return XINFER_UNSUPPORTED with last_error naming the op and the shapes. Nothing in a run path
// allocates device memory except through ensure_scratch, synchronizes, or reads device memory
// on the host, so every op can be captured into a CUDA graph. The one exception checks
// stream_capturing() first: MOE_EXPERTS over a prefill chunk reads its per-expert row counts
// on the host to run one cuBLASLt GEMM per expert (moe.cu).
#pragma once

#include "xinfer/backend_abi.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace xcuda {

// One cached cuBLASLt algorithm per problem signature (see gemm.cu).
struct GemmKey {
    int64_t m, n, k;
    int a_type, b_type, d_type, compute;
    int align_a, align_b, align_d;
    bool operator<(const GemmKey& o) const {
        return std::tie(m, n, k, a_type, b_type, d_type, compute, align_a, align_b, align_d) <
               std::tie(o.m, o.n, o.k, o.a_type, o.b_type, o.d_type, o.compute, o.align_a, o.align_b, o.align_d);
    }
};

// One stream operation on the device timeline (XINFER_CUDA_TIMELINE, backend.cu).
struct TimelineMark {
    const char* what;  // "upload", "download", "op", "graph", ...
    int op_type;       // the xinfer_op type for "op", else -1
    cudaEvent_t done;  // recorded right after the operation
    bool starved;      // the previous operation had finished on the device when this one was queued
};

constexpr int kSplitArrivals = 1;
constexpr int kMaxSplitGroups = 1024;
constexpr int kArrivalInts = kSplitArrivals + 2 * kMaxSplitGroups;

struct Context {
    int device = 0;
    int sm_count = 0;
    size_t smem_optin = 0;             // max dynamic shared memory per block (bytes)
    cudaStream_t stream = nullptr;     // the one in-order, non-blocking stream
    cublasLtHandle_t lt = nullptr;
    void* lt_workspace = nullptr;      // fixed at creation so captured GEMMs keep a valid pointer
    size_t lt_workspace_bytes = 0;
    // Scratch for ops' temporaries. Grows only outside graph capture; while graphs exist, a
    // replaced buffer is kept (retired) because captured kernels still point into it.
    char* scratch = nullptr;
    size_t scratch_bytes = 0;
    std::vector<void*> retired;
    // Arrival counters (kArrivalInts), each left at zero by the kernel that uses it: [0] for the
    // norm-fused GEMVs, whose last block (router) or last block's warp 0 (one bf16 row) stores the
    // residual and normed for the grid (gemm.cu); from kSplitArrivals,
    // two per (row tile, KV head) of a decode attention that merges its splits in-kernel
    // (attention_stream.cu).
    int* arrivals = nullptr;
    // download_async: pinned staging the copies land in, and where each goes once waited for.
    struct PendingDownload {
        void* dst;
        size_t offset, bytes;
        const char* mapped_src;  // non-null: the source is mapped memory, copied from here (no staging)
    };
    char* download_staging = nullptr;  // cudaHostAlloc (mapped), download_staging_bytes
    char* download_staging_device = nullptr;  // the same memory as kernels address it
    size_t download_staging_bytes = 0;
    std::vector<PendingDownload> pending_downloads;
    size_t pending_download_bytes = 0;
    cudaEvent_t downloads_done = nullptr;  // recorded after the latest download_async
    // alloc_mapped's allocations (pinned, mapped): downloads, uploads and copies that touch one
    // take the host's side or a copy kernel instead of a copy engine.
    struct MappedRange {
        char* host;
        char* device;
        size_t bytes;
    };
    std::vector<MappedRange> mapped;
    int live_graphs = 0;
    bool capturing = false;
    std::vector<TimelineMark> timeline;  // XINFER_CUDA_TIMELINE only
    std::map<GemmKey, cublasLtMatmulAlgo_t> algo_cache;
    std::string error;
};

// ---- errors ------------------------------------------------------------------------------------

void set_error(Context* c, const char* format, ...) __attribute__((format(printf, 2, 3)));
std::string str_format(const char* format, ...) __attribute__((format(printf, 1, 2)));

// Records a CUDA error on the context and returns XINFER_ERROR (or XINFER_OUT_OF_MEMORY).
int cuda_fail(Context* c, cudaError_t err, const char* what);

#define XCUDA_TRY(ctx, expr)                                   \
    do {                                                       \
        cudaError_t err_ = (expr);                             \
        if (err_ != cudaSuccess) return ::xcuda::cuda_fail((ctx), err_, #expr); \
    } while (0)

// After a kernel launch: configuration errors (too much shared memory, bad grid) show up here.
#define XCUDA_CHECK_LAUNCH(ctx, what) XCUDA_TRY(ctx, cudaGetLastError())

// ---- programmatic dependent launch ----------------------------------------------------------------

// Hopper can launch a kernel while the previous kernel on the stream is still finishing: its
// blocks are scheduled early and wait in pdl_begin() (device_utils.cuh) until that grid has
// completed and its writes are visible. What overlaps is the launch and whatever a kernel does
// before pdl_begin() that touches no memory another kernel writes (the streaming GEMV requests its
// first weight chunks into L2 there). Measured over the ~730 kernels of a batch-1 MiMo decode
// step on H200: 64.6% -> 65.4% of copy bandwidth. Every kernel launched with launch_pdl must
// call pdl_begin() before its first access to such memory; graphs capture the programmatic
// edges. XINFER_CUDA_PDL=0 launches plainly.
bool pdl_enabled();

// A switch from the environment: unset or empty → fallback; "0" → false; anything else → true.
// (The XINFER_CUDA_* switches that restore older kernel paths; plugins/cuda/README.md lists them.)
bool env_flag(const char* name, bool fallback);
// A number from the environment: unset or empty → fallback (the XINFER_CUDA_* tuning knobs).
int64_t env_int(const char* name, int64_t fallback);
// A ring shape from the environment, "UxR" (chunks per round x slots), as U·10 + R; 0 when unset,
// or (with a warning) when not of that form or not one of `built`. For the A/B switches that force
// a weight ring's shape.
int env_ring_shape(const char* name, std::initializer_list<int> built);
// Whether small kernels read what the host and earlier forwards wrote (norm weights, positions,
// slot mappings, older keys) before pdl_wait. XINFER_CUDA_EARLY_READS=0 turns it off, for A/B runs.
bool early_reads();

template <typename... Params, typename... Args>
int launch_pdl(Context* c, const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
               Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c->stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl_enabled() ? 1 : 0;
    const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
    if (err != cudaSuccess) return cuda_fail(c, err, what);
    XCUDA_CHECK_LAUNCH(c, what);
    return XINFER_OK;
}

// ---- scratch -----------------------------------------------------------------------------------

// Lays out an op's temporaries inside the scratch buffer: call add() for each, then
// ensure_scratch(total), then base + offset.
struct ScratchPlan {
    size_t total = 0;
    size_t add(size_t bytes) {
        const size_t offset = total;
        total += (bytes + 255) / 256 * 256;
        return offset;
    }
};

// Makes the scratch buffer at least `bytes` long. Fails (XINFER_ERROR) if that would need a
// reallocation during graph capture.
int ensure_scratch(Context* c, size_t bytes);

bool stream_capturing(Context* c);

// ---- tensors -----------------------------------------------------------------------------------

inline bool absent(const xinfer_tensor& t) { return t.rank == 0; }
int64_t numel(const xinfer_tensor& t);
size_t dtype_size(int dtype);
const char* dtype_name(int dtype);
std::string shape_str(const xinfer_tensor& t);  // "bf16[2, 3]"
inline int64_t rows_of(const xinfer_tensor& t) { return t.rank == 0 ? 0 : numel(t) / t.shape[t.rank - 1]; }
inline int64_t cols_of(const xinfer_tensor& t) { return t.rank == 0 ? 0 : t.shape[t.rank - 1]; }
inline bool is_float(int d) { return d == XINFER_DTYPE_F32 || d == XINFER_DTYPE_BF16 || d == XINFER_DTYPE_F16; }
inline bool is_act(int d) { return d == XINFER_DTYPE_F32 || d == XINFER_DTYPE_BF16; }
inline int pointer_alignment(const void* p) {  // largest power of two ≤ 256 dividing p
    const uintptr_t v = reinterpret_cast<uintptr_t>(p);
    int a = 1;
    while (a < 256 && (v % uintptr_t(2 * a)) == 0) a *= 2;
    return a;
}

// Unsupported-op helper: formats "OP (layer L): message" into last_error.
int unsupported(Context* c, const xinfer_op* op, const char* format, ...) __attribute__((format(printf, 3, 4)));

// ---- op entry points (one family per .cu file) --------------------------------------------------

// elementwise.cu
int op_embedding(Context* c, const xinfer_op* op, bool run);
int op_rmsnorm(Context* c, const xinfer_op* op, bool run);
int op_add_rmsnorm(Context* c, const xinfer_op* op, bool run);
int op_rope(Context* c, const xinfer_op* op, bool run);
int op_swiglu(Context* c, const xinfer_op* op, bool run);
int op_scale(Context* c, const xinfer_op* op, bool run);
int op_add(Context* c, const xinfer_op* op, bool run);
int op_convert(Context* c, const xinfer_op* op, bool run);
// gemm.cu
int op_matmul(Context* c, const xinfer_op* op, bool run);
int op_add_rmsnorm_matmul(Context* c, const xinfer_op* op, bool run);
// moe_route.cu, moe.cu
int op_moe_route(Context* c, const xinfer_op* op, bool run);
int op_moe_experts(Context* c, const xinfer_op* op, bool run);
int op_moe_route_experts(Context* c, const xinfer_op* op, bool run);
// MOE_ROUTE's checks of the logits, bias and params (shared with MOE_ROUTE_EXPERTS), and the
// shared memory one token's routing takes (route_token, moe_route.cuh).
int check_route(Context* c, const xinfer_op* op, const xinfer_tensor& logits, const xinfer_tensor& bias,
                const xinfer_route_params& rp);
size_t route_smem_bytes(int E, const xinfer_route_params& rp);
// attention.cu
int op_kv_store(Context* c, const xinfer_op* op, bool run);
int op_rope_kv_store(Context* c, const xinfer_op* op, bool run);
int op_attention(Context* c, const xinfer_op* op, bool run);
// sampling.cu
int op_argmax(Context* c, const xinfer_op* op, bool run);
int op_sample(Context* c, const xinfer_op* op, bool run);

// ---- shared launchers (defined in the family files, used across them) ---------------------------

// dst[i] = src[i] converted, n elements, any of f32/bf16/f16 each side (elementwise.cu).
int launch_convert(Context* c, const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n);
// out[r, i] = silu(gu[r, i]) * gu[r, I + i] (elementwise.cu).
int launch_swiglu(Context* c, const void* gate_up, int gu_dtype, void* out, int out_dtype, int64_t rows, int64_t inner);

}  // namespace xcuda
