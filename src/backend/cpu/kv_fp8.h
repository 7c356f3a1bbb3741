// The FP8 KV-cache rule: how a K or V row is quantized to e4m3 with its scale, and read back.
// This is the one definition every backend follows (the CUDA plugin's kv_store/attention
// kernels implement the same steps; ops-test compares the stored bytes exactly).
//
// Granularity: one f32 scale per (token, kv head) row of K and of V (dynamic per-token
// quantization). A row x[d] is stored as
//     amax  = max_i |x_i|            (NaN propagates: a NaN anywhere makes amax NaN)
//     scale = amax / 448             (f32 division; 448 = largest finite e4m3)
//     scale = 1 if scale == 0        (all-zero row, or amax so small that scale underflows)
//     q_i   = e4m3(x_i / scale)      (f32 division, round to nearest even, saturating to ±448,
//                                     NaN stays NaN)
// and read back as float(q_i) · scale (one f32 product). Non-finite input never turns finite:
// NaN gives NaN scales/values, ±inf gives scale inf and dequantized values 0·inf = NaN.
//
// Error: for |x_i / scale| ≥ 2^-6 (e4m3 normal range) the rounding is ≤ 2^-4 relative to x_i;
// below it the absolute error is ≤ 2^-10 · scale. Either way |dequantized − x_i| ≤ 2^-4 · amax.
//
// Where the scales live (the cache format of include/xinfer/backend_abi.h): a page of an f8_e4m3
// cache tensor [pages, page_size, n_kv, d] holds its page_size·n_kv·d e4m3 bytes followed by
// page_size·n_kv f32 scales, row (slot, head) at index slot·n_kv + head; pages are page_stride
// bytes apart, or page_size·n_kv·(d + 4) when the batch's page_stride is 0.
#pragma once

#include "core/dtype.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace xinfer::cpu {

constexpr float kFp8E4m3Max = 448.f;
constexpr int64_t kFp8ScaleBytes = 4;  // one f32 per (token, kv head) row

// f32 → e4m3 (OCP "fn": no infinities, 0x7f/0xff NaN), round to nearest even, saturating to
// ±448, NaN → 0x7f. Bit-exact with core's f32_to_f8_e4m3 (an exhaustive search) but fast.
inline uint8_t f32_to_e4m3_rne(float value) {
    if (std::isnan(value)) return 0x7f;
    const uint32_t bits = std::bit_cast<uint32_t>(value);
    const uint8_t sign = uint8_t((bits >> 24) & 0x80u);
    const float magnitude = std::fabs(value);
    if (magnitude >= kFp8E4m3Max) return uint8_t(sign | 0x7e);
    uint32_t code;
    if (magnitude < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (the product is exact)
        code = uint32_t(std::nearbyint(magnitude * 512.f));  // default rounding mode: to nearest even
    } else {
        // Round the 23-bit mantissa to 3 bits (nearest even) and rebias the exponent 127 → 7.
        const uint32_t abs_bits = bits & 0x7fffffffu;
        const uint32_t rounded = abs_bits + 0x7ffffu + ((abs_bits >> 20) & 1u);
        code = (rounded >> 20) - (120u << 3);
    }
    return uint8_t(sign | (code > 0x7e ? 0x7eu : code));
}

// e4m3 byte → f32, exact (a table of the 256 codes).
inline float e4m3_to_f32(uint8_t code) {
    static const std::array<float, 256> table = [] {
        std::array<float, 256> t{};
        for (int c = 0; c < 256; ++c) t[size_t(c)] = f8_e4m3_to_f32(uint8_t(c));
        return t;
    }();
    return table[code];
}

// The row's scale (see the rule above).
inline float kv_fp8_row_scale(const float* x, int64_t d) {
    float amax = 0.f;
    for (int64_t i = 0; i < d; ++i) {
        const float a = std::fabs(x[i]);
        amax = (a > amax || a != a) && amax == amax ? a : amax;  // NaN sticks once seen
    }
    const float scale = amax / kFp8E4m3Max;
    return scale == 0.f ? 1.f : scale;
}

// Quantizes x[d] into q[d] and returns the scale to store with it.
inline float kv_fp8_quantize_row(const float* x, int64_t d, uint8_t* q) {
    const float scale = kv_fp8_row_scale(x, d);
    for (int64_t i = 0; i < d; ++i) q[i] = f32_to_e4m3_rne(x[i] / scale);
    return scale;
}

// out[d] = float(q[i]) · scale.
inline void kv_fp8_dequantize_row(const uint8_t* q, float scale, int64_t d, float* out) {
    for (int64_t i = 0; i < d; ++i) out[i] = e4m3_to_f32(q[i]) * scale;
}

// Bytes of one page of one cache tensor [pages, page_size, n_kv, d] of `dtype` when the batch's
// page_stride is 0 (values, then fp8 scales), i.e. the contiguous page stride in elements.
inline int64_t kv_cache_page_elements(DType dtype, int64_t page_size, int64_t n_kv, int64_t d) {
    if (dtype == DType::f8_e4m3) return page_size * n_kv * (d + kFp8ScaleBytes);
    return page_size * n_kv * d;
}

// The scale of row (slot, head) of page `page`: page_base points at the page's first value byte.
inline float kv_fp8_load_scale(const char* page_base, int64_t page_size, int64_t n_kv, int64_t d, int64_t row) {
    float scale;
    std::memcpy(&scale, page_base + page_size * n_kv * d + row * kFp8ScaleBytes, sizeof scale);
    return scale;
}
inline void kv_fp8_store_scale(char* page_base, int64_t page_size, int64_t n_kv, int64_t d, int64_t row, float scale) {
    std::memcpy(page_base + page_size * n_kv * d + row * kFp8ScaleBytes, &scale, sizeof scale);
}

}  // namespace xinfer::cpu
