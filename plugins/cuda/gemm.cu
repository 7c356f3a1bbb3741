// MATMUL: y[T, N] = x[T, K] · w[N, K]ᵀ.
//
//  - f32 / bf16 / f16 weights go to cuBLASLt (x converted to the weight's dtype first when it
//    differs; y may be f32, e.g. logits). cuBLASLt is column-major, so we ask it for
//    yᵀ[N, T] = w[N, K] · xᵀ, which is the row-major y with no transposes in memory: A = w
//    viewed as a K×N column-major matrix with op T, B = x viewed as K×T with op N.
//  - FP8-e4m3 weights with block scales (and bf16 shapes cuBLASLt rejects) go to the tiled
//    tensor-core kernel (tile_gemm.cu), which dequantizes each 64×32 weight tile into shared
//    memory as bf16; the same kernel runs the grouped expert GEMMs of moe.cu.
//  - Few-token matmuls (decode) stream the weights: the streaming GEMV and the tensor-core
//    mma_gemv_kernel below; ADD_RMSNORM_MATMUL runs the norm inside them where that pays.
//
// Measured figures and the plan for a wgmma / native-FP8 path: see plugins/cuda/README.md.
#include "gemm.h"

#include "device_utils.cuh"
#include "weight_stream.cuh"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace xcuda {
namespace {

// ---- the streaming few-token GEMV (dense decode matmuls) -------------------------------------------
//
// y[j, n] = Σ_k x[j, k] · w[n, k] for T ≤ 8 rows of x: a pure weight stream. A block of 256 threads
// owns 8 / S weight rows; the S warps of one row split its K range, each lane keeping rounds of U
// 16-byte weight loads in flight (a round issued before the FMAs of the one before it, the first
// before the PDL wait; L1 bypassed; see kDepth) and reading x (bf16 or f32, a few KB, L1-resident)
// per chunk. S grows (1, 2, 4, 8) until the grid has ~4 blocks per SM, so 512-row
// matrices fill all SMs; the S partial sums meet in shared memory. FP8 chunks (16 values) are
// widened in registers and their block scale applied once per chunk. Launch shapes depend only on
// (N, K, T, dtypes): graph-safe.
constexpr int kStreamThreads = 256;
constexpr int kStreamWarps = kStreamThreads / 32;

struct StreamGemv {
    const void* x = nullptr;  // [rows, k] bf16 or f32, 16-byte aligned, k % chunk == 0
    const void* w = nullptr;  // [n, k] bf16 / f8_e4m3 / f32, 16-byte aligned
    const float* scale = nullptr;  // f8: [scale_rows, scale_cols]
    void* y = nullptr;        // [rows, n]
    int y_dtype = XINFER_DTYPE_F32;
    int rows = 1, split = 1;
    int64_t n = 0, k = 0;
    int64_t scale_cols = 0, block_rows = 128, block_cols = 128, shard_rows = 0, blocks_per_shard = 0;
    bool one_scale = true;    // f8: block_cols % 16 == 0, so a 16-value chunk lies in one scale block
};
// The norm fused in front of the streaming GEMV (kNorm: ADD_RMSNORM_MATMUL of a router, see
// norm_rows_to_shared): x is not read; every block computes it from these into shared memory. (A
// separate kernel parameter after StreamGemv, so the other instances' code is unchanged.)
struct NormArgs {
    void* residual = nullptr;       // [rows, k] bf16, += delta in place (by the last block to arrive)
    const void* delta = nullptr;    // [rows, k] bf16, or null (a plain RMSNORM)
    const void* weight = nullptr;   // [k] f32 or bf16
    int weight_dtype = XINFER_DTYPE_F32;
    float eps = 0.f;
    void* normed = nullptr;         // [rows, k] bf16, written by the last block to arrive
    int* arrivals = nullptr;        // Context::arrivals: zero between launches
};

__device__ __forceinline__ uint4 load_stream(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// E consecutive x values at element offset k of row `row`, as f32; kShared: row is in shared
// memory (plain loads instead of the read-only path).
template <typename XT, int E, bool kShared = false>
__device__ __forceinline__ void load_x(const XT* row, int64_t k, float (&out)[E]) {
    static_assert(!kShared || (std::is_same_v<XT, __nv_bfloat16> && (E == 4 || E == 8)),
                  "shared x: the norm-fused GEMVs' bf16 rows");
    if constexpr (std::is_same_v<XT, float>) {
#pragma unroll
        for (int i = 0; i < E; i += 4) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(row + k + i));
            out[i] = v.x;
            out[i + 1] = v.y;
            out[i + 2] = v.z;
            out[i + 3] = v.w;
        }
    } else if constexpr (E == 4) {
        const uint2* p = reinterpret_cast<const uint2*>(row + k);
        const uint2 v = kShared ? *p : __ldg(p);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            out[2 * i] = f.x;
            out[2 * i + 1] = f.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < E; i += 8) {
            const uint4* p = reinterpret_cast<const uint4*>(row + k + i);
            const uint4 v = kShared ? *p : __ldg(p);
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 f = __bfloat1622float2(h[e]);
                out[i + 2 * e] = f.x;
                out[i + 2 * e + 1] = f.y;
            }
        }
    }
}

// One 16-byte weight chunk widened to f32 (E = 8 bf16, 16 e4m3 or 4 f32 values).
template <int WT, int E>
__device__ __forceinline__ void widen(const uint4& raw, float (&w)[E]) {
    if constexpr (WT == XINFER_DTYPE_F8_E4M3) {
        const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
#pragma unroll
        for (int e = 0; e < E / 2; ++e) {
            const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[e], __NV_E4M3)));
            w[2 * e] = f.x;
            w[2 * e + 1] = f.y;
        }
    } else if constexpr (WT == XINFER_DTYPE_BF16) {
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int e = 0; e < E / 2; ++e) {
            const float2 f = __bfloat1622float2(h[e]);
            w[2 * e] = f.x;
            w[2 * e + 1] = f.y;
        }
    } else {
        w[0] = __uint_as_float(raw.x);
        w[1] = __uint_as_float(raw.y);
        w[2] = __uint_as_float(raw.z);
        w[3] = __uint_as_float(raw.w);
    }
}

template <int WT>
constexpr int stream_chunk() {
    return WT == XINFER_DTYPE_F8_E4M3 ? 16 : WT == XINFER_DTYPE_BF16 ? 8 : 4;
}

// The norm in front of a router's GEMV (ADD_RMSNORM_MATMUL, kNorm): every block normalises the
// rows itself - residual (+ delta, rounded to bf16 as ADD_RMSNORM stores it), sum of squares,
// bf16(v · rsqrt(mean + eps) · w) as rmsnorm_kernel computes it - into shared memory: normed_s,
// the GEMV's x, and resid_s, the updated residual. Block-wide (synchronizes). A router is a few
// hundred KB to 4 MB read by ≤ 256 blocks, so the prologue repeated per block costs less than the
// launch boundary and the L2 round trip of `normed` it saves (a bandwidth-bound projection pays it
// in front of every block's stream instead: session 13's fused q|k|v lost 4-8 µs).
// The norm weights of a thread's first kNormFirstVecs vectors (all of them up to K = 4,096), read
// before the PDL wait: they are constant, and read after the reduction they were one more round trip.
constexpr int kNormFirstVecs = 2;
struct NormWeights {
    float w[kNormFirstVecs][8];
};
__device__ __forceinline__ NormWeights load_norm_first(const NormArgs& p, int64_t K) {
    NormWeights nw;
#pragma unroll
    for (int v = 0; v < kNormFirstVecs; ++v) {
        const int64_t i = threadIdx.x + int64_t(v) * blockDim.x;
#pragma unroll
        for (int e = 0; e < 8; ++e) nw.w[v][e] = i < K / 8 ? load_f(p.weight, p.weight_dtype, i * 8 + e) : 0.f;
    }
    return nw;
}
__device__ void norm_rows_to_shared(const NormArgs& p, int64_t K, const NormWeights& nw, int rows,
                                    __nv_bfloat16* normed_s, __nv_bfloat16* resid_s, float* red /*[32]*/) {
    for (int r = 0; r < rows; ++r) {
        const uint4* res = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.residual) + r * K);
        const uint4* del = p.delta ? reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.delta) + r * K)
                                   : nullptr;
        uint4* res_s = reinterpret_cast<uint4*>(resid_s + r * K);
        float sum_squares = 0.f;
        const auto add = [&](int64_t i, const uint4& a, const uint4& b) {  // 8 bf16 per vector
            const __nv_bfloat162* ah = reinterpret_cast<const __nv_bfloat162*>(&a);
            const __nv_bfloat162* bh = reinterpret_cast<const __nv_bfloat162*>(&b);
            uint4 v;
            __nv_bfloat162* vh = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 fa = __bfloat1622float2(ah[e]), fb = __bfloat1622float2(bh[e]);
                vh[e] = del ? __floats2bfloat162_rn(fa.x + fb.x, fa.y + fb.y) : ah[e];
                const float2 fv = __bfloat1622float2(vh[e]);
                sum_squares += fv.x * fv.x;
                sum_squares += fv.y * fv.y;
            }
            res_s[i] = v;
        };
        // The first vectors' loads all go out before any is used (one round trip to L2).
        uint4 a[kNormFirstVecs], b[kNormFirstVecs];
#pragma unroll
        for (int v = 0; v < kNormFirstVecs; ++v) {
            const int64_t i = threadIdx.x + int64_t(v) * blockDim.x;
            a[v] = b[v] = make_uint4(0, 0, 0, 0);
            if (i < K / 8) {
                a[v] = __ldcg(res + i);
                if (del) b[v] = __ldcg(del + i);
            }
        }
#pragma unroll
        for (int v = 0; v < kNormFirstVecs; ++v)
            if (const int64_t i = threadIdx.x + int64_t(v) * blockDim.x; i < K / 8) add(i, a[v], b[v]);
        for (int64_t i = threadIdx.x + int64_t(kNormFirstVecs) * blockDim.x; i < K / 8; i += blockDim.x)
            add(i, __ldcg(res + i), del ? __ldcg(del + i) : make_uint4(0, 0, 0, 0));
        const float inv_rms = rsqrtf(block_sum(sum_squares, red) / float(K) + p.eps);
        // Each thread rereads only the vectors it wrote itself.
        uint4* out_s = reinterpret_cast<uint4*>(normed_s + r * K);
        const auto normalize = [&](int64_t i, const float (&w)[8]) {
            const uint4 x = res_s[i];
            const __nv_bfloat162* xh = reinterpret_cast<const __nv_bfloat162*>(&x);
            uint4 o;
            __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 f = __bfloat1622float2(xh[e]);
                oh[e] = __floats2bfloat162_rn(f.x * inv_rms * w[2 * e], f.y * inv_rms * w[2 * e + 1]);
            }
            out_s[i] = o;
        };
#pragma unroll
        for (int v = 0; v < kNormFirstVecs; ++v)
            if (const int64_t i = threadIdx.x + int64_t(v) * blockDim.x; i < K / 8) normalize(i, nw.w[v]);
        for (int64_t i = threadIdx.x + int64_t(kNormFirstVecs) * blockDim.x; i < K / 8; i += blockDim.x) {
            float w[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) w[e] = load_f(p.weight, p.weight_dtype, i * 8 + e);
            normalize(i, w);
        }
    }
    __syncthreads();
}

// kNorm: after every block has read the residual, the last one to arrive stores the updated
// residual (with delta) and `normed` from its shared copies and re-arms the counter; the other
// blocks' reads are complete by then (their values are in shared memory), so no block can see a
// residual the op already updated.
__device__ void store_norm_if_last(const NormArgs& p, int64_t K, int rows, const __nv_bfloat16* normed_s,
                                   const __nv_bfloat16* resid_s) {
    __shared__ bool last;
    if (threadIdx.x == 0) last = atomicAdd(p.arrivals, 1) == int(gridDim.x) - 1;
    __syncthreads();
    if (!last) return;
    const int64_t n = int64_t(rows) * K / 8;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        reinterpret_cast<uint4*>(p.normed)[i] = reinterpret_cast<const uint4*>(normed_s)[i];
        if (p.delta) reinterpret_cast<uint4*>(p.residual)[i] = reinterpret_cast<const uint4*>(resid_s)[i];
    }
    if (threadIdx.x == 0) *p.arrivals = 0;
}

// R: rows of x per block, p.rows rounded up to 1, 2, 4 or 8 (more rows: 8 per block, grid.y groups).
// kDepth > 0 (pipelined): a lane's rounds of U = kDepth loads are double-buffered - round r + 1 is
// requested before round r's FMAs - and round 0 goes into registers before the PDL wait (instead of
// an L2 prefetch, which costs a second request per line). kDepth = 0: one round of U loads at a time.
// kNorm: x is normalised by the block itself (norm_rows_to_shared; one group of rows, grid.y = 1).
template <int WT, typename XT, int R, int kDepth, bool kNorm = false>
__global__ void __launch_bounds__(kStreamThreads, 2) stream_gemv_kernel(StreamGemv p, NormArgs norm) {
    constexpr int E = stream_chunk<WT>();
    static_assert(!kNorm || (WT == XINFER_DTYPE_F32 && std::is_same_v<XT, __nv_bfloat16> && kDepth > 0));
    constexpr bool kPipelined = kDepth > 0;
    constexpr int U = kPipelined ? kDepth : R >= 8 ? 4 : 8;  // 16-byte weight loads per lane and round
    constexpr bool kFp8 = WT == XINFER_DTYPE_F8_E4M3;
    __shared__ float partial[kStreamWarps][R];

    const int S = p.split;
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    const int part = warp % S;
    const int64_t n = int64_t(blockIdx.x) * (kStreamWarps / S) + warp / S;
    const bool active = n < p.n;
    const int chunks = int(p.k / E), step = 32 * S, stride = step * U;
    // blockIdx.y: which group of R rows of x (more than one only for f32 weights, see
    // stream_gemv_fits); rows past p.rows are dead.
    const int64_t row0 = int64_t(blockIdx.y) * R;
    const int rows = int(min(int64_t(R), p.rows - row0));
    extern __shared__ __align__(16) __nv_bfloat16 norm_smem[];  // kNorm: normed [rows, k], then the residual
    const XT* x = kNorm ? reinterpret_cast<const XT*>(norm_smem) : static_cast<const XT*>(p.x) + row0 * p.k;
    const int64_t y0 = row0 * p.n;  // element offset of the group's first y row
    const char* w_row = static_cast<const char*>(p.w) + n * p.k * int64_t(16 / E);
    const int first = part * 32 + lane;  // the lane's first chunk; its rounds are `stride` apart

    const auto load_round = [&](int c0, uint4 (&raw)[U]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * step;
            raw[u] = c < chunks ? load_stream(w_row + int64_t(c) * 16) : make_uint4(0, 0, 0, 0);
        }
    };
    float acc[R];
#pragma unroll
    for (int j = 0; j < R; ++j) acc[j] = 0.f;
    const float* scale_row = nullptr;
    if constexpr (kFp8)
        if (active)
            scale_row = p.scale + ((n / p.shard_rows) * p.blocks_per_shard + (n % p.shard_rows) / p.block_rows) *
                                      p.scale_cols;
    const int block_cols = int(p.block_cols);
    const auto use_round = [&](int c0, const uint4 (&raw)[U]) {
        [[maybe_unused]] float s[U];
        if constexpr (kFp8) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + u * step;
                s[u] = c < chunks && p.one_scale ? __ldg(scale_row + (c * E) / block_cols) : 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * step;
            if (c >= chunks) break;
            float w[E];
            widen<WT, E>(raw[u], w);
            if constexpr (kFp8) {
                if (!p.one_scale) {
#pragma unroll
                    for (int e = 0; e < E; ++e) w[e] *= __ldg(scale_row + (c * E + e) / block_cols);
                    s[u] = 1.f;
                }
            }
#pragma unroll
            for (int j = 0; j < R; ++j) {
                if (j >= rows) break;
                float xv[E];
                load_x<XT, E, kNorm>(x + int64_t(j) * p.k, int64_t(c) * E, xv);
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < E; ++e) d = fmaf(w[e], xv[e], d);
                if constexpr (kFp8)
                    acc[j] = fmaf(d, s[u], acc[j]);
                else
                    acc[j] += d;
            }
        }
    };

    if constexpr (kPipelined) {
        // Weights are constant: round 0 may be read before the previous kernel has finished
        // (programmatic dependent launch); x only after the wait.
        uint4 cur[U], nxt[U];
        if (active) load_round(first, cur);
        [[maybe_unused]] NormWeights nw;
        if constexpr (kNorm) nw = load_norm_first(norm, p.k);
        pdl_begin();
        if constexpr (kNorm) {
            norm_rows_to_shared(norm, p.k, nw, rows, norm_smem, norm_smem + int64_t(rows) * p.k, &partial[0][0]);
            store_norm_if_last(norm, p.k, rows, norm_smem, norm_smem + int64_t(rows) * p.k);
        }
        if (active)
            for (int c0 = first; c0 < chunks; c0 += 2 * stride) {
                if (c0 + stride < chunks) load_round(c0 + stride, nxt);
                use_round(c0, cur);
                if (c0 + stride >= chunks) break;
                if (c0 + 2 * stride < chunks) load_round(c0 + 2 * stride, cur);
                use_round(c0 + stride, nxt);
            }
    } else {
        // The lane's first U chunks may be requested into L2 before the previous kernel has
        // finished; x is read only after the wait.
        if (active)
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = first + u * step;
                if (c < chunks) asm volatile("prefetch.global.L2 [%0];" ::"l"(w_row + int64_t(c) * 16));
            }
        pdl_begin();
        if (active)
            for (int c0 = first; c0 < chunks; c0 += stride) {
                uint4 raw[U];
                load_round(c0, raw);
                use_round(c0, raw);
            }
    }
#pragma unroll
    for (int j = 0; j < R; ++j) acc[j] = warp_sum(acc[j]);
    if (S == 1) {  // block-uniform
        if (active && lane == 0)
#pragma unroll
            for (int j = 0; j < R; ++j)
                if (j < rows) store_f(p.y, p.y_dtype, y0 + int64_t(j) * p.n + n, acc[j]);
        return;
    }
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < R; ++j) partial[warp][j] = acc[j];
    __syncthreads();
    if (part == 0 && active && lane < rows) {
        float total = 0.f;
        for (int q = 0; q < S; ++q) total += partial[warp + q][lane];
        store_f(p.y, p.y_dtype, y0 + int64_t(lane) * p.n + n, total);
    }
}

// ---- the norm before a one-token bf16 projection, in a one-wave streaming GEMV -----------------------
// ADD_RMSNORM_MATMUL for one row of bf16 weights (the fused q|k|v of a decode step): the norm's
// own launch sat on every layer's chain (H200, in the replayed bf16 step: 2.3 µs a layer). Two
// earlier fusions put the norm in front of every block's stream and lost (sessions 13 and 19):
// 1,856 blocks each paid it, and each waited on a contended atomic before streaming. Here the grid
// is one wave (the blocks that fit at once), so each block normalises once
// (norm_rows_to_shared, while its first weights are in flight) and then loops over row groups: a
// warp streams row (b + i·gridDim.x)·8 + warp for i = 0, 1, ..., its rounds pipelined across the
// rows' boundaries as within a row. No block waits on another: each raises a counter (red.release,
// no reply awaited) once it has read the residual, and warp 0 of the last block - which has at most
// as many rows as any other - stores the updated residual and `normed` after its rows, when the
// count shows every block has read. x is `normed` from shared memory, as the two-op path computes it.
__device__ __forceinline__ void red_release_add_gpu(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Four blocks per SM (63 registers). Five (48 registers, with spills) read MiMo's q|k|v about as
// fast alone but slowed the bf16 decode step by 0.6-0.8 points (H200, session 30).
// The end of a one-wave norm GEMV: the last block's warps store normed and the updated residual
// (from the block's shared copies), a slice each, once the count shows every block has read the
// residual (each block raised it after its norm_rows_to_shared); the last warp out re-arms the
// counter. Call with the whole block, after its stream.
__device__ void store_norm_once_read(const NormArgs& norm, int64_t K, const __nv_bfloat16* normed_s,
                                     const __nv_bfloat16* resid_s) {
    if (blockIdx.x != gridDim.x - 1) return;
    const int lane = int(threadIdx.x) % 32, warps = int(blockDim.x) / 32;
    if (lane == 0)
        while (ld_acquire_gpu(norm.arrivals) < int(gridDim.x)) __nanosleep(32);
    __syncwarp();
    for (int64_t i = threadIdx.x; i < K / 8; i += blockDim.x) {
        reinterpret_cast<uint4*>(norm.normed)[i] = reinterpret_cast<const uint4*>(normed_s)[i];
        if (norm.delta) reinterpret_cast<uint4*>(norm.residual)[i] = reinterpret_cast<const uint4*>(resid_s)[i];
    }
    if (lane == 0 && atomicAdd(norm.arrivals, 1) == int(gridDim.x) + warps - 1)
        *norm.arrivals = 0;  // the next launch raises it only after its PDL wait
}

template <int U>
__global__ void __launch_bounds__(kStreamThreads, 4) norm_stream_gemv_kernel(StreamGemv p, NormArgs norm) {
    constexpr int E = stream_chunk<XINFER_DTYPE_BF16>();
    extern __shared__ __align__(16) __nv_bfloat16 norm_smem[];  // normed [k], then the updated residual [k]
    __shared__ float red[32];
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    const int chunks = int(p.k / E), stride = 32 * U;
    const int rounds_per_row = (chunks + stride - 1) / stride;
    const int64_t row_step = int64_t(gridDim.x) * kStreamWarps, first_row = int64_t(blockIdx.x) * kStreamWarps + warp;
    const int64_t my_rows = first_row < p.n ? (p.n - 1 - first_row) / row_step + 1 : 0;
    const int64_t rounds = my_rows * rounds_per_row;
    const __nv_bfloat16* x = norm_smem;

    // Two cursors over the warp's rounds, one for loads and one (two rounds behind) for FMAs.
    struct Cursor {
        int64_t row;
        int round;
        __device__ void advance(int per_row, int64_t step) {
            if (++round == per_row) round = 0, row += step;
        }
    };
    Cursor at_load{first_row, 0}, at_use{first_row, 0};
    const auto load_round = [&](uint4 (&raw)[U]) {
        const char* w_row = static_cast<const char*>(p.w) + at_load.row * p.k * 2;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = lane + at_load.round * stride + u * 32;
            raw[u] = c < chunks ? load_stream(w_row + int64_t(c) * 16) : make_uint4(0, 0, 0, 0);
        }
        at_load.advance(rounds_per_row, row_step);
    };
    float acc = 0.f;
    const auto use_round = [&](const uint4 (&raw)[U]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = lane + at_use.round * stride + u * 32;
            if (c >= chunks) break;
            float w[E], xv[E];
            widen<XINFER_DTYPE_BF16, E>(raw[u], w);
            load_x<__nv_bfloat16, E, true>(x, int64_t(c) * E, xv);
#pragma unroll
            for (int e = 0; e < E; ++e) acc = fmaf(w[e], xv[e], acc);
        }
        if (at_use.round == rounds_per_row - 1) {  // the row's last round: its sum is complete
            const float total = warp_sum(acc);
            if (lane == 0) store_f(p.y, p.y_dtype, at_use.row, total);
            acc = 0.f;
        }
        at_use.advance(rounds_per_row, row_step);
    };

    // Weights are constant: the first two rounds are requested before the previous kernel has
    // finished, and stay in flight while the block normalises. Then one round ahead of the FMAs.
    uint4 cur[U], nxt[U];
    if (rounds > 0) load_round(cur);
    if (rounds > 1) load_round(nxt);
    const NormWeights nw = load_norm_first(norm, p.k);
    pdl_begin();
    norm_rows_to_shared(norm, p.k, nw, 1, norm_smem, norm_smem + p.k, red);  // ends with a block barrier
    if (threadIdx.x == 0) red_release_add_gpu(norm.arrivals, 1);
    for (int64_t r = 0; r < rounds; r += 2) {
        use_round(cur);
        if (r + 2 < rounds) load_round(cur);
        if (r + 1 >= rounds) break;
        use_round(nxt);
        if (r + 3 < rounds) load_round(nxt);
    }
    store_norm_once_read(norm, p.k, norm_smem, norm_smem + p.k);
}

// XINFER_CUDA_GEMV_PIPELINE: loads per lane and round of the pipelined bf16 / f32 streaming GEMV
// (1, 2 or 4); 0 (or any other value) = one round of 8 (R ≥ 8: 4) at a time (A/B). FP8 weights keep
// one round at a time (their instances use 96-128 registers already). H200, MiMo bf16 batch-1
// decode, two runs each: 0: 76.7 / 76.7%; 1: 80.0 / 79.7%; 2: 80.5 / 80.4 / 79.9 / 80.2%; 4: 78.2 /
// 78.2 / 78.5 / 78.4%; 6: 77.2 / 76.6%; 8: 74.0 / 74.1% (6 and 8 no longer built). Fewer registers
// mean more blocks per SM (depth 2: 46 registers, 5 blocks), and round 0 of each of them is
// requested before the PDL wait.
int gemv_pipeline_depth() {
    static const int depth = int(env_int("XINFER_CUDA_GEMV_PIPELINE", 2));
    return depth;
}

template <int WT, typename XT, int kDepth>
int launch_stream_rows(Context* c, const StreamGemv& p, dim3 grid) {
    const char* what = "stream_gemv_kernel";
    const NormArgs none;
    if (p.rows <= 1) return launch_pdl(c, what, stream_gemv_kernel<WT, XT, 1, kDepth>, grid, dim3(kStreamThreads), 0, p, none);
    if (p.rows <= 2) return launch_pdl(c, what, stream_gemv_kernel<WT, XT, 2, kDepth>, grid, dim3(kStreamThreads), 0, p, none);
    if (p.rows <= 4) return launch_pdl(c, what, stream_gemv_kernel<WT, XT, 4, kDepth>, grid, dim3(kStreamThreads), 0, p, none);
    return launch_pdl(c, what, stream_gemv_kernel<WT, XT, 8, kDepth>, grid, dim3(kStreamThreads), 0, p, none);
}

template <int WT, typename XT>
int launch_stream_rows(Context* c, const StreamGemv& p, dim3 grid) {
    if constexpr (WT != XINFER_DTYPE_F8_E4M3) {
        if (gemv_pipeline_depth() == 4) return launch_stream_rows<WT, XT, 4>(c, p, grid);
        if (gemv_pipeline_depth() == 2) return launch_stream_rows<WT, XT, 2>(c, p, grid);
        if (gemv_pipeline_depth() == 1) return launch_stream_rows<WT, XT, 1>(c, p, grid);
    }
    return launch_stream_rows<WT, XT, 0>(c, p, grid);
}

// ---- few-token GEMV on the tensor cores (FP8 and bf16 weights) -------------------------------------
// The streaming GEMV above widens every e4m3 weight to f32 for its FMAs: ~4 instructions per weight
// byte, and MiMo's fused FP8 qkv (60.8 MB) took 35.2 µs on H200, 41% of copy bandwidth. This
// kernel reads the weights the way the grouped expert kernels do (moe.cu; their e4m3 gate_up runs
// at 77%): a warp owns a 16-row tile and every parts-th round of K, widens e4m3 exactly to bf16 A
// fragments and runs mma.sync with the tokens as B's 8 columns (so T ≤ 8 costs what T = 1 does),
// its rounds staged through a cp.async ring in shared memory (weight_stream.cuh); the parts meet
// in shared memory in a fixed order. FP8 needs block_cols % 64 == 0 (a lane quad's 64-column chunk
// lies in one scale block), block_rows and shard rows % 16 == 0 (a tile lies in one scale row),
// K % 16 == 0.
// H200 (ncu, FP8 bench model): the fused qkv 35.2 -> 28.6 µs (50% of copy; still short of the
// expert kernels: a warp's 32 KB is only 16 rounds); FP8 batch-1 decode 50.7 -> 53.4% of copy, the
// 8-token DFlash verify step 13.26 -> 10.88 ms. 2 or 1 tiles per block (more, smaller blocks per
// SM) read the same as 4 (53.0-53.2%), and a ring of 6 slots instead of 4 slightly less (52.8-52.9
// against 53.1-53.2%).
// Session 14 (ncu: 428 instructions per 2 KB warp round, a third of the stall samples on the
// dependent mma chain, 30% of the instructions the widening through f32 to bf16): the first
// rounds go into the ring itself before the PDL wait; a round's two chunks are interleaved
// independent mma chains; and when x is small (kFp8MmaF16MaxBytes) it is staged in shared memory
// as power-of-two-scaled f16 (stage_act_f16) so the weights widen to f16 in one conversion per
// pair for the f16 mma — exact products as before. H200, ops-test --perf, T = 1: the fused qkv
// [14848, 4096] 33.6 -> 20.0 µs (71% of copy), [32768, 4096] 62.1 -> 40.3 µs (78%).
// bf16 weights (session 17) take the same stream with no widening at all: a lane's 16-byte words
// are its A fragments as loaded (AFrag<false>), ~30 instructions per 2 KB round against the
// streaming GEMV's ~20 per 16 bytes, and T ≤ 8 tokens cost one mma each like T = 1. A bf16 block
// is one tile whose 8 warps take every 8th round (the fused q|k|v [14848, 4096] read 33 µs so
// against 41 with two warps per tile); FP8 keeps two (its rows are half as many bytes: with 8
// parts the FP8 q|k|v took 29 µs against 18).
constexpr int kMmaGemvWarps = 8;
// Ring shapes: kU 64-byte chunks of each of the tile's rows per round, kRing slots (rounds) per warp.
template <int U, int Ring>
struct MmaGemvRing {
    static constexpr int kU = U, kRing = Ring;
    static constexpr size_t kBytes = size_t(kMmaGemvWarps) * kRing * 2 * kU * 32 * 16;
};
using MmaGemvRingDefault = MmaGemvRing<2, 4>;  // 64 KB
constexpr int kFp8MmaParts = 2;  // FP8: two warps per tile, each streaming every other round
constexpr int kBf16MmaParts = 8; // bf16: a block per tile, its 8 warps streaming every 8th round

// p.split = parts: the warps per 16-row tile (1, 2, 4 or 8).
// kNorm (one row, f16 staging): x is not read; the block normalises the residual itself
// (norm_rows_to_shared, after the ring's first rounds) and stages `normed` as f16; the end is
// store_norm_once_read, as in norm_stream_gemv_kernel.
template <bool kFp8, bool kEarly, bool kF16, typename Shape = MmaGemvRingDefault, bool kNorm = false>
__global__ void __launch_bounds__(kMmaGemvWarps * 32, 2) mma_gemv_kernel(StreamGemv p, NormArgs norm) {
    static_assert(kFp8 || !kF16, "the f16 mma is for e4m3 weights");
    static_assert(!kNorm || kF16, "the norm-fused instance stages normed as f16");
    constexpr int kMmaGemvU = Shape::kU, kMmaGemvRing = Shape::kRing;
    // [warps][kMmaGemvRing][2 · kMmaGemvU][32], then (kF16) x as f16 [rows, K]
    extern __shared__ __align__(16) uint4 mma_ring[];
    __shared__ float partial[kMmaGemvWarps][4][32];  // the sums of parts 1.., added by part 0
    __shared__ float x_inv[kGemvMaxRows];            // kF16: the rows' scales
    __shared__ int x_max[kGemvMaxRows];              // kF16: stage_act_f16's scratch
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, c = lane % 4;
    const int parts = p.split, tiles = kMmaGemvWarps / parts;
    const int tile = warp % tiles, part = warp / tiles;
    const int64_t n0 = (int64_t(blockIdx.x) * tiles + tile) * 16, K = p.k;
    const bool active = n0 < p.n;  // no early exit: the block synchronizes below
    constexpr int kBytes = kFp8 ? 1 : 2;
    constexpr int64_t kChunk = 64 / kBytes, kStep = kChunk * kMmaGemvU;  // columns
    const char* w = static_cast<const char*>(p.w);
    const char* w0 = w + min(n0 + g, p.n - 1) * K * kBytes;  // rows g and g + 8 of the tile
    const char* w1 = w + min(n0 + g + 8, p.n - 1) * K * kBytes;
    const float* scale_row = nullptr;
    if constexpr (kFp8) {
        const int64_t nt = min(n0, p.n - 1);
        scale_row = p.scale + ((nt / p.shard_rows) * p.blocks_per_shard + (nt % p.shard_rows) / p.block_rows) * p.scale_cols;
    }
    const auto scales = [&] {  // the tile's scales in the warp's lanes (a K of up to 64 scale blocks)
        if constexpr (kFp8) return WarpScales<2>(scale_row, p.scale_cols, p.block_cols, lane);
        else return RowScales{nullptr, ColBlock(64)};  // (unused for bf16)
    }();
    // B's column g is token g; columns past p.rows repeat the last token and are not stored.
    __half* x_f16 = reinterpret_cast<__half*>(mma_ring + kMmaGemvWarps * kMmaGemvRing * 2 * kMmaGemvU * 32);
    const __nv_bfloat16* xr = kF16 ? reinterpret_cast<const __nv_bfloat16*>(x_f16) + min(g, p.rows - 1) * K
                                   : static_cast<const __nv_bfloat16*>(p.x) + min(g, p.rows - 1) * K;

    struct Round {  // kMmaGemvU chunks of rows g and g + 8
        uint4 r0[kMmaGemvU], r1[kMmaGemvU];
    };
    // Weights are constant: the first rounds may be requested before the previous kernel has
    // finished (programmatic dependent launch); x is read only after the wait. kEarly: into the
    // ring itself; else only into L2.
    uint4* ring = mma_ring + warp * kMmaGemvRing * 2 * kMmaGemvU * 32;
    const char* const rows[2] = {w0, w1};
    LaneRounds<2, kMmaGemvU, kBytes> loads(rows, c, part * kStep, K, parts * kStep);
    if (active) {
        if constexpr (kEarly) {
            ring_issue_first<kMmaGemvRing>(loads, ring, lane);
        } else {
            auto ahead = loads;
            for (int d = 0; d < kMmaGemvRing - 1; ++d, ahead.advance())
#pragma unroll
                for (int m = 0; m < 2 * kMmaGemvU; ++m)
                    if (const char* a = ahead.address(m)) asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
        }
    }
    [[maybe_unused]] NormWeights nw;
    if constexpr (kNorm) nw = load_norm_first(norm, K);
    pdl_begin();
    // kNorm: normed [K] and the updated residual [K] after x_f16.
    [[maybe_unused]] __nv_bfloat16* norm_s = reinterpret_cast<__nv_bfloat16*>(x_f16 + K);
    if constexpr (kNorm) {
        __shared__ float red[32];
        norm_rows_to_shared(norm, K, nw, 1, norm_s, norm_s + K, red);  // ends with a block barrier
        if (threadIdx.x == 0) red_release_add_gpu(norm.arrivals, 1);
        stage_act_f16<true>(norm_s, 1, K, x_f16, x_inv, x_max);
    } else if constexpr (kF16) {
        stage_act_f16(static_cast<const __nv_bfloat16*>(p.x), int(p.rows), K, x_f16, x_inv, x_max);
    }

    // FP8 scales each chunk's sums into acc; bf16 keeps one accumulator per chunk of a round
    // (independent mma chains), summed at the end.
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    float chunk_acc[kMmaGemvU][4] = {};
    const auto use_round = [&](const Round& r, int64_t kb) {
        const auto load_x = [&](uint32_t(&xw)[8], int64_t col, bool ok) {
            if constexpr (kF16) load_x_frag<true, kActShared>(xw, xr, col, ok);
            else load_x_frag<kFp8>(xw, xr, col, ok);
        };
        if constexpr (kFp8) fp8_round_mma<kMmaGemvU, kF16>(r.r0, r.r1, kb, K, c, scales, load_x, acc);
        else bf16_round_mma<kMmaGemvU>(r.r0, r.r1, kb, K, c, load_x, chunk_acc);
    };
    if (active)
        stream_rounds_ring<kMmaGemvRing, Round>(part * kStep, K, parts * kStep, ring, lane, loads, use_round, kEarly);
    if constexpr (!kFp8)
#pragma unroll
        for (int u = 0; u < kMmaGemvU; ++u)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] += chunk_acc[u][i];
    if (parts > 1) {  // block-uniform
        if (part > 0)
#pragma unroll
            for (int i = 0; i < 4; ++i) partial[warp][i][lane] = acc[i];
        __syncthreads();
        if (part == 0)
            for (int q = 1; q < parts; ++q)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[i] += partial[warp + q * tiles][i][lane];
    }
    // Accumulator i: row n0 + g (+8 for i ≥ 2), token 2c + (i & 1).
    if (part == 0 && active)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int64_t row = n0 + g + (i >= 2 ? 8 : 0);
            const int token = 2 * c + (i & 1);
            if (row < p.n && token < p.rows)
                store_f(p.y, p.y_dtype, int64_t(token) * p.n + row, acc[i] * (kF16 ? x_inv[token] : 1.f));
        }
    if constexpr (kNorm) store_norm_once_read(norm, K, norm_s, norm_s + K);
}

// Whether an FP8 matmul goes to mma_gemv_kernel: the conditions above, x bf16 16-byte aligned,
// and enough blocks of 8 / kFp8MmaParts tiles to fill the SMs (smaller matrices keep the streaming
// GEMV, which splits K across warps). XINFER_CUDA_FP8_MMA_GEMV=0 turns it off.
bool fp8_mma_gemv_fits(const Context* c, const StreamGemv& p, bool x_aligned) {
    static const bool enabled = env_flag("XINFER_CUDA_FP8_MMA_GEMV", true);
    return enabled && p.rows >= 1 && p.rows <= 8 && x_aligned && p.k % 16 == 0 && p.block_cols % 64 == 0 &&
           col_block_exact(p.k, p.block_cols) && p.block_rows % 16 == 0 && p.shard_rows % 16 == 0 &&
           pointer_alignment(p.w) >= 16 &&
           ceil_div(p.n, int64_t(16 * kMmaGemvWarps / kFp8MmaParts)) >= std::max(c->sm_count, 1) &&
           p.n < (int64_t(1) << 31);
}

// Whether a bf16 matmul of T ≤ 8 rows may go to mma_gemv_kernel: x bf16 16-byte aligned, rows of
// whole 16-byte words (K % 8 == 0). op_matmul sends it there at T = 2..8 (instead of cuBLASLt),
// and at T = 1 when the streaming GEMV would split rows across warps (too few rows for 4 blocks of
// 8 whole rows per SM: MiMo's o_proj [4096, 8192]); row-rich T = 1 matmuls (q|k|v, lm_head) keep
// the streaming GEMV. H200, same-call A/Bs (session 17, docs/perf/2026-12-01-h200-session17.md):
// in isolation o_proj read 21.2 µs against the streaming GEMV's 20.0, yet in the graph-replayed
// step (its first rounds in flight before the PDL wait) FP8 batch-1 decode went 67.4 -> 69.3% and
// bf16 80.3 -> 81.3%; the fused q|k|v through it (parts 2: 41 µs against 32; parts 8: 33) gained
// nothing in the step. The 8-token DFlash verify step went 11.75 -> 11.34 ms (1.31 -> 1.25x a
// decode step). XINFER_CUDA_BF16_MMA_GEMV=0: the previous routing (A/B).
bool bf16_mma_gemv_fits(int64_t T, int64_t N, int64_t K, bool x_aligned, const void* w) {
    static const bool enabled = env_flag("XINFER_CUDA_BF16_MMA_GEMV", true);
    return enabled && T >= 1 && T <= kGemvMaxRows && x_aligned && K % 8 == 0 && K > 0 && N < (int64_t(1) << 31) &&
           pointer_alignment(w) >= 16;
}

// XINFER_CUDA_FP8_EARLY_RING=0 (either weight type): only an L2 prefetch of the first rounds before
// the PDL wait.
// x as f16 in shared memory (the f16 mma) when it takes at most kFp8MmaF16MaxBytes (two blocks
// still fit per SM) and XINFER_CUDA_FP8_F16_MMA has bit kF16MmaGemv; else the bf16 mma.
constexpr size_t kFp8MmaF16MaxBytes = 16 * 1024;
// The FP8 f16-mma GEMV's ring (U·10 + slots): at one token 4 chunks (256 bytes of a row) a round
// and 2 slots, else 2 × 4 (the other FP8 instances keep 2 × 4 too). H200, FP8 batch-1 decode
// (q|k|v [14848, 4096]), two rounds in one call (docs/perf/2026-12-02-h200-session24.md): graph
// 5.689 -> 5.646-5.649 ms, although alone (ops-test --perf) the GEMV read 17.5 -> 17.8 µs; 4 × 3
// and 2 × 6 slowed the step (5.713-5.720 ms). XINFER_CUDA_FP8_GEMV_RING=2x4 / 4x2 / 4x3 / 2x6 forces
// one (A/B).
int fp8_gemv_ring_shape(int64_t rows) {
    static const int forced = env_ring_shape("XINFER_CUDA_FP8_GEMV_RING", {24, 42, 43, 26});
    return forced ? forced : rows == 1 ? 42 : 24;
}
// The bf16 instance's ring: 4 × 2 (a warp's rounds read 256 bytes of a row instead of 128) at
// every row count it runs (1-8: o_proj at batch 1 in both models, the DFlash verify's and small
// serving batches' projections). H200, graph alone, same calls: bf16 decode 8.374-8.375 ->
// 8.327-8.336 ms (83.9 -> 84.4%), FP8 decode 5.595-5.599 -> 5.539-5.551 ms (session 24); DFlash
// verify of 8 tokens 11.33-11.35 -> 10.84-11.00 ms (1.30 -> 1.25-1.26x a decode step), serving at
// concurrency 8 74.7-74.8 -> 76.2-76.3% (session 25). XINFER_CUDA_BF16_GEMV_RING=2x4 / 4x2 / 4x3 /
// 2x6 forces one (A/B).
int bf16_gemv_ring_shape() {
    static const int forced = env_ring_shape("XINFER_CUDA_BF16_GEMV_RING", {24, 42, 43, 26});
    return forced ? forced : 42;
}
// mma_gemv_kernel<kFp8, early ring, kF16, shape, kNorm> with a ring shape (U·10 + slots;
// ring_bytes: its size).
using MmaGemvKernel = void (*)(StreamGemv, NormArgs);
template <bool kFp8, bool kF16, bool kNorm = false>
MmaGemvKernel early_ring_instance(int shape, size_t* ring_bytes) {
    const auto take = [&](auto ring) {
        using S = decltype(ring);
        *ring_bytes = S::kBytes;
        return mma_gemv_kernel<kFp8, true, kF16, S, kNorm>;
    };
    switch (shape) {
        case 42: return take(MmaGemvRing<4, 2>{});
        case 43: return take(MmaGemvRing<4, 3>{});
        case 26: return take(MmaGemvRing<2, 6>{});
        default: return take(MmaGemvRingDefault{});
    }
}
bool fp8_early_ring_enabled() {
    static const bool early = env_flag("XINFER_CUDA_FP8_EARLY_RING", true);
    return early;
}
// norm: the one-row FP8 norm GEMV (ADD_RMSNORM_MATMUL; fp8_norm_gemv_fits), else null.
int launch_mma_gemv(Context* c, StreamGemv p, bool fp8, const NormArgs* norm = nullptr) {
    static_assert(MmaGemvRingDefault::kBytes > 48 * 1024, "the ring needs the opt-in shared memory size");
    const bool early = fp8_early_ring_enabled();
    const int64_t tiles = ceil_div(p.n, int64_t(16));
    p.split = fp8 ? kFp8MmaParts : kBf16MmaParts;
    const size_t x_f16_bytes = size_t(p.rows) * size_t(p.k) * 2;
    const bool f16 = fp8 && fp8_f16_mma_enabled(kF16MmaGemv) && x_f16_bytes <= kFp8MmaF16MaxBytes;
    // The early-ring instances of bf16 and of the f16 mma take their rule's ring shape; the rest
    // keep the default ring.
    size_t ring_bytes = MmaGemvRingDefault::kBytes;
    const MmaGemvKernel kernel =
        norm   ? early_ring_instance<true, true, true>(fp8_gemv_ring_shape(p.rows), &ring_bytes)
        : !early ? (!fp8 ? mma_gemv_kernel<false, false, false>
                   : f16 ? mma_gemv_kernel<true, false, true>
                         : mma_gemv_kernel<true, false, false>)
        : !fp8 ? early_ring_instance<false, false>(bf16_gemv_ring_shape(), &ring_bytes)
        : f16  ? early_ring_instance<true, true>(fp8_gemv_ring_shape(p.rows), &ring_bytes)
               : mma_gemv_kernel<true, true, false>;
    const size_t smem = ring_bytes + (f16 || norm ? x_f16_bytes : 0) + (norm ? size_t(p.k) * 2 * 2 : 0);
    XCUDA_TRY(c, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int64_t blocks = ceil_div(tiles, int64_t(kMmaGemvWarps / p.split));
    return launch_pdl(c, "mma_gemv_kernel", kernel, dim3(unsigned(blocks)), dim3(kMmaGemvWarps * 32), smem, p,
                      norm ? *norm : NormArgs{});
}

// Whether the one-row FP8 norm GEMV runs: the f16-mma instance with the early ring would take the
// matmul, and its blocks (ring, x_f16, normed and the residual in shared memory) fit one wave: the
// last block waits for every block's arrival before it stores.
bool fp8_norm_gemv_fits(Context* c, const StreamGemv& p) {
    if (p.rows != 1 || !fp8_mma_gemv_fits(c, p, true) || !fp8_early_ring_enabled() ||
        !fp8_f16_mma_enabled(kF16MmaGemv) || size_t(p.k) * 2 > kFp8MmaF16MaxBytes)
        return false;
    size_t ring_bytes = 0;
    const MmaGemvKernel kernel = early_ring_instance<true, true, true>(fp8_gemv_ring_shape(1), &ring_bytes);
    const size_t smem = ring_bytes + size_t(p.k) * 6;
    if (smem > c->smem_optin ||
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
        return false;
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kMmaGemvWarps * 32, smem) != cudaSuccess)
        return false;
    const int64_t blocks = ceil_div(ceil_div(p.n, int64_t(16)), int64_t(kMmaGemvWarps / kFp8MmaParts));
    return blocks <= int64_t(per_sm) * c->sm_count;
}

// XINFER_CUDA_DENSE_GEMV=0 restores the previous routing (cuBLASLt for bf16/f32 weights, gemv_kernel
// for f8), =all sends every fitting T ≤ 8 matmul to the streaming GEMV; unset: the fixed rule below.
int dense_gemv_mode() {  // 0 off, 1 rule, 2 all
    static const int mode = [] {
        const char* v = std::getenv("XINFER_CUDA_DENSE_GEMV");
        if (v && std::strcmp(v, "0") == 0) return 0;
        if (v && std::strcmp(v, "all") == 0) return 2;
        return 1;
    }();
    return mode;
}
bool dense_gemv_enabled() { return dense_gemv_mode() != 0; }

// Where the streaming GEMV beat the previous path on H200 (ops-test --perf, both paths in one run,
// docs/perf/2026-11-30-h200-gemv.md). bf16: at T = 1 everywhere (k/v 2.3-3x, o/q/gate_up/lm_head
// 1-3% faster). At T = 2..8 it won in isolation only up to 1536×4096 (k/v), yet in a whole 8-token
// verify step cuBLASLt there was faster: 17.29 vs 18.11 ms with batch-1 decode unchanged
// (docs/perf/2026-11-30-h200-session3.md), so bf16 streams at T = 1 only. f8: everywhere except
// T = 1 with 512 < N·K/4096 ≤ 1536 (k/v, where gemv_kernel was 0.7-1.5 µs faster). f32 (routers):
// always.
bool stream_gemv_wins(int64_t T, int64_t N, int64_t K, int w_dtype) {
    if (dense_gemv_mode() == 2) return true;
    const int64_t elems = N * K;
    switch (w_dtype) {
        case XINFER_DTYPE_BF16: return T == 1;
        case XINFER_DTYPE_F8_E4M3: return !(T == 1 && elems > 512 * 4096 && elems <= 1536 * 4096);
        default: return true;
    }
}

// The fixed routing rule: T ≤ 8 rows with bf16 / f8 / f32 weights whose rows split into 16-byte
// chunks, x bf16 (or f32 with f32 weights) 16-byte aligned. f32 weights (MoE routers, 32-256 rows)
// also up to kStreamMaxRowsF32 rows, in groups of 8 that each re-read the weight (from L2): at
// serving batches of 64 the router took 16 µs on cuBLASLt (x widened to f32 first, then an f32
// GEMM) for 0.5 MB of weights (H200, eager profile of the concurrency-64 bench).
constexpr int64_t kStreamMaxRowsF32 = 64;
bool stream_gemv_fits(int64_t T, int64_t K, int w_dtype, int x_dtype, bool x_aligned, const void* w) {
    if (T < 1 || T > (w_dtype == XINFER_DTYPE_F32 ? kStreamMaxRowsF32 : kGemvMaxRows)) return false;
    int chunk = 0;
    switch (w_dtype) {
        case XINFER_DTYPE_BF16: chunk = 8; break;
        case XINFER_DTYPE_F8_E4M3: chunk = 16; break;
        case XINFER_DTYPE_F32: chunk = 4; break;
        default: return false;
    }
    const bool x_ok = x_dtype == XINFER_DTYPE_BF16 || (x_dtype == XINFER_DTYPE_F32 && w_dtype == XINFER_DTYPE_F32);
    return x_ok && x_aligned && K % chunk == 0 && K / chunk < (int64_t(1) << 30) && pointer_alignment(w) >= 16;
}

// The streaming GEMV's K split: the warps per weight row (see stream_gemv_kernel).
int stream_gemv_split(const Context* c, int64_t n, int64_t k, int w_dtype) {
    const int64_t chunks = k / (w_dtype == XINFER_DTYPE_F8_E4M3 ? 16 : w_dtype == XINFER_DTYPE_BF16 ? 8 : 4);
    const int64_t target_blocks = 4 * int64_t(std::max(c->sm_count, 1));
    int split = 1;
    while (split < kStreamWarps && ceil_div(n, kStreamWarps / split) < target_blocks && chunks >= 64 * split)
        split *= 2;
    return split;
}

// The norm-fused router GEMV (kNorm): one group of ≤ kGemvMaxRows rows whose normed and updated
// residual (4 bytes per element) fit kNormRouterMaxSmem, the default pipeline (rounds of 2).
constexpr size_t kNormRouterMaxSmem = 48 * 1024;
int launch_norm_stream_gemv(Context* c, StreamGemv p, const NormArgs& n) {
    constexpr int f32 = XINFER_DTYPE_F32;
    using bf16 = __nv_bfloat16;
    p.split = stream_gemv_split(c, p.n, p.k, f32);
    const dim3 grid(unsigned(ceil_div(p.n, kStreamWarps / p.split))), block(kStreamThreads);
    const size_t smem = size_t(p.rows) * size_t(p.k) * 4;
    const char* what = "stream_gemv_kernel(norm)";
    if (p.rows <= 1) return launch_pdl(c, what, stream_gemv_kernel<f32, bf16, 1, 2, true>, grid, block, smem, p, n);
    if (p.rows <= 2) return launch_pdl(c, what, stream_gemv_kernel<f32, bf16, 2, 2, true>, grid, block, smem, p, n);
    if (p.rows <= 4) return launch_pdl(c, what, stream_gemv_kernel<f32, bf16, 4, 2, true>, grid, block, smem, p, n);
    return launch_pdl(c, what, stream_gemv_kernel<f32, bf16, 8, 2, true>, grid, block, smem, p, n);
}

// The one-row bf16 norm GEMV (norm_stream_gemv_kernel): normed and the updated residual in shared
// memory, one wave of blocks.
constexpr size_t kNormGemvMaxSmem = 48 * 1024;
int launch_norm_row_gemv(Context* c, const StreamGemv& p, const NormArgs& n) {
    const auto kernel = norm_stream_gemv_kernel<2>;
    const size_t smem = size_t(p.k) * 2 * 2;
    static int blocks_per_sm = 0;  // the same on every device of a process's kind
    if (blocks_per_sm == 0)
        XCUDA_TRY(c, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kStreamThreads, smem));
    if (blocks_per_sm == 0) return XINFER_UNSUPPORTED;
    // As many row groups for every block (the last one fewer): with 3 or 4 groups a block, the
    // blocks of 3 finished first and left DRAM a quarter of the time short of requests (H200,
    // MiMo's q|k|v: 36.1 µs against the plain GEMV's 31.6).
    const int64_t groups = ceil_div(p.n, kStreamWarps);
    const int64_t per_block = ceil_div(groups, int64_t(blocks_per_sm) * std::max(c->sm_count, 1));
    const int64_t blocks = ceil_div(groups, per_block);
    return launch_pdl(c, "norm_stream_gemv_kernel", kernel, dim3(unsigned(blocks)), dim3(kStreamThreads), smem, p, n);
}

int launch_stream_gemv(Context* c, StreamGemv p, int w_dtype, int x_dtype) {
    p.split = stream_gemv_split(c, p.n, p.k, w_dtype);
    if (p.shard_rows <= 0) p.shard_rows = p.n;
    if (p.blocks_per_shard <= 0) p.blocks_per_shard = ceil_div(p.shard_rows, p.block_rows);
    const int64_t blocks = ceil_div(p.n, kStreamWarps / p.split);
    if (blocks > int64_t(INT32_MAX)) {
        set_error(c, "cuda matmul: N = %lld is too large for the streaming GEMV", (long long)p.n);
        return XINFER_ERROR;
    }
    const dim3 grid = dim3(unsigned(blocks), unsigned(ceil_div(p.rows, kGemvMaxRows)), 1);
    if (w_dtype == XINFER_DTYPE_BF16) return launch_stream_rows<int(XINFER_DTYPE_BF16), __nv_bfloat16>(c, p, grid);
    if (w_dtype == XINFER_DTYPE_F8_E4M3) return launch_stream_rows<int(XINFER_DTYPE_F8_E4M3), __nv_bfloat16>(c, p, grid);
    if (x_dtype == XINFER_DTYPE_F32) return launch_stream_rows<int(XINFER_DTYPE_F32), float>(c, p, grid);
    return launch_stream_rows<int(XINFER_DTYPE_F32), __nv_bfloat16>(c, p, grid);
}

// ---- cuBLASLt --------------------------------------------------------------------------------------

cudaDataType cuda_type(int dtype) {
    switch (dtype) {
        case XINFER_DTYPE_BF16: return CUDA_R_16BF;
        case XINFER_DTYPE_F16: return CUDA_R_16F;
        default: return CUDA_R_32F;
    }
}

}  // namespace

bool fp8_f16_mma_enabled(int kernel) {
    static const int64_t mask = env_int("XINFER_CUDA_FP8_F16_MMA", kF16MmaGemv | kF16MmaGateUp);
    return (mask & kernel) != 0;
}

// y[T, N] = x[T, K] · w[N, K]ᵀ with x and w of dtype ab, y of dtype d. Returns XINFER_UNSUPPORTED
// (without an error message) when cuBLASLt offers no algorithm, so the caller can fall back.
int lt_matmul(Context* c, const void* x, const void* w, void* y, int64_t T, int64_t N, int64_t K, int ab, int d) {
    const cudaDataType ab_type = cuda_type(ab), d_type = cuda_type(d);
    // f32 inputs: plain f32 (the path tests and reference runs take); 16-bit inputs: f32 accumulation.
    const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
    GemmKey key{N, T, K, int(ab_type), int(ab_type), int(d_type), int(compute),
                pointer_alignment(w), pointer_alignment(x), pointer_alignment(y)};

    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a_layout = nullptr, b_layout = nullptr, d_layout = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    int rc = XINFER_OK;
    auto lt_check = [&](cublasStatus_t status, const char* what) {
        if (status != CUBLAS_STATUS_SUCCESS && rc == XINFER_OK) {
            set_error(c, "cuda matmul: %s failed with cuBLAS status %d (T=%lld N=%lld K=%lld)", what, int(status),
                      (long long)T, (long long)N, (long long)K);
            rc = XINFER_ERROR;
        }
        return rc == XINFER_OK;
    };
    if (lt_check(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F), "MatmulDescCreate") &&
        lt_check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof trans_a),
                 "TRANSA") &&
        lt_check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof trans_b),
                 "TRANSB") &&
        lt_check(cublasLtMatrixLayoutCreate(&a_layout, ab_type, uint64_t(K), uint64_t(N), K), "layout A") &&
        lt_check(cublasLtMatrixLayoutCreate(&b_layout, ab_type, uint64_t(K), uint64_t(T), K), "layout B") &&
        lt_check(cublasLtMatrixLayoutCreate(&d_layout, d_type, uint64_t(N), uint64_t(T), N), "layout D")) {
        auto it = c->algo_cache.find(key);
        cublasLtMatmulAlgo_t algo{};
        bool have_algo = false;
        if (it != c->algo_cache.end()) {
            algo = it->second;
            have_algo = true;
        } else if (lt_check(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate")) {
            const uint64_t ws = c->lt_workspace_bytes;
            const uint32_t align_a = uint32_t(key.align_a), align_b = uint32_t(key.align_b),
                           align_d = uint32_t(key.align_d);
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
            // The heuristic otherwise assumes 256-byte-aligned operands, and views into fused
            // buffers (a q slice of a qkv output) can be less aligned.
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                 sizeof align_a);
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                 sizeof align_b);
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                                 sizeof align_d);
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                                 sizeof align_d);
            cublasLtMatmulHeuristicResult_t result{};
            int found = 0;
            if (cublasLtMatmulAlgoGetHeuristic(c->lt, desc, a_layout, b_layout, d_layout, d_layout, pref, 1, &result,
                                               &found) == CUBLAS_STATUS_SUCCESS &&
                found > 0) {
                algo = result.algo;
                have_algo = true;
                c->algo_cache[key] = algo;
            }
        }
        if (!have_algo) {
            rc = XINFER_UNSUPPORTED;
        } else {
            const float alpha = 1.f, beta = 0.f;
            lt_check(cublasLtMatmul(c->lt, desc, &alpha, w, a_layout, x, b_layout, &beta, y, d_layout, y, d_layout,
                                    &algo, c->lt_workspace, c->lt_workspace_bytes, c->stream),
                     "cublasLtMatmul");
        }
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d_layout) cublasLtMatrixLayoutDestroy(d_layout);
    if (b_layout) cublasLtMatrixLayoutDestroy(b_layout);
    if (a_layout) cublasLtMatrixLayoutDestroy(a_layout);
    if (desc) cublasLtMatmulDescDestroy(desc);
    return rc;
}

namespace {

// The scale grid of an f8 weight [N, K] with scale [scale_rows, scale_cols]: contiguous when
// scale_rows == ceil(N / block_rows), else the smallest equal row-shard count that explains
// scale_rows (tensor-parallel exports restart the grid per shard; see src/loader/fp8_block.h).
bool fit_scale_grid(int64_t N, int64_t K, int64_t br, int64_t bc, int64_t scale_rows, int64_t scale_cols,
                    int64_t* shard_rows, int64_t* blocks_per_shard) {
    if (br <= 0 || bc <= 0 || scale_cols != ceil_div(K, bc)) return false;
    for (int64_t shards = 1; shards <= N; ++shards) {
        if (N % shards) continue;
        const int64_t rows = N / shards, blocks = ceil_div(rows, br);
        if (shards * blocks == scale_rows) {
            *shard_rows = rows;
            *blocks_per_shard = blocks;
            return true;
        }
        if (shards * blocks > scale_rows) break;
    }
    return false;
}

// The f8 block-scale fields of a streaming GEMV: scales [rows, cols] f32 in blocks of br × bc, in
// the shards fit_scale_grid found.
void set_stream_scales(StreamGemv& p, const xinfer_tensor& w_scale, int64_t br, int64_t bc, int64_t shard_rows,
                       int64_t blocks_per_shard) {
    p.scale = static_cast<const float*>(w_scale.data);
    p.scale_cols = w_scale.shape[1];
    p.block_rows = br;
    p.block_cols = bc;
    p.shard_rows = shard_rows;
    p.blocks_per_shard = blocks_per_shard;
    p.one_scale = bc % 16 == 0;
}

__global__ void widen_fp8_kernel(const uint8_t* w /*[N, K]*/, const float* scale, int64_t N, int64_t K,
                                 int64_t scale_cols, int64_t block_rows, int64_t block_cols, int64_t shard_rows,
                                 int64_t blocks_per_shard, __nv_bfloat16* out /*[N, K]*/) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N * K; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t r = i / K, col = i % K;
        const int64_t scale_row = (r / shard_rows) * blocks_per_shard + (r % shard_rows) / block_rows;
        out[i] = __float2bfloat16_rn(fp8_to_float(w[i]) * scale[scale_row * scale_cols + col / block_cols]);
    }
}

// Prefill-sized FP8 dense matmuls (from this many rows) widen the weight to bf16 and run on
// cuBLASLt; below, the widening (a read and a 2-byte write of every weight) costs more than the
// tiled kernel loses. XINFER_CUDA_FP8_WIDEN=0 keeps the tiled kernel.
constexpr int64_t kFp8WidenMinRows = 512;
bool fp8_widen_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_FP8_WIDEN", true);
    return enabled;
}

}  // namespace

int launch_widen_fp8(Context* c, const void* w, const float* scale, int64_t N, int64_t K, int64_t scale_cols,
                     int64_t block_rows, int64_t block_cols, int64_t shard_rows, int64_t blocks_per_shard,
                     __nv_bfloat16* out) {
    if (N * K == 0) return XINFER_OK;
    if (shard_rows <= 0) shard_rows = N;
    if (blocks_per_shard <= 0) blocks_per_shard = ceil_div(shard_rows, block_rows);
    const int grid = int(std::min<int64_t>(ceil_div(N * K, 256), int64_t(std::max(c->sm_count, 1)) * 16));
    widen_fp8_kernel<<<grid, 256, 0, c->stream>>>(static_cast<const uint8_t*>(w), scale, N, K, scale_cols, block_rows,
                                                  block_cols, shard_rows, blocks_per_shard, out);
    XCUDA_CHECK_LAUNCH(c, "widen_fp8_kernel");
    return XINFER_OK;
}

int op_matmul(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &x = op->src[0], &w = op->src[1], &w_scale = op->src[2], &y = op->dst[0];
    const auto shapes = [&] {
        return str_format("x %s, w %s, w_scale %s, y %s", shape_str(x).c_str(), shape_str(w).c_str(),
                          shape_str(w_scale).c_str(), shape_str(y).c_str());
    };
    if (w.rank != 2 || x.rank < 1 || y.rank < 1)
        return unsupported(c, op, "%s: expected x [T, K], w [N, K], y [T, N]", shapes().c_str());
    const int64_t T = rows_of(x), K = cols_of(x), N = w.shape[0];
    if (w.shape[1] != K || rows_of(y) != T || cols_of(y) != N)
        return unsupported(c, op, "%s: expected x [T, K], w [N, K], y [T, N]", shapes().c_str());

    const bool fp8 = w.dtype == XINFER_DTYPE_F8_E4M3;
    int compute_dtype = w.dtype;  // dtype x is converted to
    bool dtypes_ok = false;
    switch (w.dtype) {
        case XINFER_DTYPE_F32: dtypes_ok = is_float(x.dtype) && y.dtype == XINFER_DTYPE_F32; break;
        case XINFER_DTYPE_BF16: dtypes_ok = is_float(x.dtype) && is_act(y.dtype); break;
        case XINFER_DTYPE_F16:
            dtypes_ok = is_float(x.dtype) && (y.dtype == XINFER_DTYPE_F16 || y.dtype == XINFER_DTYPE_F32);
            break;
        case XINFER_DTYPE_F8_E4M3:
            dtypes_ok = is_float(x.dtype) && is_act(y.dtype);
            compute_dtype = XINFER_DTYPE_BF16;
            break;
        default: break;
    }
    if (!dtypes_ok)
        return unsupported(c, op, "%s: supported (w, y) pairs are (f32, f32), (bf16, bf16|f32), (f16, f16|f32), "
                           "(f8_e4m3 + f32 block scales, bf16|f32); x any of f32/bf16/f16",
                           shapes().c_str());
    const int64_t br = op->params.matmul.block_rows > 0 ? op->params.matmul.block_rows : 128;
    const int64_t bc = op->params.matmul.block_cols > 0 ? op->params.matmul.block_cols : 128;
    int64_t shard_rows = 0, blocks_per_shard = 0;
    if (fp8) {
        if (w_scale.rank != 2 || w_scale.dtype != XINFER_DTYPE_F32 ||
            !fit_scale_grid(N, K, br, bc, w_scale.shape[0], w_scale.shape[1], &shard_rows, &blocks_per_shard))
            return unsupported(c, op, "%s: f8 weights need f32 scales [ceil(N/%lld), ceil(K/%lld)]", shapes().c_str(),
                               (long long)br, (long long)bc);
    } else if (!absent(w_scale)) {
        return unsupported(c, op, "%s: block scales are only for f8_e4m3 weights", shapes().c_str());
    }
    if (!run || T == 0 || N == 0) return XINFER_OK;

    // Few-token matmuls stream the weights (see stream_gemv_kernel); x as it is where the kernel
    // reads it (bf16, or f32 for f32 weights), else converted like the other paths.
    if (dense_gemv_enabled() && K > 0) {
        const int stream_x = w.dtype == XINFER_DTYPE_F32 && x.dtype == XINFER_DTYPE_BF16 ? XINFER_DTYPE_BF16 : compute_dtype;
        const bool convert = x.dtype != stream_x;
        const bool x_aligned = convert || pointer_alignment(x.data) >= 16;  // converted x lands in aligned scratch
        const bool bf16_mma = w.dtype == XINFER_DTYPE_BF16 && bf16_mma_gemv_fits(T, N, K, x_aligned, w.data) &&
                              (T > 1 || stream_gemv_split(c, N, K, w.dtype) > 1);
        if (bf16_mma || (stream_gemv_wins(T, N, K, w.dtype) && stream_gemv_fits(T, K, w.dtype, stream_x, x_aligned, w.data))) {
            const void* xs = x.data;
            if (convert) {
                ScratchPlan plan;
                const size_t off = plan.add(size_t(T * K) * dtype_size(stream_x));
                if (int rc = ensure_scratch(c, plan.total)) return rc;
                void* converted = c->scratch + off;
                if (int rc = launch_convert(c, x.data, x.dtype, converted, stream_x, T * K)) return rc;
                xs = converted;
            }
            StreamGemv p;
            p.x = xs;
            p.w = w.data;
            p.y = y.data;
            p.y_dtype = y.dtype;
            p.rows = int(T);
            p.n = N;
            p.k = K;
            if (bf16_mma) return launch_mma_gemv(c, p, false);
            if (fp8) {
                set_stream_scales(p, w_scale, br, bc, shard_rows, blocks_per_shard);
                if (fp8_mma_gemv_fits(c, p, x_aligned)) return launch_mma_gemv(c, p, true);
            }
            return launch_stream_gemv(c, p, w.dtype, stream_x);
        }
    }

    // Prefill-sized FP8: the weight widened to bf16 in scratch, then cuBLASLt (falls through to
    // the tiled kernel if cuBLASLt declines).
    if (fp8 && T >= kFp8WidenMinRows && K > 0 && fp8_widen_enabled()) {
        ScratchPlan plan;
        const bool convert = x.dtype != XINFER_DTYPE_BF16;
        const size_t off_x = convert ? plan.add(size_t(T * K) * 2) : 0, off_w = plan.add(size_t(N * K) * 2);
        if (int rc = ensure_scratch(c, plan.total)) return rc;
        const void* xb = x.data;
        if (convert) {
            if (int rc = launch_convert(c, x.data, x.dtype, c->scratch + off_x, XINFER_DTYPE_BF16, T * K)) return rc;
            xb = c->scratch + off_x;
        }
        auto* wide = reinterpret_cast<__nv_bfloat16*>(c->scratch + off_w);
        if (int rc = launch_widen_fp8(c, w.data, static_cast<const float*>(w_scale.data), N, K, w_scale.shape[1], br,
                                      bc, shard_rows, blocks_per_shard, wide))
            return rc;
        const int rc = lt_matmul(c, xb, wide, y.data, T, N, K, XINFER_DTYPE_BF16, y.dtype);
        if (rc != XINFER_UNSUPPORTED) return rc;
    }

    // x in the compute dtype, converted into scratch when it differs.
    const void* xa = x.data;
    if (x.dtype != compute_dtype) {
        ScratchPlan plan;
        const size_t off = plan.add(size_t(T * K) * dtype_size(compute_dtype));
        if (int rc = ensure_scratch(c, plan.total)) return rc;
        void* converted = c->scratch + off;
        if (int rc = launch_convert(c, x.data, x.dtype, converted, compute_dtype, T * K)) return rc;
        xa = converted;
    }
    if (K == 0) {
        XCUDA_TRY(c, cudaMemsetAsync(y.data, 0, size_t(T * N) * dtype_size(y.dtype), c->stream));
        return XINFER_OK;
    }
    if (!fp8) {
        const int rc = lt_matmul(c, xa, w.data, y.data, T, N, K, compute_dtype, y.dtype);
        if (rc != XINFER_UNSUPPORTED) return rc;
        if (w.dtype != XINFER_DTYPE_BF16)
            return unsupported(c, op, "%s: cuBLASLt has no algorithm for this shape/alignment", shapes().c_str());
        // bf16 shapes cuBLASLt rejects (odd K, unaligned views) take the custom kernel.
    }
    GroupedGemm g;
    g.a = static_cast<const __nv_bfloat16*>(xa);
    g.lda = K;
    g.b = w.data;
    g.b_dtype = w.dtype;
    g.n = N;
    g.k = K;
    if (fp8) {
        g.b_scale = static_cast<const float*>(w_scale.data);
        g.scale_cols = w_scale.shape[1];
        g.block_rows = br;
        g.block_cols = bc;
        g.shard_rows = shard_rows;
        g.blocks_per_shard = blocks_per_shard;
    }
    g.c = y.data;
    g.c_dtype = y.dtype;
    g.ldc = N;
    g.m = T;
    // Decode batches stream the weights: the GEMV path reads each weight row once, where 64-row
    // tiles leave most SMs idle (measured on H200, 12288x4096: T=1 0.060 ms GEMV vs 0.146 ms tiled;
    // at T=32, four 8-row GEMV passes took 0.44 ms against 0.147 ms tiled).
    if (T <= kGemvMaxRows) {
        Gemv v;
        v.w = g;
        v.rows = T;
        v.rows_per_group = int(std::min<int64_t>(T, kGemvMaxRows));
        if (gemv_fits(v)) return launch_gemv(c, v);
    }
    return launch_grouped_gemm(c, g, 0);
}

// ADD_RMSNORM_MATMUL where the norm can run inside the streaming GEMV (one launch instead of two):
//   - a MoE router: f32 weights (no scales), bf16 residual, x and normed, f32 logits, ≤ 8 rows
//     within kNormRouterMaxSmem, K % 8 == 0: every block normalises (norm_rows_to_shared);
//   - one row of bf16 weights (a decode step's q|k|v), bf16 or f32 y, K % 8 == 0 within
//     kNormGemvMaxSmem: the one-wave norm_stream_gemv_kernel.
// Both need the default GEMV pipeline. Anything else answers unsupported and xinfer runs
// ADD_RMSNORM (or RMSNORM) and MATMUL. XINFER_CUDA_NORM_ROUTER=0 / XINFER_CUDA_NORM_GEMV=0: never
// the first / second (A/B). H200: docs/perf/2026-12-01-h200-session17.md (routers),
// docs/perf/2026-12-03-h200-session30.md (one row).
int op_add_rmsnorm_matmul(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &residual = op->src[0], &x = op->src[1], &norm_w = op->src[2], &w = op->src[3],
                        &w_scale = op->src[4], &y = op->dst[0], &normed = op->dst[1];
    static const bool router_enabled = env_flag("XINFER_CUDA_NORM_ROUTER", true);
    static const bool row_enabled = env_flag("XINFER_CUDA_NORM_GEMV", true);
    constexpr int bf16 = XINFER_DTYPE_BF16, f32 = XINFER_DTYPE_F32;
    const int64_t R = rows_of(residual), K = cols_of(residual);
    const bool with_x = !absent(x);
    const auto same_shape = [&](const xinfer_tensor& t) { return rows_of(t) == R && cols_of(t) == K; };
    const bool fp8 = w.dtype == XINFER_DTYPE_F8_E4M3;
    const bool shapes_ok = w.rank == 2 && w.shape[1] == K && (fp8 || absent(w_scale)) && same_shape(normed) &&
                           (!with_x || same_shape(x)) && norm_w.rank == 1 && norm_w.shape[0] == K &&
                           w.shape[0] >= 1 && rows_of(y) == R && cols_of(y) == w.shape[0];
    const bool acts_ok = residual.dtype == bf16 && normed.dtype == bf16 && (!with_x || x.dtype == bf16) &&
                         (norm_w.dtype == f32 || norm_w.dtype == bf16);
    const bool aligned = pointer_alignment(residual.data) >= 16 && pointer_alignment(normed.data) >= 16 &&
                         (!with_x || pointer_alignment(x.data) >= 16) && pointer_alignment(w.data) >= 16;
    const bool common = shapes_ok && acts_ok && aligned && K % 8 == 0 && gemv_pipeline_depth() == 2;
    const bool router = router_enabled && common && w.dtype == f32 && y.dtype == f32 && R <= kGemvMaxRows &&
                        size_t(R) * size_t(K) * 4 <= kNormRouterMaxSmem;
    const bool row = row_enabled && common && w.dtype == bf16 && (y.dtype == bf16 || y.dtype == f32) && R == 1 &&
                     size_t(K) * 4 <= kNormGemvMaxSmem && w.shape[0] < (int64_t(1) << 31);
    StreamGemv p;
    p.w = w.data;
    p.y = y.data;
    p.y_dtype = y.dtype;
    p.rows = int(R);
    p.n = w.shape[0];
    p.k = K;
    bool fp8_row = false;
    if (fp8 && row_enabled && common && is_act(y.dtype) && R == 1 && w_scale.rank == 2 &&
        w_scale.dtype == f32 && dense_gemv_enabled()) {
        const int64_t br = op->params.norm_matmul.block_rows > 0 ? op->params.norm_matmul.block_rows : 128;
        const int64_t bc = op->params.norm_matmul.block_cols > 0 ? op->params.norm_matmul.block_cols : 128;
        int64_t shard_rows = 0, blocks_per_shard = 0;
        if (fit_scale_grid(p.n, K, br, bc, w_scale.shape[0], w_scale.shape[1], &shard_rows, &blocks_per_shard)) {
            set_stream_scales(p, w_scale, br, bc, shard_rows, blocks_per_shard);
            fp8_row = fp8_norm_gemv_fits(c, p);
        }
    }
    if (!router && !row && !fp8_row)
        return unsupported(c, op, "the norm is fused only for a router (f32 w, bf16 activations, f32 y, ≤ %d rows, "
                           "rows·K ≤ %zu), one row of bf16 w (K ≤ %zu) or one row of f8_e4m3 w on the one-wave "
                           "tensor-core GEMV; K %% 8 == 0, the default GEMV pipeline (XINFER_CUDA_NORM_ROUTER / "
                           "XINFER_CUDA_NORM_GEMV on); xinfer runs the norm and the matmul",
                           kGemvMaxRows, kNormRouterMaxSmem / 4, kNormGemvMaxSmem / 4);
    if (!run || R == 0) return XINFER_OK;
    NormArgs n;
    n.residual = residual.data;
    n.delta = with_x ? x.data : nullptr;
    n.weight = norm_w.data;
    n.weight_dtype = norm_w.dtype;
    n.eps = op->params.norm_matmul.eps;
    n.normed = normed.data;
    n.arrivals = c->arrivals;
    if (fp8_row) return launch_mma_gemv(c, p, true, &n);
    return router ? launch_norm_stream_gemv(c, p, n) : launch_norm_row_gemv(c, p, n);
}

}  // namespace xcuda
