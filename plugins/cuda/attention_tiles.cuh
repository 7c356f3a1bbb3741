// What the tensor-core attention kernels of attention_decode.cu (split-KV) and
// attention_prefill.cu (long query tiles) share: the op as they read it, and the bf16 tile
// plumbing (16-byte cp.async into shared memory, ldmatrix, mma.sync m16n8k16 / m16n8k8, the row
// filler that converts non-bf16 caches and marks missing pages).
#pragma once

#include "attention_common.cuh"
#include "common.h"
#include "device_utils.cuh"
#include "tma.cuh"

#include <cstdint>

namespace xcuda {

constexpr float kLog2e = 1.4426950408889634f;

// The op as the split-KV and prefill kernels read it: the flash kernel's arguments plus what
// their bf16 fast paths and launch plans need.
struct DecodeArgs : AttnArgs {
    int page_shift;    // log2(page_size) when it is a power of two, else -1
    float scale_log2;  // softmax_scale · log2(e): scores are kept in log2 units
    int tile_rows;     // query rows per split-KV block: 16 or 64
    bool q_vec;        // bf16 q rows that may be loaded 16 bytes at a time
    bool early_kv;     // load the keys before the batch's own tokens before pdl_wait
};

// Launches attention_prefill_kernel for `a` (n_split = 1, bf16 q / caches / out with 16-byte
// rows; blocks of kPrefillRows query rows) when the head dims have an instance;
// XINFER_UNSUPPORTED otherwise (the caller then takes the split-KV kernel).
constexpr int kPrefillRows = 192;
int attention_prefill(Context* c, const DecodeArgs& a);

// Key-range splits per (row tile, KV head) block at most: the capacity of attention_decode.cu's
// combine kernel, which merges the splits' partials.
constexpr int kMaxDecodeSplits = 128;
// Points a.part_o / a.part_ml into the scratch buffer for a.n_split partials (nothing when
// n_split is 1) (attention_decode.cu).
int decode_partials(Context* c, DecodeArgs& a);
// Launches attention_stream_kernel (attention_stream.cu) for a decode-shaped batch (a.tile_rows
// = 16) of bf16 heads with fixed dims over 16-token pages, choosing a.n_split; XINFER_UNSUPPORTED
// when it does not take the batch. The caller launches the combine when a.n_split > 1 and the
// kernel did not merge its splits itself (*merged false).
// cache_pages: the caches' pages (their shape[0]); key_span: the keys a block may walk at most;
// est_blocks: (row tile, KV head) blocks; row_tiles: the grid's x (an upper bound).
int attention_stream(Context* c, DecodeArgs& a, int64_t cache_pages, int64_t key_span, int64_t est_blocks,
                     int64_t row_tiles, bool* merged);

namespace {

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(p)));
}
// d[16×8] += a[16×8] · b[8×8], bf16 inputs, f32 accumulators (the 8-key steps' P·V).
__device__ __forceinline__ void mma_bf16_k8(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b));
}
// d[16×8] += a[16×16] · b[16×8], bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 2^x in one MUFU.EX2 (flush-to-zero): exp2f adds a range check and two multiplies per call to
// get subnormal results right, a third of a prefill tile's softmax instructions (ncu, H200); a
// probability below 2^-126 next to a row maximum of 1 changes no sum.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// O *= corr for a warp's 16 rows (accumulators 0, 1: row g; 2, 3: row g + 8), only when some row's
// reference max moved: multiplying by exactly 1 changes nothing, so skipping is exact, and after
// the first keys the max rarely moves.
template <int kN>
__device__ __forceinline__ void rescale_rows(float (&o)[kN][4], const float (&corr)[2]) {
    if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f))
#pragma unroll
        for (int j = 0; j < kN; ++j) {
            o[j][0] *= corr[0];
            o[j][1] *= corr[0];
            o[j][2] *= corr[1];
            o[j][3] *= corr[1];
        }
}
// One online-softmax step of a warp's 16 rows over the kN·8 keys from j0 of an S accumulator
// (m16n8 tiles n: this thread's row gid in accumulators 0, 1 and row gid + 8 in 2, 3, keys
// j0 + 8n + 2·tid4 + e; a row's scores are spread over the 4 lanes of a quad): scale to log2 units,
// mask keys outside the thread's rows' [lo, hi] unless the step is `whole` (every row sees every
// key), update the running max m and sum l, and leave the probabilities in sc and each row's O
// correction factor in corr.
template <int kN>
__device__ __forceinline__ void online_softmax_step(float (&sc)[kN][4], int j0, int tid4, float scale_log2, bool whole,
                                                    const int (&lo)[2], const int (&hi)[2], float (&m)[2], float (&l)[2],
                                                    float (&corr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < kN; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = j0 + n * 8 + 2 * tid4 + e;
                float v = sc[n][2 * h + e] * scale_log2;
                if (!whole && (j < lo[h] || j > hi[h])) v = -INFINITY;
                sc[n][2 * h + e] = v;
                mx = fmaxf(mx, v);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[h], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        corr[h] = fast_exp2(m[h] - m_use);
        m[h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < kN; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = fast_exp2(sc[n][2 * h + e] - m_use);
                sc[n][2 * h + e] = p;
                sum += p;
            }
        l[h] = l[h] * corr[h] + sum;
    }
}
// A row's state once its parts are merged to (M, l), in log2 units: with one split the output
// scale alpha / denominator (the sink of query head g·G + row % G joins the denominator; the
// division only when there are sinks), else M and l for the combine. to[0] (and to[1]) receive them.
__device__ __forceinline__ void finish_row(const DecodeArgs& a, int g, int64_t row, float M, float l, float* to) {
    if (a.n_split == 1) {
        float alpha = 1.f, denom = l;
        if (a.sinks) {
            const float sink = a.sinks[g * a.group + int(row % a.group)] * kLog2e;
            const float Ms = fmaxf(M, sink);
            alpha = M == -INFINITY ? 0.f : exp2f(M - Ms);
            denom = l * alpha + exp2f(sink - Ms);
        }
        to[0] = denom == 0.f ? 0.f : alpha / denom;
    } else {
        to[0] = M;
        to[1] = l;
    }
}
// One output row R's split weights, computed by a whole warp: split z's partial (m_z, l_z), in
// log2 units, at part_ml[(z · part_rows + R) · 2]; weight[z] = exp2(m_z − M) / denominator for
// z < n_split, the sink (sinks[R % nq], none when sinks is null) joining M and the denominator.
// The loads bypass L1: the partials may come from other blocks of the same grid.
__device__ __forceinline__ void split_weights(const float* part_ml, int n_split, int64_t part_rows, int64_t R,
                                              const float* sinks, int nq, float* weight) {
    constexpr int kPerLane = kMaxDecodeSplits / 32;
    const int lane = threadIdx.x % 32;
    float m[kPerLane], l[kPerLane], M = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const int z = lane + 32 * j;
        m[j] = z < n_split ? __ldcg(part_ml + (z * part_rows + R) * 2) : -INFINITY;
        l[j] = z < n_split ? __ldcg(part_ml + (z * part_rows + R) * 2 + 1) : 0.f;
        M = fmaxf(M, m[j]);
    }
    M = warp_max(M);
    const float sink = sinks ? sinks[R % nq] * kLog2e : -INFINITY;
    const float Ms = fmaxf(M, sink);
    float denom = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        m[j] = m[j] == -INFINITY ? 0.f : exp2f(m[j] - Ms);  // from here on: the split's factor
        denom += l[j] * m[j];
    }
    denom = warp_sum(denom) + (sinks ? exp2f(sink - Ms) : 0.f);
    const float inv = denom == 0.f ? 0.f : 1.f / denom;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
        if (lane + 32 * j < n_split) weight[lane + 32 * j] = m[j] * inv;
}
// A lane's 4 adjacent columns d .. d + 3 of output row R (bf16 output, dv columns a row): the
// normalised output acc · scale with one split, else the unnormalised partial row P.
__device__ __forceinline__ void store_out4(const DecodeArgs& a, int64_t R, int64_t P, int dv, int d, float4 acc,
                                           float scale) {
    if (a.n_split == 1) {
        const __nv_bfloat162 v[2] = {__floats2bfloat162_rn(acc.x * scale, acc.y * scale),
                                     __floats2bfloat162_rn(acc.z * scale, acc.w * scale)};
        *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(a.out) + R * dv + d) = *reinterpret_cast<const uint2*>(v);
    } else {
        *reinterpret_cast<float4*>(a.part_o + P * dv + d) = acc;
    }
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// Fills one bf16 shared row [pad] of a tile: `src` ≥ 0 is the cache element offset of the row,
// kZero zero-fills, kNaN fills the first `len` elements with NaN (a needed key on a missing page).
constexpr int64_t kZero = -1, kNaN = -2;
// (Any cache dtype, any dims; the fixed-dims bf16 kernels use copy_row_part.)
__device__ __forceinline__ void fill_row_part(__nv_bfloat16* dst, const void* cache, int dtype, int64_t src, int len,
                                              int pad, bool vec, int part /*0..3*/) {
    const auto chunk = [&](int c) {
        __nv_bfloat16* d8 = dst + c * 8;
        if (src >= 0 && vec && c * 8 + 8 <= len) {
            cp_async16(d8, static_cast<const __nv_bfloat16*>(cache) + src + c * 8);
            return;
        }
        __nv_bfloat16 v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int d = c * 8 + e;
            float x = 0.f;
            if (d < len) {
                if (src >= 0) x = load_f(cache, dtype, src + d);
                else if (src == kNaN) x = __int_as_float(0x7fc00000);
            }
            v[e] = __float2bfloat16_rn(x);
        }
        *reinterpret_cast<uint4*>(d8) = *reinterpret_cast<const uint4*>(v);
    };
    for (int c = part; c * 8 < pad; c += 4) chunk(c);
}

// The bf16, fixed-dims version of fill_row_part: 16-byte chunks part, part + 4, ... of a kLen row,
// copied with cp.async from element `src` of `cache`, or filled (kZero: zeros, kNaN: NaN). One
// branch per row: fill_row_part's per-chunk test compiled to a predicated copy-or-convert sequence
// for every chunk, ~150 instructions per warp and tile of the prefill kernel (ncu, H200).
template <int kLen>
__device__ __forceinline__ void copy_row_part(__nv_bfloat16* dst, const __nv_bfloat16* cache, int64_t src, int part) {
    static_assert(kLen % 32 == 0, "each of a row's 4 threads takes whole 16-byte chunks");
    dst += part * 8;
    if (src >= 0) {
        const __nv_bfloat16* from = cache + src + part * 8;
#pragma unroll
        for (int c = 0; c < kLen / 32; ++c) cp_async16(dst + c * 32, from + c * 32);
    } else {
        const uint32_t fill = src == kNaN ? 0x7fc07fc0u : 0u;  // bf16 NaN pairs
#pragma unroll
        for (int c = 0; c < kLen / 32; ++c) *reinterpret_cast<uint4*>(dst + c * 32) = make_uint4(fill, fill, fill, fill);
    }
}

}  // namespace
}  // namespace xcuda
