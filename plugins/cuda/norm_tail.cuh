// The residual add and RMSNorm that follow a grid's output, run by that grid's last block to
// arrive (MOE_EXPERTS_ADD_RMSNORM: the expert down kernels of moe.cu) instead of by a kernel of
// their own: at batch 1 the norm is one block's work, and its own launch put a grid boundary (the
// wait for the whole previous grid, then this one's) on every layer's dependency chain. NormArgs
// also carries gemm.cu's norm fused in front of a router's GEMV.
#pragma once

#include "common.h"
#include "device_utils.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace xcuda {
namespace {

struct NormArgs {
    void* residual = nullptr;     // [rows, k] bf16, += delta in place (by the last block to arrive)
    const void* delta = nullptr;  // [rows, k] bf16, or null (a plain RMSNORM)
    const void* weight = nullptr; // [k] f32 or bf16
    int weight_dtype = XINFER_DTYPE_F32;
    float eps = 0.f;
    void* normed = nullptr;       // [rows, k] bf16, written by the last block to arrive
    int* arrivals = nullptr;      // Context::arrivals: zero between launches
};

// Every block calls this (all its threads) once its stores of p.delta are issued; the last block
// to arrive then computes, per row r < rows,
//   residual[r] = bf16(residual[r] + delta[r]),  normed[r] = bf16(residual[r] · rsqrt(mean(residual[r]²) + eps) · w)
// - rmsnorm_kernel's arithmetic (its sum of squares in another order) - and re-arms the counter.
// Needs k % 8 == 0 and 16-byte aligned rows. A thread keeps its first kTailVecs vectors of a row in
// registers between the two passes (all of a 4,096-wide row with 256 threads) and rereads the
// rest, which only it wrote.
constexpr int kTailVecs = 2;
__device__ void add_rmsnorm_if_last(const NormArgs& p, int rows, int64_t k) {
    __shared__ bool last;
    __shared__ float red[32];
    // One thread per block arrives, with release and acquire semantics at device scope: after the
    // barrier, its release covers the block's delta stores (fences are cumulative), and the last
    // block's acquire covers every block's. (A __threadfence in every thread held each block ~1 µs
    // longer: 4,096 one-row blocks of the bf16 down kernel took 125 µs instead of 100.)
    __syncthreads();
    if (threadIdx.x == 0) {
        int before;
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(before) : "l"(p.arrivals) : "memory");
        last = before == int(gridDim.x * gridDim.y * gridDim.z) - 1;
    }
    __syncthreads();
    if (!last) return;
    const int64_t n = k / 8;  // 16-byte vectors of 8 bf16 per row
    for (int r = 0; r < rows; ++r) {
        uint4* res = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.residual) + r * k);
        const uint4* del = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.delta) + r * k);
        uint4* out = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.normed) + r * k);
        float sum_squares = 0.f;
        // v = bf16(residual + delta), stored, its squares summed.
        const auto add = [&](const uint4& a, const uint4& b) {
            const __nv_bfloat162* ah = reinterpret_cast<const __nv_bfloat162*>(&a);
            const __nv_bfloat162* bh = reinterpret_cast<const __nv_bfloat162*>(&b);
            uint4 v;
            __nv_bfloat162* vh = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 fa = __bfloat1622float2(ah[e]), fb = __bfloat1622float2(bh[e]);
                vh[e] = __floats2bfloat162_rn(fa.x + fb.x, fa.y + fb.y);
                const float2 fv = __bfloat1622float2(vh[e]);
                sum_squares += fv.x * fv.x;
                sum_squares += fv.y * fv.y;
            }
            return v;
        };
        const auto load_weights = [&](int64_t i, float (&w)[8]) {
#pragma unroll
            for (int e = 0; e < 8; ++e) w[e] = load_f(p.weight, p.weight_dtype, i * 8 + e);
        };
        // The first vectors' loads, and their norm weights', all go out before any is used (one
        // round trip to L2).
        uint4 a[kTailVecs], b[kTailVecs];
        float w_first[kTailVecs][8];
#pragma unroll
        for (int j = 0; j < kTailVecs; ++j) {
            const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
            a[j] = b[j] = make_uint4(0, 0, 0, 0);
            if (i < n) {
                a[j] = __ldcg(res + i);
                b[j] = __ldcg(del + i);
                load_weights(i, w_first[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < kTailVecs; ++j)
            if (const int64_t i = threadIdx.x + int64_t(j) * blockDim.x; i < n) res[i] = a[j] = add(a[j], b[j]);
        for (int64_t i = threadIdx.x + int64_t(kTailVecs) * blockDim.x; i < n; i += blockDim.x)
            res[i] = add(__ldcg(res + i), __ldcg(del + i));
        const float inv_rms = rsqrtf(block_sum(sum_squares, red) / float(k) + p.eps);
        const auto normalize = [&](int64_t i, const uint4& x, const float (&w)[8]) {
            const __nv_bfloat162* xh = reinterpret_cast<const __nv_bfloat162*>(&x);
            uint4 o;
            __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 f = __bfloat1622float2(xh[e]);
                oh[e] = __floats2bfloat162_rn(f.x * inv_rms * w[2 * e], f.y * inv_rms * w[2 * e + 1]);
            }
            out[i] = o;
        };
#pragma unroll
        for (int j = 0; j < kTailVecs; ++j)
            if (const int64_t i = threadIdx.x + int64_t(j) * blockDim.x; i < n) normalize(i, a[j], w_first[j]);
        for (int64_t i = threadIdx.x + int64_t(kTailVecs) * blockDim.x; i < n; i += blockDim.x) {
            float w[8];
            load_weights(i, w);
            normalize(i, res[i], w);
        }
    }
    if (threadIdx.x == 0) *p.arrivals = 0;
}

}  // namespace
}  // namespace xcuda
