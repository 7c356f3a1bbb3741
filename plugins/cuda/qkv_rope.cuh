// The attention prologue inside one token's q|k|v projection (ADD_RMSNORM_MATMUL_ROPE_KV_STORE):
// the one-row FP8 norm GEMV (gemm.cu, mma_gemv_kernel<..., kNorm, kRope>) rotates q and k, scales
// v and stores the new key and value into their cache slots itself, so that ROPE_KV_STORE's
// launch, and the launch boundary before attention it added, are gone from a decode layer.
//
// Why every row can be finished where it was computed: the projection's row is [q heads | k heads
// | v heads], and a block of that kernel owns 64 consecutive rows (four 16-row tiles, lane (g, c)
// of a tile's first warp holding rows g and g + 8). With dk and dv multiples of 64, a block's rows
// lie in one head; with rotary_dim a multiple of 32 up to 64, a rotated pair (d, d + rotary_dim/2)
// lies in the first block of its head, in tiles rotary_dim/32 apart, in the same lane. The block
// swaps its rows through shared memory once (one barrier, in the blocks that rotate) and each
// writer lane rotates, rounds and stores its two rows - the arithmetic of rope_kv_store_kernel
// (attention.cu), so both paths give the same bits.
#pragma once

#include "device_utils.cuh"

#include <cstdint>

namespace xcuda {

constexpr int kQkvRopeBlockRows = 64;  // rows of y a block owns: four 16-row tiles

struct QkvRope {
    void* k_cache = nullptr;                // [pages][page_size][n_kv][dk] (float dtypes), pages k_page_stride apart
    void* v_cache = nullptr;                // as k_cache, with dv
    int kc_dtype = XINFER_DTYPE_BF16, vc_dtype = XINFER_DTYPE_BF16;
    const int32_t* positions = nullptr;     // [1] the token's position
    const int32_t* slot_mapping = nullptr;  // [1] its cache slot; -1: rotate and scale, store nothing
    int n_q = 0, n_kv = 0, dk = 0, dv = 0, rotary_dim = 0, page_size = 0;
    float theta = 0.f, value_scale = 1.f;
    int64_t k_page_stride = 0, v_page_stride = 0;  // elements
    bool early = false;  // position and slot read before pdl_wait (early_reads(): host-written inputs)
};

// What a block's 64 rows are: rows [dim0, dim0 + 64) of head `head` of q (kind 0), k (1) or v (2).
struct QkvBlock {
    int kind = 0, head = 0, dim0 = 0;
    __device__ bool rotates(const QkvRope& r) const { return kind < 2 && dim0 < r.rotary_dim; }
};
__device__ inline QkvBlock qkv_block(const QkvRope& r, int64_t row0) {
    const int64_t q_rows = int64_t(r.n_q) * r.dk, k_rows = int64_t(r.n_kv) * r.dk;
    if (row0 < q_rows) return {0, int(row0 / r.dk), int(row0 % r.dk)};
    if (row0 < q_rows + k_rows) return {1, int((row0 - q_rows) / r.dk), int((row0 - q_rows) % r.dk)};
    const int64_t v = row0 - q_rows - k_rows;
    return {2, int(v / r.dv), int(v % r.dv)};
}

// The writer lane's inputs read from host-written memory: the slot, and (cos, sin) of its two rows
// (f64 angle rounded to f32, as rope_kv_store_kernel computes it; (1, 0) for unrotated rows).
struct QkvLaneInputs {
    int32_t slot = -1;
    float2 angle[2] = {make_float2(1.f, 0.f), make_float2(1.f, 0.f)};
};
__device__ inline QkvLaneInputs qkv_lane_inputs(const QkvRope& r, const QkvBlock& b, int local /*row g of the tile*/) {
    QkvLaneInputs in;
    in.slot = r.slot_mapping[0];
    if (!b.rotates(r)) return in;
    const int half = r.rotary_dim / 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int d = b.dim0 + local + 8 * h;
        if (d >= r.rotary_dim) continue;
        const double inv_freq = pow(double(r.theta), -2.0 * (d % half) / double(r.rotary_dim));
        double s, co;
        sincos(double(r.positions[0]) * inv_freq, &s, &co);
        in.angle[h] = make_float2(float(co), float(s));
    }
    return in;
}

// Every thread of the block calls this once (it may synchronize). value: rows local and local + 8
// of the block (local = 16·tile + g) as y stores them (rounded to y's dtype), meaningful in writer
// lanes only. Stores y's rows rotated (q, k) or scaled (v), and k / v into the token's cache slot.
__device__ inline void store_qkv_rows(const QkvRope& r, const QkvBlock& b, const QkvLaneInputs& in, void* y,
                                      int y_dtype, int64_t row0, int local, bool writer, const float (&value)[2]) {
    __shared__ float rows_s[kQkvRopeBlockRows];
    if (b.rotates(r)) {  // block-uniform
        if (writer) {
            rows_s[local] = value[0];
            rows_s[local + 8] = value[1];
        }
        __syncthreads();
    }
    if (!writer) return;
    const int half = r.rotary_dim / 2;
    const int64_t page = in.slot >= 0 ? in.slot / r.page_size : 0, offset = in.slot >= 0 ? in.slot % r.page_size : 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int at = local + 8 * h, d = b.dim0 + at;
        float out = value[h];
        if (b.rotates(r) && d < r.rotary_dim) {
            const float co = in.angle[h].x, s = in.angle[h].y;
            const float other = rows_s[d < half ? at + half : at - half];
            out = d < half ? value[h] * co - other * s : value[h] * co + other * s;  // (lo, hi) -> (lo·c - hi·s, hi·c + lo·s)
        }
        if (b.kind == 2) out = round_to(y_dtype, out * r.value_scale);
        store_f(y, y_dtype, row0 + at, out);
        if (in.slot < 0 || b.kind == 0) continue;
        if (b.kind == 1)
            store_f(r.k_cache, r.kc_dtype, page * r.k_page_stride + (offset * r.n_kv + b.head) * r.dk + d,
                    round_to(y_dtype, out));
        else
            store_f(r.v_cache, r.vc_dtype, page * r.v_page_stride + (offset * r.n_kv + b.head) * r.dv + d, out);
    }
}

}  // namespace xcuda
