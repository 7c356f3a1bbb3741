// Paged KV cache: kv_store writes new tokens' K/V into their slots; attention reads them back
// through each sequence's page table.
//
// attention is an online-softmax (flash-style) loop: for one query token and one KV head, the
// G = n_q/n_kv query heads that share the head walk the allowed keys page by page, in chunks of
// at most kKeyChunk keys, keeping a running max m, denominator l and f32 accumulator per head.
// Only pages that hold allowed keys are touched, so pages released by a sliding window (-1 in
// the page table) are never read.
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kv_fp8.h"
#include "backend/cpu/simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace xinfer::cpu {
namespace {

constexpr int64_t kKeyChunk = 32;

bool is_empty(const Tensor& t) { return t.data == nullptr || (t.rank > 0 && t.numel() == 0); }

// One layer's cache as the kernels address it: element i of row (slot, kv head g) of page p is
// at p·page_stride + (slot·n_kv + g)·d + i; fp8 caches keep their row scales after the values
// of each page (src/backend/cpu/kv_fp8.h).
struct CacheView {
    char* base = nullptr;
    DType dtype = DType::f32;
    int64_t page_size = 0, n_kv = 0, d = 0;
    int64_t page_stride = 0;  // elements

    CacheView(const Tensor& cache, int64_t batch_page_stride)
        : base(static_cast<char*>(cache.data)), dtype(cache.dtype), page_size(cache.dim(1)), n_kv(cache.dim(2)),
          d(cache.dim(3)),
          page_stride(batch_page_stride ? batch_page_stride : kv_cache_page_elements(dtype, page_size, n_kv, d)) {}
    char* page(int64_t p) const { return base + size_t(p * page_stride) * dtype_size(dtype); }
    char* row(int64_t p, int64_t row_in_page) const {
        return page(p) + size_t(row_in_page * d) * dtype_size(dtype);
    }
};

// `n_rows` consecutive slots of kv head g starting at (page, slot) as f32 rows of d: f32 caches
// are used in place (stride n_kv·d), bf16/f16 ones are converted and fp8 ones dequantized with
// their row scales into `scratch` (stride d). Returns the rows and their stride.
std::pair<const float*, int64_t> cache_rows_f32(const CacheView& cache, int64_t page, int64_t slot, int64_t g,
                                                int64_t n_rows, std::vector<float>& scratch) {
    const int64_t d = cache.d, first_row = slot * cache.n_kv + g;
    if (cache.dtype == DType::f32)
        return {reinterpret_cast<const float*>(cache.row(page, first_row)), cache.n_kv * d};
    scratch.resize(size_t(n_rows * d));
    for (int64_t r = 0; r < n_rows; ++r) {
        const int64_t row = first_row + r * cache.n_kv;
        float* dst = scratch.data() + r * d;
        if (cache.dtype == DType::f8_e4m3) {
            const float scale = kv_fp8_load_scale(cache.page(page), cache.page_size, cache.n_kv, d, row);
            kv_fp8_dequantize_row(reinterpret_cast<const uint8_t*>(cache.row(page, row)), scale, d, dst);
        } else {
            widen_to_f32(cache.dtype, cache.row(page, row), dst, d);
        }
    }
    return {scratch.data(), d};
}

// Asks for every cache line of `n_rows` consecutive slots of kv head g from (page, slot) on (fp8
// row scales aside). One head's rows sit n_kv·d elements apart, so with n_kv·d·size ≥ 4 KiB each
// row lies in its own 4 KiB region, where the hardware prefetchers do not follow.
void prefetch_rows(const CacheView& cache, int64_t page, int64_t slot, int64_t g, int64_t n_rows) {
    const int64_t row_bytes = cache.d * int64_t(dtype_size(cache.dtype));
    for (int64_t r = 0; r < n_rows; ++r) {
        const char* row = cache.row(page, (slot + r) * cache.n_kv + g);
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
    }
}

// Checks the metadata every sequence-level loop below relies on; returns the sequence of each
// query token.
std::vector<int32_t> check_batch(const char* op, const AttentionBatch& batch, int64_t n_tokens, int64_t page_size) {
    const int64_t n_seqs = batch.n_seqs;
    check_dtype(op, "cu_q_lens", batch.cu_q_lens, {DType::i32});
    check_shape(op, "cu_q_lens", batch.cu_q_lens, {n_seqs + 1});
    const int32_t* cu = batch.cu_q_lens.as<int32_t>();
    if (cu[0] != 0 || cu[n_seqs] != n_tokens)
        fail("{}: cu_q_lens must run from 0 to the {} query tokens, got {}..{}", op, n_tokens, cu[0], cu[n_seqs]);
    std::vector<int32_t> seq_of_token(static_cast<size_t>(n_tokens));
    for (int64_t s = 0; s < n_seqs; ++s) {
        if (cu[s + 1] < cu[s]) fail("{}: cu_q_lens decreases at sequence {} ({} -> {})", op, s, cu[s], cu[s + 1]);
        for (int32_t t = cu[s]; t < cu[s + 1]; ++t) seq_of_token[size_t(t)] = int32_t(s);
    }
    check_dtype(op, "kv_lens", batch.kv_lens, {DType::i32});
    check_shape(op, "kv_lens", batch.kv_lens, {n_seqs});
    check_dtype(op, "positions", batch.positions, {DType::i32});
    check_shape(op, "positions", batch.positions, {n_tokens});
    check_dtype(op, "page_table", batch.page_table, {DType::i32});
    check_shape(op, "page_table", batch.page_table, {n_seqs, batch.max_pages_per_seq});
    const int32_t* kv_lens = batch.kv_lens.as<int32_t>();
    for (int64_t s = 0; s < n_seqs; ++s)
        if (kv_lens[s] < 0 || kv_lens[s] > int64_t(batch.max_pages_per_seq) * page_size)
            fail("{}: kv_lens[{}] = {} exceeds {} pages of {} tokens", op, s, kv_lens[s], batch.max_pages_per_seq,
                 page_size);
    return seq_of_token;
}

}  // namespace

void kv_store(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
              const AttentionBatch& batch) {
    const char* op = "kv_store";
    check_dtype(op, "k", k, {DType::f32});
    check_dtype(op, "v", v, {DType::f32});
    check_dtype(op, "k_cache", k_cache, {DType::f32, DType::bf16, DType::f16, DType::f8_e4m3});
    check_dtype(op, "v_cache", v_cache, {DType::f32, DType::bf16, DType::f16, DType::f8_e4m3});
    check_rank(op, "k", k, 3);
    check_rank(op, "k_cache", k_cache, 4);
    const int64_t T = k.dim(0), n_kv = k.dim(1), dk = k.dim(2);
    check_shape(op, "v", v, {T, n_kv, -1});
    const int64_t dv = v.dim(2), n_pages = k_cache.dim(0), page_size = k_cache.dim(1);
    check_shape(op, "k_cache", k_cache, {n_pages, page_size, n_kv, dk});
    check_shape(op, "v_cache", v_cache, {n_pages, page_size, n_kv, dv});
    check_dtype(op, "slot_mapping", batch.slot_mapping, {DType::i32});
    check_shape(op, "slot_mapping", batch.slot_mapping, {T});
    const int32_t* slots = batch.slot_mapping.as<int32_t>();
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= n_pages * page_size)
            fail("{}: slot_mapping[{}] = {} is beyond the cache's {} pages of {} tokens", op, t, slots[t], n_pages,
                 page_size);

    // Slot s is token s % page_size of page s / page_size (see CacheView for the addressing).
    const CacheView k_view(k_cache, batch.page_stride), v_view(v_cache, batch.page_stride);
    auto store_rows = [&](const float* src /*[n_kv, d]*/, const CacheView& cache, int64_t slot) {
        const int64_t page = slot / page_size, row0 = (slot % page_size) * n_kv, d = cache.d;
        if (cache.dtype != DType::f8_e4m3) {
            convert_from_f32(src, cache.dtype, cache.row(page, row0), n_kv * d);
            return;
        }
        for (int64_t g = 0; g < n_kv; ++g) {
            const float scale =
                kv_fp8_quantize_row(src + g * d, d, reinterpret_cast<uint8_t*>(cache.row(page, row0 + g)));
            kv_fp8_store_scale(cache.page(page), page_size, n_kv, d, row0 + g, scale);
        }
    };
#pragma omp parallel for schedule(static) if (T * n_kv * (dk + dv) > (1 << 15))
    for (int64_t t = 0; t < T; ++t) {
        if (slots[t] < 0) continue;
        store_rows(k.as<float>() + t * n_kv * dk, k_view, slots[t]);
        store_rows(v.as<float>() + t * n_kv * dv, v_view, slots[t]);
    }
}

void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& sinks,
               const AttentionBatch& batch, const AttentionParams& params, const Tensor& out) {
    const char* op = "attention";
    check_dtype(op, "q", q, {DType::f32});
    check_dtype(op, "out", out, {DType::f32});
    check_dtype(op, "k_cache", k_cache, {DType::f32, DType::bf16, DType::f16, DType::f8_e4m3});
    check_dtype(op, "v_cache", v_cache, {DType::f32, DType::bf16, DType::f16, DType::f8_e4m3});
    const int64_t n_q = params.n_q_heads, n_kv = params.n_kv_heads, dk = params.head_dim_k, dv = params.head_dim_v;
    if (n_q <= 0 || n_kv <= 0 || n_q % n_kv != 0)
        fail("{}: n_q_heads {} must be a positive multiple of n_kv_heads {}", op, n_q, n_kv);
    if (params.page_size <= 0) fail("{}: page_size {} must be positive", op, params.page_size);
    check_rank(op, "q", q, 3);
    const int64_t T = q.dim(0), page_size = params.page_size, n_pages = k_cache.dim(0);
    check_shape(op, "q", q, {T, n_q, dk});
    check_shape(op, "out", out, {T, n_q, dv});
    check_shape(op, "k_cache", k_cache, {n_pages, page_size, n_kv, dk});
    check_shape(op, "v_cache", v_cache, {n_pages, page_size, n_kv, dv});
    const bool has_sinks = !is_empty(sinks);
    if (has_sinks) {
        check_dtype(op, "sinks", sinks, {DType::f32});
        check_shape(op, "sinks", sinks, {n_q});
    }
    const std::vector<int32_t> seq_of_token = check_batch(op, batch, T, page_size);

    const int64_t group = n_q / n_kv;
    const int32_t* kv_lens = batch.kv_lens.as<int32_t>();
    const int32_t* positions = batch.positions.as<int32_t>();
    const int32_t* page_table = batch.page_table.as<int32_t>();
    const float* q_data = q.as<float>();
    const float* sink_data = has_sinks ? sinks.as<float>() : nullptr;
    float* out_data = out.as<float>();
    const float scale = params.softmax_scale;
    const CacheView k_view(k_cache, batch.page_stride), v_view(v_cache, batch.page_stride);
    ParallelError error;

#pragma omp parallel
    {
        std::vector<float> k_scratch, v_scratch;
        std::vector<float> scores(size_t(group * kKeyChunk));
        std::vector<float> acc(size_t(group * dv)), running_max(static_cast<size_t>(group)),
            denom(static_cast<size_t>(group));

#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t t = 0; t < T; ++t) {
            for (int64_t g = 0; g < n_kv; ++g) {
                if (error.failed()) continue;
                const int64_t s = seq_of_token[size_t(t)], p = positions[t], kv_len = kv_lens[s];
                // Allowed keys form one contiguous range [lo, hi].
                int64_t lo = 0, hi = kv_len - 1;
                if (params.causal) hi = std::min(hi, p);
                if (params.window > 0) {
                    lo = std::max<int64_t>(0, p - params.window + 1);
                    if (!params.causal) hi = std::min<int64_t>(hi, p + params.window - 1);
                }
                for (int64_t h = 0; h < group; ++h) {
                    running_max[size_t(h)] =
                        has_sinks ? sink_data[g * group + h] : -std::numeric_limits<float>::infinity();
                    denom[size_t(h)] = has_sinks ? 1.f : 0.f;  // the sink's own exp(sink - m), m = sink
                }
                std::fill(acc.begin(), acc.end(), 0.f);

                for (int64_t j0 = lo; j0 <= hi;) {
                    const int64_t logical_page = j0 / page_size, offset = j0 % page_size;
                    const int64_t n_keys = std::min({kKeyChunk, page_size - offset, hi - j0 + 1});
                    const int32_t page = page_table[s * batch.max_pages_per_seq + logical_page];
                    if (page < 0 || page >= n_pages) {
                        error.record(
                            fmt::format("{}: sequence {} needs key {} on logical page {}, but its page table "
                                        "holds {} (cache has {} pages)",
                                        op, s, j0, logical_page, page, n_pages));
                        break;
                    }
                    // The next chunk's rows load while this one computes (prefetch_rows says why).
                    // With the value rows summed by axpy_rows: Qwen3-1.7B, 2,048-key decode, f32
                    // cache, 2 threads: 1.33 / 1.51 -> 1.13 / 1.19 ms per layer (two A/B pairs).
                    if (const int64_t next = j0 + n_keys; next <= hi) {
                        const int32_t next_page = page_table[s * batch.max_pages_per_seq + next / page_size];
                        const int64_t next_offset = next % page_size;
                        const int64_t next_keys = std::min({kKeyChunk, page_size - next_offset, hi - next + 1});
                        if (next_page >= 0 && next_page < n_pages) {
                            prefetch_rows(k_view, next_page, next_offset, g, next_keys);
                            prefetch_rows(v_view, next_page, next_offset, g, next_keys);
                        }
                    }
                    // Slots offset.. of kv head g of the page.
                    const auto [keys, key_stride] = cache_rows_f32(k_view, page, offset, g, n_keys, k_scratch);
                    const auto [values, value_stride] = cache_rows_f32(v_view, page, offset, g, n_keys, v_scratch);

                    for (int64_t h = 0; h < group; ++h) {
                        const float* qh = q_data + (t * n_q + g * group + h) * dk;
                        float* sh = scores.data() + h * kKeyChunk;
                        float chunk_max = running_max[size_t(h)];
                        for (int64_t j = 0; j < n_keys; ++j) {
                            sh[j] = scale * simd::dot<simd::WeightF32>(qh, keys + j * key_stride, dk);
                            chunk_max = std::max(chunk_max, sh[j]);
                        }
                        // Rescale what was accumulated under the old max, then add this chunk.
                        const float correction = std::exp(running_max[size_t(h)] - chunk_max);
                        running_max[size_t(h)] = chunk_max;
                        float* acc_h = acc.data() + h * dv;
                        float chunk_sum = 0.f;
                        for (int64_t j = 0; j < n_keys; ++j) {
                            sh[j] = std::exp(sh[j] - chunk_max);
                            chunk_sum += sh[j];
                        }
                        denom[size_t(h)] = denom[size_t(h)] * correction + chunk_sum;
                        if (correction != 1.f) {
#pragma omp simd
                            for (int64_t d = 0; d < dv; ++d) acc_h[d] *= correction;
                        }
                        simd::axpy_rows(sh, values, value_stride, n_keys, acc_h, dv);
                    }
                    j0 += n_keys;
                }

                for (int64_t h = 0; h < group; ++h) {
                    float* dst = out_data + (t * n_q + g * group + h) * dv;
                    const float inv = denom[size_t(h)] > 0.f ? 1.f / denom[size_t(h)] : 0.f;
                    const float* acc_h = acc.data() + h * dv;
#pragma omp simd
                    for (int64_t d = 0; d < dv; ++d) dst[d] = acc_h[d] * inv;
                }
            }
        }
    }
    error.rethrow();
}

}  // namespace xinfer::cpu
