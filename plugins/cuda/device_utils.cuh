// Device-side helpers shared by the kernels: dtype-generic loads/stores (the dtype is a
// run-time value that is uniform across a launch, so the switch costs a predictable branch and
// keeps one kernel instance per op instead of one per dtype combination), and warp/block
// reductions.
#pragma once

#include "xinfer/backend_abi.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace xcuda {

__host__ __device__ inline int dtype_bytes(int dtype) {
    return dtype == XINFER_DTYPE_F32 || dtype == XINFER_DTYPE_I32 ? 4 : dtype == XINFER_DTYPE_I64 ? 8 : dtype == XINFER_DTYPE_BF16 || dtype == XINFER_DTYPE_F16 ? 2 : 1;
}

// One FP8 e4m3 byte to f32 (exact).
__device__ __forceinline__ float fp8_to_float(uint8_t b) {
    __nv_fp8_e4m3 v;
    v.__x = b;
    return float(v);
}

// The f32 row scale at byte `at` of an FP8 KV cache (each page: its page_size·nkv·d e4m3 values,
// then one scale per row); byte loads, since odd head dims or page strides may leave it unaligned.
__device__ __forceinline__ float load_fp8_row_scale(const void* cache, int64_t at) {
    const uint8_t* p = static_cast<const uint8_t*>(cache) + at;
    return __int_as_float(int(uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24));
}

// f32 → e4m3, round to nearest even, saturating to ±448, NaN stays NaN (the CPU's
// f32_to_e4m3_rne in src/backend/cpu/kv_fp8.h).
__device__ __forceinline__ uint8_t float_to_fp8(float x) {
    return uint8_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// Programmatic dependent launch (launch_pdl in common.h). pdl_wait: block until the previous
// grid on the stream has completed and its writes are visible. pdl_launch_dependents: let the
// next PDL-launched grid be scheduled (it fires once every block of this grid has called it).
// Both are no-ops for a plainly launched kernel.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// The first statement of a launch_pdl kernel: nothing of this kernel touches memory before the
// previous grid is done, and the next kernel's launch overlaps this one's work.
__device__ __forceinline__ void pdl_begin() {
    pdl_wait();
    pdl_launch_dependents();
}

// A counter other blocks of the grid raise (after a block barrier and __threadfence, as
// cooperative groups' grid sync does): the acquire load orders the caller's later reads after
// the writes those blocks published.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ float load_f(const void* p, int dtype, int64_t i) {
    switch (dtype) {
        case XINFER_DTYPE_BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
        case XINFER_DTYPE_F16: return __half2float(static_cast<const __half*>(p)[i]);
        default: return static_cast<const float*>(p)[i];
    }
}

__device__ __forceinline__ void store_f(void* p, int dtype, int64_t i, float v) {
    switch (dtype) {
        case XINFER_DTYPE_BF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
        case XINFER_DTYPE_F16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
        default: static_cast<float*>(p)[i] = v; break;
    }
}

// The value `v` takes once stored in `dtype` (rounding, as the stored tensor will hold it).
__device__ __forceinline__ float round_to(int dtype, float v) {
    switch (dtype) {
        case XINFER_DTYPE_BF16: return __bfloat162float(__float2bfloat16_rn(v));
        case XINFER_DTYPE_F16: return __half2float(__float2half_rn(v));
        default: return v;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `shared` holds ≥ 32 entries. Contains
// __syncthreads, so all threads of the block must call it.
template <typename T>
__device__ T block_sum(T v, T* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // `shared` may still be read from a previous call
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    T total = 0;
    for (int w = 0; w < n_warps; ++w) total += shared[w];
    return total;
}

// Copies n 16-byte vectors from global memory (through L2 only: the source may be the output of
// the previous PDL grid) to shared memory, block-wide, with kBatch loads in flight per thread before
// the first store: a plain `for (i = tid; i < n; i += blockDim.x) dst[i] = src[i]` compiles to one
// load-store round trip to L2 per iteration. The caller synchronizes before reading dst.
template <int kBatch = 8>
__device__ __forceinline__ void copy_to_shared(uint4* dst, const uint4* src, int64_t n) {
    for (int64_t first = threadIdx.x; first < n; first += int64_t(kBatch) * blockDim.x) {
        uint4 v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int64_t i = first + int64_t(u) * blockDim.x;
            if (i < n) v[u] = __ldcg(src + i);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int64_t i = first + int64_t(u) * blockDim.x;
            if (i < n) dst[i] = v[u];
        }
    }
}

// (value, index) maximum with ties to the lower index; NaN never wins.
struct ArgBest {
    float value;
    int32_t index;
};
__device__ __forceinline__ ArgBest arg_better(ArgBest a, ArgBest b) {
    if (b.index < 0 || isnan(b.value)) return a;
    if (a.index < 0 || isnan(a.value)) return b;
    if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
    return a;
}
__device__ __forceinline__ ArgBest warp_arg_best(ArgBest v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ArgBest other{__shfl_xor_sync(0xffffffffu, v.value, o), __shfl_xor_sync(0xffffffffu, v.index, o)};
        v = arg_better(v, other);
    }
    return v;
}
// Block-wide; every thread gets the result. `shared` holds ≥ 32 entries.
__device__ __forceinline__ ArgBest block_arg_best(ArgBest v, ArgBest* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    v = warp_arg_best(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    ArgBest best{0.f, -1};
    for (int w = 0; w < n_warps; ++w) best = arg_better(best, shared[w]);
    return best;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace xcuda
