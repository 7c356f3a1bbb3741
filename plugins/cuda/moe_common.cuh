// Device pieces shared by the expert kernels of moe.cu, moe_staged.cu and moe_prefill.cu: the
// in-block grouping of (token, slot) pairs by expert, the tiled path's sort of pairs by expert and
// the slot-order combine (the tensor-core weight stream pieces are in weight_stream.cuh).
#pragma once

#include "common.h"
#include "device_utils.cuh"
#include "gemm.h"
#include "weight_stream.cuh"

#include <cstdint>

namespace xcuda {
namespace {

// Builds the grouping in shared memory and returns the number of distinct valid experts nd:
// slot_expert[0, nd) in ascending id order, cnt[e] pairs of expert e at list[end[e] - cnt[e], end[e]).
__device__ int moe_block_plan(const int32_t* ids, int P, int E, int* cnt /*[E]*/, int* end /*[E]*/,
                              int* list /*[P]*/, int* slot_expert /*[min(P, E)]*/) {
    __shared__ int scan[64];
    const int tid = threadIdx.x, nthreads = blockDim.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < E; e += nthreads) cnt[e] = 0;
    __syncthreads();
    for (int p = tid; p < P; p += nthreads) {
        const int e = ids[p];
        if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    // Block-wide exclusive scan of (experts touched, pairs) over contiguous ranges of experts.
    const int per = (E + nthreads - 1) / nthreads, e0 = min(E, tid * per), e1 = min(E, e0 + per);
    int has = 0, pairs = 0;
    for (int e = e0; e < e1; ++e) {
        has += cnt[e] > 0;
        pairs += cnt[e];
    }
    int inc_has = has, inc_pairs = pairs;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int a = __shfl_up_sync(0xffffffffu, inc_has, d), b = __shfl_up_sync(0xffffffffu, inc_pairs, d);
        if (lane >= d) {
            inc_has += a;
            inc_pairs += b;
        }
    }
    if (lane == 31) {
        scan[warp] = inc_has;
        scan[32 + warp] = inc_pairs;
    }
    __syncthreads();
    int slot = inc_has - has, at = inc_pairs - pairs, nd = 0;
    for (int w = 0; w < (nthreads + 31) / 32; ++w) {
        if (w < warp) {
            slot += scan[w];
            at += scan[32 + w];
        }
        nd += scan[w];
    }
    for (int e = e0; e < e1; ++e) {
        end[e] = at;  // the start; the scatter below advances it to the end
        at += cnt[e];
        if (cnt[e] > 0) slot_expert[slot++] = e;
    }
    __syncthreads();
    for (int p = tid; p < P; p += nthreads) {
        const int e = ids[p];
        if (e >= 0 && e < E) list[atomicAdd(&end[e], 1)] = p;
    }
    __syncthreads();
    return nd;
}

// moe_block_plan for one routed token, whose experts are distinct (route_token's ranks): pair j is
// slot j, of expert chosen[j]; the valid ids come first. One barrier instead of the plan's four.
__device__ int routed_token_plan(const int* chosen /*[top_k]*/, int top_k, int* cnt, int* end, int* list,
                                 int* slot_expert) {
    int nd = 0;
    while (nd < top_k && chosen[nd] >= 0) ++nd;
    for (int j = threadIdx.x; j < nd; j += blockDim.x) {
        const int e = chosen[j];
        cnt[e] = 1;
        end[e] = j + 1;
        list[j] = j;
        slot_expert[j] = e;
    }
    __syncthreads();
    return nd;
}

// The tiled path's sort of (token, slot) pairs by expert (moe.cu's tiled GEMMs and moe_prefill.cu):
// counts per expert, then one block's offsets and ≤ kGemmTileM-row tiles, then the scatter.
__global__ void count_kernel(const int32_t* ids /*[P]*/, int64_t P, int E, int32_t* counts /*[E]*/) {
    for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < P; p += int64_t(gridDim.x) * blockDim.x) {
        const int32_t e = ids[p];
        if (e >= 0 && e < E) atomicAdd(&counts[e], 1);
    }
}

// One block: offsets, per-expert tile lists, scatter cursors.
__global__ void plan_kernel(const int32_t* counts /*[E]*/, int E, int32_t* cursor /*[E]*/,
                            int32_t* tile_offset /*[E]*/, int4* tiles /*[max_tiles]*/, int32_t* n_tiles) {
    if (threadIdx.x == 0) {
        int32_t rows = 0, n = 0;
        for (int e = 0; e < E; ++e) {
            cursor[e] = rows;
            tile_offset[e] = n;
            rows += counts[e];
            n += (counts[e] + kGemmTileM - 1) / kGemmTileM;
        }
        *n_tiles = n;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int32_t begin = cursor[e], end = begin + counts[e];
        int32_t slot = tile_offset[e];
        for (int32_t r = begin; r < end; r += kGemmTileM) tiles[slot++] = make_int4(e, r, min(end, r + kGemmTileM), 0);
    }
}

__global__ void scatter_kernel(const int32_t* ids /*[P]*/, int64_t P, int E, int32_t* cursor /*[E]*/,
                               int32_t* sorted /*[P]*/) {
    for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < P; p += int64_t(gridDim.x) * blockDim.x) {
        const int32_t e = ids[p];
        if (e >= 0 && e < E) sorted[atomicAdd(&cursor[e], 1)] = int32_t(p);
    }
}

// Shared memory of the plan, in ints.
__host__ __device__ inline int64_t moe_plan_ints(int64_t P, int64_t E) { return 2 * E + P + (P < E ? P : E); }

// out[t, h] = Σ_slot weights[t, slot] · dn[row(t·k + slot), h], row = dn_row[pair] (null: the
// pair itself), summed in slot order (deterministic); a pair with an invalid expert id poisons its
// token's row with NaN (the CPU oracle reports an error).
// Grid (ceil(H / (4·threads)), T): a thread owns 4 consecutive h of one token, so the loads of all
// slots are in flight together. (One block per token walking H in a loop took 32.6 µs at T = 64,
// H = 4096, top-8 on H200, 4.6% of a concurrency-64 serving step: ncu, session 9.)
constexpr int kCombineThreads = 128;
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(
    const float* dn /*[rows, H]*/, const int32_t* dn_row /*[T·k] or null*/, const int32_t* ids /*[T, k]*/,
    const float* weights /*[T, k]*/, int top_k, int E, int64_t H, bool vec /*dn rows 16-byte aligned*/,
    void* out /*[T, H]*/, int out_dtype) {
    pdl_begin();
    const int64_t t = blockIdx.y, h0 = (int64_t(blockIdx.x) * kCombineThreads + threadIdx.x) * 4;
    if (h0 >= H) return;
    const int n = int(min(int64_t(4), H - h0));
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int s = 0; s < top_k; ++s) {
        const int64_t pair = t * top_k + s;
        const int32_t e = ids[pair];
        float v[4] = {__int_as_float(0x7fc00000), __int_as_float(0x7fc00000), __int_as_float(0x7fc00000),
                      __int_as_float(0x7fc00000)};
        float w = 1.f;
        if (e >= 0 && e < E) {
            w = weights[pair];
            const float* row = dn + (dn_row ? dn_row[pair] : pair) * H + h0;
            if (vec && n == 4) {
                const float4 q = *reinterpret_cast<const float4*>(row);
                v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
            } else {
                for (int i = 0; i < n; ++i) v[i] = row[i];
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += w * v[i];
    }
    for (int i = 0; i < n; ++i) store_f(out, out_dtype, t * H + h0 + i, acc[i]);
}

inline int launch_combine(Context* c, const float* dn, const int32_t* dn_row, const int32_t* ids,
                          const float* weights, int top_k, int E, int64_t T, int64_t H, void* out, int out_dtype) {
    const bool vec = H % 4 == 0 && pointer_alignment(dn) >= 16;
    const dim3 grid(unsigned(ceil_div(H, 4 * kCombineThreads)), unsigned(T));
    return launch_pdl(c, "combine_kernel", combine_kernel, grid, dim3(kCombineThreads), 0, dn, dn_row, ids, weights,
                      top_k, E, H, vec, out, out_dtype);
}

}  // namespace
}  // namespace xcuda
