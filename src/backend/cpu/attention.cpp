// Paged KV cache: kv_store writes new tokens' K/V into their slots; attention reads them back
// through each sequence's page table.
//
// attention is an online-softmax (flash-style) loop: for one query token and one KV head, the
// G = n_q/n_kv query heads that share the head walk the allowed keys page by page, in chunks of
// at most kKeyChunk keys, keeping a running max m, denominator l and f32 accumulator per head.
// Only pages that hold allowed keys are touched, so pages released by a sliding window (-1 in
// the page table) are never read.
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace xinfer::cpu {
namespace {

constexpr int64_t kKeyChunk = 32;

bool is_empty(const Tensor& t) { return t.data == nullptr || (t.rank > 0 && t.numel() == 0); }

// `n_rows` cache rows of `row_len` elements, `row_stride` elements apart starting at element
// `first`, as f32: f32 caches are used in place (same stride), bf16/f16 ones are converted into
// `scratch` (stride row_len). Returns the rows and their stride.
std::pair<const float*, int64_t> cache_rows_f32(const Tensor& cache, int64_t first, int64_t n_rows, int64_t row_stride,
                                                int64_t row_len, std::vector<float>& scratch) {
    if (cache.dtype == DType::f32) return {cache.as<float>() + first, row_stride};
    scratch.resize(size_t(n_rows * row_len));
    const size_t elem = dtype_size(cache.dtype);
    const char* base = static_cast<const char*>(cache.data);
    for (int64_t r = 0; r < n_rows; ++r)
        widen_to_f32(cache.dtype, base + size_t(first + r * row_stride) * elem, scratch.data() + r * row_len, row_len);
    return {scratch.data(), row_len};
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
    check_dtype(op, "k_cache", k_cache, {DType::f32, DType::bf16, DType::f16});
    check_dtype(op, "v_cache", v_cache, {DType::f32, DType::bf16, DType::f16});
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

    // Slot s is token s % page_size of page s / page_size; pages are batch.page_stride elements
    // apart (0: contiguous, i.e. page_size · len).
    auto store_row = [&](const float* src, const Tensor& cache, int64_t slot, int64_t len) {
        const int64_t stride = batch.page_stride ? batch.page_stride : page_size * len;
        const int64_t element = (slot / page_size) * stride + (slot % page_size) * len;
        void* dst = static_cast<char*>(cache.data) + size_t(element) * dtype_size(cache.dtype);
        convert_from_f32(src, cache.dtype, dst, len);
    };
#pragma omp parallel for schedule(static) if (T * n_kv * (dk + dv) > (1 << 15))
    for (int64_t t = 0; t < T; ++t) {
        if (slots[t] < 0) continue;
        store_row(k.as<float>() + t * n_kv * dk, k_cache, slots[t], n_kv * dk);
        store_row(v.as<float>() + t * n_kv * dv, v_cache, slots[t], n_kv * dv);
    }
}

void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& sinks,
               const AttentionBatch& batch, const AttentionParams& params, const Tensor& out) {
    const char* op = "attention";
    check_dtype(op, "q", q, {DType::f32});
    check_dtype(op, "out", out, {DType::f32});
    check_dtype(op, "k_cache", k_cache, {DType::f32, DType::bf16, DType::f16});
    check_dtype(op, "v_cache", v_cache, {DType::f32, DType::bf16, DType::f16});
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
                    // Token `offset`, kv head g of the page; pages are page_stride elements apart.
                    const int64_t row_in_page = offset * n_kv + g;
                    const int64_t k_stride = batch.page_stride ? batch.page_stride : page_size * n_kv * dk;
                    const int64_t v_stride = batch.page_stride ? batch.page_stride : page_size * n_kv * dv;
                    const auto [keys, key_stride] =
                        cache_rows_f32(k_cache, page * k_stride + row_in_page * dk, n_keys, n_kv * dk, dk, k_scratch);
                    const auto [values, value_stride] =
                        cache_rows_f32(v_cache, page * v_stride + row_in_page * dv, n_keys, n_kv * dv, dv, v_scratch);

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
                        for (int64_t j = 0; j < n_keys; ++j) simd::axpy(sh[j], values + j * value_stride, acc_h, dv);
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
