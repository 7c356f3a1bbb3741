// A thin f32 SIMD vector for the CPU kernels: AVX-512 when the build targets it, AVX2+FMA+F16C
// (x86-64-v3) otherwise, and plain arrays as a last resort. Kernels are written once against
// these functions and pick their tile sizes from kLanes / kRegisters.
#pragma once

#include "core/dtype.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
// GCC 12's unmasked AVX-512 intrinsics start from `_mm512_undefined_*()` (`__m512i __Y = __Y;`),
// which -W(maybe-)uninitialized reports once inlined into OpenMP-outlined functions. The
// diagnostic state is looked up at the header's own lines, so silencing just the include works.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace xinfer::cpu::simd {

#if defined(__AVX512F__)

constexpr int kLanes = 16;
constexpr int kRegisters = 32;
using VecF = __m512;

inline VecF zero() { return _mm512_setzero_ps(); }
inline VecF broadcast(float value) { return _mm512_set1_ps(value); }
inline VecF load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF add(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF mul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF div(VecF a, VecF b) { return _mm512_div_ps(a, b); }
inline float reduce_add(VecF v) { return _mm512_reduce_add_ps(v); }
// bf16 is the high half of an f32: widen to 32 bits and shift, all in registers.
inline VecF load_bf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline VecF load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// e^x per lane, within 2 ulp of std::exp for normal results (see exp_polynomial below); NaN stays
// NaN, overflow gives inf, underflow a denormal or 0. min/max keep x as their second operand so
// that a NaN x passes through (they return the second operand when either is NaN).
inline VecF exp_polynomial(VecF r);
inline VecF exp_lanes(VecF x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.f), _mm512_min_ps(_mm512_set1_ps(89.f), x));
    const VecF n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    VecF r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n·ln2, ln2 in two parts
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    return _mm512_scalef_ps(exp_polynomial(r), n);
}
// 2·kLanes bf16 from one full-width load: the even-indexed elements are the low halves of each
// 32-bit lane (shift them up), the odd ones the high halves (mask the low bits off). Cheaper than
// widening, and the dot-product kernels permute x once to match.
inline void load_bf16_even_odd(const uint16_t* p, VecF& even, VecF& odd) {
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr int kLanes = 8;
constexpr int kRegisters = 16;
using VecF = __m256;

inline VecF zero() { return _mm256_setzero_ps(); }
inline VecF broadcast(float value) { return _mm256_set1_ps(value); }
inline VecF load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF add(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF mul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF div(VecF a, VecF b) { return _mm256_div_ps(a, b); }
inline float reduce_add(VecF v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}
inline VecF load_bf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline VecF load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void load_bf16_even_odd(const uint16_t* p, VecF& even, VecF& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));
}
// e^x per lane as the AVX-512 version; 2^n is applied as 2^(n/2) · 2^(n - n/2), each built in the
// exponent bits, so that overflow and gradual underflow round once, as scalef does.
inline VecF exp_polynomial(VecF r);
inline VecF exp_lanes(VecF x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.f), _mm256_min_ps(_mm256_set1_ps(89.f), x));
    const VecF n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    VecF r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const auto pow2 = [](__m256i e) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
    };
    return _mm256_mul_ps(_mm256_mul_ps(exp_polynomial(r), pow2(n1)), pow2(n2));
}

#else

// Portable fallback: correct everywhere, vectorised only as far as the compiler manages.
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
struct VecF {
    float lane[kLanes];
};

inline VecF zero() { return VecF{}; }
inline VecF broadcast(float value) {
    VecF v;
    for (float& x : v.lane) x = value;
    return v;
}
inline VecF load(const float* p) {
    VecF v;
    std::memcpy(v.lane, p, sizeof(v.lane));
    return v;
}
inline void store(float* p, VecF v) { std::memcpy(p, v.lane, sizeof(v.lane)); }
inline VecF fma(VecF a, VecF b, VecF c) {
    for (int i = 0; i < kLanes; ++i) c.lane[i] += a.lane[i] * b.lane[i];
    return c;
}
inline VecF add(VecF a, VecF b) {
    for (int i = 0; i < kLanes; ++i) a.lane[i] += b.lane[i];
    return a;
}
inline VecF mul(VecF a, VecF b) {
    for (int i = 0; i < kLanes; ++i) a.lane[i] *= b.lane[i];
    return a;
}
inline VecF div(VecF a, VecF b) {
    for (int i = 0; i < kLanes; ++i) a.lane[i] /= b.lane[i];
    return a;
}
inline float reduce_add(VecF v) {
    float sum = 0.f;
    for (float x : v.lane) sum += x;
    return sum;
}
inline VecF load_bf16(const uint16_t* p) {
    VecF v;
    for (int i = 0; i < kLanes; ++i) v.lane[i] = bf16_to_f32(p[i]);
    return v;
}
inline VecF load_f16(const uint16_t* p) {
    VecF v;
    for (int i = 0; i < kLanes; ++i) v.lane[i] = f16_to_f32(p[i]);
    return v;
}
inline void load_bf16_even_odd(const uint16_t* p, VecF& even, VecF& odd) {
    for (int i = 0; i < kLanes; ++i) {
        even.lane[i] = bf16_to_f32(p[2 * i]);
        odd.lane[i] = bf16_to_f32(p[2 * i + 1]);
    }
}
inline VecF exp_lanes(VecF x) {
    for (float& v : x.lane) v = std::exp(v);
    return x;
}

#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
// e^r for |r| ≤ ln2/2: 1 + r + r²·p(r), p of degree 5 (Cephes expf's coefficients).
inline VecF exp_polynomial(VecF r) {
    VecF p = broadcast(1.9875691500e-4f);
    p = fma(p, r, broadcast(1.3981999507e-3f));
    p = fma(p, r, broadcast(8.3334519073e-3f));
    p = fma(p, r, broadcast(4.1665795894e-2f));
    p = fma(p, r, broadcast(1.6666665459e-1f));
    p = fma(p, r, broadcast(5.0000001201e-1f));
    return add(fma(p, mul(r, r), r), broadcast(1.f));
}
#endif

// Weight element types as compile-time tags, so one kernel template serves f32, bf16 and f16
// weights with the conversion inlined into the inner loop.
//  - load: kLanes consecutive elements.
//  - load_pair: 2·kLanes elements as two vectors; when kEvenOdd, the vectors hold the even- and
//    odd-indexed elements and the other operand must be permuted the same way (permute_pairs).
struct WeightF32 {
    using Storage = float;
    static constexpr bool kEvenOdd = false;
    static VecF load(const Storage* p) { return simd::load(p); }
    static void load_pair(const Storage* p, VecF& a, VecF& b) {
        a = simd::load(p);
        b = simd::load(p + kLanes);
    }
    static float scalar(Storage v) { return v; }
};
struct WeightBf16 {
    using Storage = uint16_t;
    static constexpr bool kEvenOdd = true;
    static VecF load(const Storage* p) { return load_bf16(p); }
    static void load_pair(const Storage* p, VecF& a, VecF& b) { load_bf16_even_odd(p, a, b); }
    static float scalar(Storage v) { return bf16_to_f32(v); }
};
struct WeightF16 {
    using Storage = uint16_t;
    static constexpr bool kEvenOdd = false;
    static VecF load(const Storage* p) { return load_f16(p); }
    static void load_pair(const Storage* p, VecF& a, VecF& b) {
        a = load_f16(p);
        b = load_f16(p + kLanes);
    }
    static float scalar(Storage v) { return f16_to_f32(v); }
};

// Reorders each full chunk of 2·kLanes values to [even-indexed | odd-indexed], the layout
// load_pair produces for kEvenOdd weights; a partial last chunk is copied unchanged.
inline void permute_pairs(const float* src, float* dst, int64_t n) {
    int64_t k = 0;
    for (; k + 2 * kLanes <= n; k += 2 * kLanes)
        for (int i = 0; i < kLanes; ++i) {
            dst[k + i] = src[k + 2 * i];
            dst[k + kLanes + i] = src[k + 2 * i + 1];
        }
    for (; k < n; ++k) dst[k] = src[k];
}

// Converts n elements of a weight row to f32 (vectorised body, scalar tail).
template <typename Weight>
inline void widen_row(const typename Weight::Storage* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store(dst + i, Weight::load(src + i));
    for (; i < n; ++i) dst[i] = Weight::scalar(src[i]);
}

// Dot product of an f32 row and a weight row with f32 accumulation.
template <typename Weight>
inline float dot(const float* x, const typename Weight::Storage* w, int64_t n) {
    VecF acc0 = zero(), acc1 = zero();
    int64_t i = 0;
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
        acc0 = fma(load(x + i), Weight::load(w + i), acc0);
        acc1 = fma(load(x + i + kLanes), Weight::load(w + i + kLanes), acc1);
    }
    for (; i + kLanes <= n; i += kLanes) acc0 = fma(load(x + i), Weight::load(w + i), acc0);
    float sum = reduce_add(add(acc0, acc1));
    for (; i < n; ++i) sum += x[i] * Weight::scalar(w[i]);
    return sum;
}

// y[i] += a * x[i]
inline void axpy(float a, const float* x, float* y, int64_t n) {
    const VecF va = broadcast(a);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store(y + i, fma(va, load(x + i), load(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
}

// y[i] += Σ_j a[j] · x[j·stride + i], j = 0..m-1: the sums of m axpy calls, in the same order per
// element, with y held in registers across the m rows instead of loaded and stored per row.
inline void axpy_rows(const float* a, const float* x, int64_t stride, int64_t m, float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
        VecF y0 = load(y + i), y1 = load(y + i + kLanes);
        for (int64_t j = 0; j < m; ++j) {
            const VecF aj = broadcast(a[j]);
            y0 = fma(aj, load(x + j * stride + i), y0);
            y1 = fma(aj, load(x + j * stride + i + kLanes), y1);
        }
        store(y + i, y0);
        store(y + i + kLanes, y1);
    }
    for (; i + kLanes <= n; i += kLanes) {
        VecF y0 = load(y + i);
        for (int64_t j = 0; j < m; ++j) y0 = fma(broadcast(a[j]), load(x + j * stride + i), y0);
        store(y + i, y0);
    }
    for (; i < n; ++i)
        for (int64_t j = 0; j < m; ++j) y[i] += a[j] * x[j * stride + i];
}

}  // namespace xinfer::cpu::simd
