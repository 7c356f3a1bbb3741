// What the op-case families share (internal to src/backend): the NMSE thresholds, the tensor
// builders, and the paged-KV families' specs, whose cases op_cases_attention.cpp builds.
#pragma once

#include "backend/cpu/kv_fp8.h"
#include "backend/op_cases.h"

#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace xinfer::op_cases {

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- thresholds ----------------------------------------------------------------------------------
//
// NMSE = Σ(device − reference)² / Σ reference², after rounding the reference to the device's
// output dtype, so a correctly rounded device result scores ~0 and what is measured is the
// device's own intermediate rounding and summation order. One rounding to a format with unit
// roundoff u (error uniform within half an ulp) costs at most u²/3 of NMSE:
// bf16 u = 2^-8 → 5.1e-6, f16 u = 2^-11 → 8e-8, f32 u = 2^-24 → 1.2e-15.
//
//  class  op family                          threshold  why
//  f32    everything                          1e-7      ggml test-backend-ops' default. A correct f32 kernel with
//                                                       another summation order or a fast exp lands at 1e-14..1e-11;
//                                                       a single bf16 rounding anywhere lands near 1e-6 and fails,
//                                                       and so do f32 RoPE angles at large positions (~1e-5).
//  f16    everything                          1e-6      ~12× one f16 rounding (a device may convert x to f16 to
//                                                       match f16 weights).
//  bf16   rmsnorm, add_rmsnorm, rope, swiglu, 5e-5      ~10× one bf16 rounding: these round once (the output; for
//         scale, add                                    add_rmsnorm also the stored residual).
//  bf16   matmul, add_rmsnorm_matmul          5e-5      bf16×bf16 products are exact in f32 and accumulate in f32;
//                                                       only x's rounding (f32 x, bf16 w) and the output remain.
//                                                       (The fused op's normed and residual round once, as
//                                                       add_rmsnorm's; y reads the rounded normed.)
//  bf16   attention                           1e-4      P is rounded to bf16 for P·V on tensor cores (≈2.5e-6),
//                                                       plus split-KV partials and the output; 20-40× margin, while
//                                                       a key off by one in a 128-wide window costs ~6e-5 per row.
//  bf16   moe_experts                         2e-4      gate_up outputs and the SwiGLU hidden are rounded to bf16
//                                                       between the two grouped GEMMs (three roundings in series).
//  exact  embedding, convert, kv_store slots, 0         copies and RNE conversions; ids must be equal (ties go to
//         argmax/sample/moe_route ids                    the lower index on every backend; sampling uses the same
//                                                       uniforms on both sides).
//  f32    moe_route weights                   1e-7      router math is f32 on every backend (logits are f32).
inline constexpr Tolerance kElementwise{1e-7, 1e-6, 5e-5};
inline constexpr Tolerance kMatmul{1e-7, 1e-6, 5e-5};
inline constexpr Tolerance kAttention{1e-7, 1e-6, 1e-4};
inline constexpr Tolerance kMoeExperts{1e-7, 1e-6, 2e-4};
inline constexpr Tolerance kRouter{1e-7, 1e-7, 1e-7};
inline constexpr Tolerance kExact{0, 0, 0};

// Host values above this many elements are filled on the device instead, from a repeated random
// chunk (perf shapes; every correctness tensor is below it).
inline constexpr int64_t kMaxHostValues = int64_t(1) << 24;

// ---- building tensors ----------------------------------------------------------------------------

int64_t product(const std::vector<int64_t>& shape);
std::vector<float> uniform(int64_t n, std::mt19937& rng, float lo, float hi);
CaseTensor make_tensor(std::string name, Slot slot, Access access, bool activation, DType dtype,
                       std::vector<int64_t> shape);
// Random values in [lo, hi], or a device fill of that magnitude for very large tensors.
void fill_uniform(CaseTensor& t, std::mt19937& rng, float lo, float hi);
CaseTensor act_input(std::string name, Slot slot, std::vector<int64_t> shape, std::mt19937& rng, float lo = -1.f,
                     float hi = 1.f);
CaseTensor act_inout(std::string name, Slot slot, std::vector<int64_t> shape, std::mt19937& rng, float lo = -1.f,
                     float hi = 1.f);
CaseTensor act_output(std::string name, Slot slot, std::vector<int64_t> shape);
CaseTensor fixed_input(std::string name, Slot slot, DType dtype, std::vector<int64_t> shape, std::mt19937& rng,
                       float lo, float hi);
CaseTensor fixed_values(std::string name, Slot slot, DType dtype, std::vector<int64_t> shape, std::vector<float> values);
CaseTensor fixed_output(std::string name, Slot slot, DType dtype, std::vector<int64_t> shape, Compare compare);
CaseTensor i32_input(std::string name, Slot slot, std::vector<int64_t> shape, std::vector<int32_t> ints);
CaseTensor i32_output(std::string name, Slot slot, std::vector<int64_t> shape);
OpCase make_case(xinfer_op_type type, std::string description, Tolerance tolerance, std::function<CaseData()> build);
CaseData start(xinfer_op_type type);
// k distinct values of [0, n), in random order.
std::vector<int32_t> distinct(int64_t n, int64_t k, std::mt19937& rng);

// ---- paged KV: kv_store and attention (op_cases_attention.cpp) ----------------------------------------

// Where one layer's K and V live: their own [pages, page_size, n_kv, d] tensors, or (pool_layers
// > 0) blocks of a pool whose pages hold several layers, page_stride elements apart (the layout
// of src/kv/kv_layout.h, plus `pad` elements per page). fp8 caches are raw bytes: each page of
// a block holds its e4m3 values, then one f32 scale per (slot, kv head) (src/backend/cpu/kv_fp8.h).
struct CacheGeometry {
    int64_t n_pages = 0, page_size = 0, n_kv = 0, dk = 0, dv = 0;
    int pool_layers = 0, layer = 0, pad = 0;
    std::optional<DType> dtype = std::nullopt;  // fixed; default: the activation dtype

    bool fp8() const { return dtype == DType::f8_e4m3; }
    int64_t k_page_elements() const { return cpu::kv_cache_page_elements(dtype.value_or(DType::f32), page_size, n_kv, dk); }
    int64_t v_page_elements() const { return cpu::kv_cache_page_elements(dtype.value_or(DType::f32), page_size, n_kv, dv); }
    int64_t page_stride() const { return pool_layers ? pool_layers * (k_page_elements() + v_page_elements()) + pad : 0; }
    int64_t k_offset() const { return layer * (k_page_elements() + v_page_elements()); }
    int64_t v_offset() const { return k_offset() + k_page_elements(); }
    // First element of page `page` of the K (or V) block in the K (or V) tensor / pool.
    int64_t k_base(int64_t page) const { return pool_layers ? page * page_stride() + k_offset() : page * k_page_elements(); }
    int64_t v_base(int64_t page) const { return pool_layers ? page * page_stride() + v_offset() : page * v_page_elements(); }
    // Element of dim i of (page, slot, kv head g) in the K (or V) tensor / pool.
    int64_t k_index(int64_t page, int64_t slot, int64_t g, int64_t i) const { return k_base(page) + (slot * n_kv + g) * dk + i; }
    int64_t v_index(int64_t page, int64_t slot, int64_t g, int64_t i) const { return v_base(page) + (slot * n_kv + g) * dv + i; }
    // fp8: byte of the f32 scale of (page, slot, kv head g).
    int64_t k_scale_byte(int64_t page, int64_t slot, int64_t g) const {
        return k_base(page) + page_size * n_kv * dk + (slot * n_kv + g) * cpu::kFp8ScaleBytes;
    }
    int64_t v_scale_byte(int64_t page, int64_t slot, int64_t g) const {
        return v_base(page) + page_size * n_kv * dv + (slot * n_kv + g) * cpu::kFp8ScaleBytes;
    }
    std::string describe() const {
        std::string text = fmt::format("page={}", page_size);
        if (pool_layers) text += fmt::format(", page_stride={} (layer {} of {})", page_stride(), layer, pool_layers);
        if (dtype) text += fmt::format(", cache={}", dtype_name(*dtype));
        return text;
    }
};

struct KvStoreSpec {
    int64_t T;
    CacheGeometry cache;
    uint32_t seed;
};
OpCase kv_store_case(const KvStoreSpec& s);

struct RopeKvStoreSpec {
    int64_t T, n_q;
    int rotary_dim;
    float theta, value_scale;
    CacheGeometry cache;  // n_kv, dk, dv of k and v; not fp8 (see rope_kv_store_case)
    uint32_t seed;
};
OpCase rope_kv_store_case(const RopeKvStoreSpec& s);

struct AttentionSpec {
    std::string label;
    std::vector<int> q_lens, kv_lens;  // per sequence; its queries are the last q_len of its kv_len keys
    int n_q = 0, n_kv = 0, dk = 0, dv = 0;
    int window = 0;
    bool causal = true, sinks = false;
    int page_size = 16;
    int pool_layers = 0, layer = 0, pad = 0;
    std::optional<DType> cache_dtype = std::nullopt;
    uint32_t seed = 1;
};
OpCase attention_case(const AttentionSpec& s);
// Keys [lo, hi] query position p of a sequence with kv_len keys may see (the CPU's rule).
std::pair<int64_t, int64_t> visible_keys(int64_t p, int64_t kv_len, int window, bool causal);

}  // namespace xinfer::op_cases
