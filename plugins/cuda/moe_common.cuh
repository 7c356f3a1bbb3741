// Device pieces shared by the expert kernels of moe.cu and moe_staged.cu: the in-block grouping
// of (token, slot) pairs by expert, the bf16 tensor-core mma, and the slot-order combine.
#pragma once

#include "device_utils.cuh"

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

// Shared memory of the plan, in ints.
__host__ __device__ inline int64_t moe_plan_ints(int64_t P, int64_t E) { return 2 * E + P + (P < E ? P : E); }

// d[16×8] += a[16×16] · b[16×8], bf16 in, f32 accumulate. a0/a2: row g, a1/a3: row g+8;
// a0/a1 and b0 hold k = 2c, 2c+1; a2/a3 and b1 hold k = 2c+8, 2c+9.
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// out[t, h] = Σ_slot weights[t, slot] · dn[row(t·k + slot), h], row = dn_row[pair] (null: the
// pair itself); a pair with an invalid expert id poisons its token's row with NaN (the CPU oracle
// reports an error).
__global__ void combine_kernel(const float* dn /*[T·k, H]*/, const int32_t* dn_row /*[T·k] or null*/,
                               const int32_t* ids /*[T, k]*/, const float* weights /*[T, k]*/, int top_k, int E,
                               int64_t H, void* out /*[T, H]*/, int out_dtype) {
    const int64_t t = blockIdx.x;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < top_k; ++s) {
            const int64_t pair = t * top_k + s;
            const int32_t e = ids[pair];
            acc += (e >= 0 && e < E) ? weights[pair] * dn[(dn_row ? dn_row[pair] : pair) * H + h]
                                     : __int_as_float(0x7fc00000);
        }
        store_f(out, out_dtype, t * H + h, acc);
    }
}

}  // namespace
}  // namespace xcuda
