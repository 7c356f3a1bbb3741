// Paged KV cache: kv_store writes new tokens' K/V into their slots; attention reads them back
// through each sequence's page table.
//
// attention is an online-softmax (flash-style) loop: for a tile of up to kQueryTile tokens of one
// sequence and one KV head, the G = n_q/n_kv query heads of each token walk that token's allowed
// keys page by page, in chunks of at most kKeyChunk keys, keeping a running max m, denominator l
// and f32 accumulator per (token, head). The chunks follow one grid (multiples of kKeyChunk within
// each page), and the tile's tokens share each loaded chunk: a token sees the same keys in the
// same chunks whatever tile it is in, so its result does not depend on the rest of the batch.
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
// Query tokens of one sequence that share each loaded K/V chunk. One token per work item re-read
// every key from L3 for every token: Qwen3-1.7B, 2,048-token prefill, attention 20 s of 46 s.
constexpr int64_t kQueryTile = 8;

// s[j] = exp(s[j] - m) for j < n; returns their sum. Full vectors take simd::exp_lanes (≤ 1 ulp
// from std::exp), the tail std::exp.
float exp_shifted_sum(float* s, int64_t n, float m) {
    const simd::VecF shift = simd::broadcast(-m);
    simd::VecF sum = simd::zero();
    int64_t j = 0;
    for (; j + simd::kLanes <= n; j += simd::kLanes) {
        const simd::VecF e = simd::exp_lanes(simd::add(simd::load(s + j), shift));
        simd::store(s + j, e);
        sum = simd::add(sum, e);
    }
    float total = simd::reduce_add(sum);
    for (; j < n; ++j) {
        s[j] = std::exp(s[j] - m);
        total += s[j];
    }
    return total;
}

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

// Checks the metadata every sequence-level loop below relies on.
void check_batch(const char* op, const AttentionBatch& batch, int64_t n_tokens, int64_t page_size) {
    const int64_t n_seqs = batch.n_seqs;
    check_dtype(op, "cu_q_lens", batch.cu_q_lens, {DType::i32});
    check_shape(op, "cu_q_lens", batch.cu_q_lens, {n_seqs + 1});
    const int32_t* cu = batch.cu_q_lens.as<int32_t>();
    if (cu[0] != 0 || cu[n_seqs] != n_tokens)
        fail("{}: cu_q_lens must run from 0 to the {} query tokens, got {}..{}", op, n_tokens, cu[0], cu[n_seqs]);
    for (int64_t s = 0; s < n_seqs; ++s)
        if (cu[s + 1] < cu[s]) fail("{}: cu_q_lens decreases at sequence {} ({} -> {})", op, s, cu[s], cu[s + 1]);
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
    check_batch(op, batch, T, page_size);

    const int64_t group = n_q / n_kv;
    const int32_t* kv_lens = batch.kv_lens.as<int32_t>();
    const int32_t* positions = batch.positions.as<int32_t>();
    const int32_t* page_table = batch.page_table.as<int32_t>();
    const int32_t* cu_q_lens = batch.cu_q_lens.as<int32_t>();
    const float* q_data = q.as<float>();
    const float* sink_data = has_sinks ? sinks.as<float>() : nullptr;
    float* out_data = out.as<float>();
    const float scale = params.softmax_scale;
    const CacheView k_view(k_cache, batch.page_stride), v_view(v_cache, batch.page_stride);
    ParallelError error;

    // Work items: (query tile, KV head); a tile is up to kQueryTile consecutive tokens of one sequence.
    struct QueryTile {
        int64_t first, count, seq;
    };
    std::vector<QueryTile> tiles;
    for (int64_t s = 0; s < batch.n_seqs; ++s)
        for (int64_t t = cu_q_lens[s]; t < cu_q_lens[s + 1]; t += kQueryTile)
            tiles.push_back({t, std::min<int64_t>(kQueryTile, cu_q_lens[s + 1] - t), s});
    const int64_t n_tiles = int64_t(tiles.size());
    // The chunk of keys starting at key j: up to the next multiple of kKeyChunk within its page, and
    // at most to `last`.
    const auto chunk_keys = [&](int64_t j, int64_t last) {
        const int64_t offset = j % page_size;
        return std::min({kKeyChunk - offset % kKeyChunk, page_size - offset, last - j + 1});
    };

#pragma omp parallel
    {
        std::vector<float> k_scratch, v_scratch;
        std::vector<float> scores(size_t(group * kKeyChunk));
        // Per row (token u of the tile, head h): row u·group + h.
        std::vector<float> acc(size_t(kQueryTile * group * dv)), running_max(size_t(kQueryTile * group)),
            denom(size_t(kQueryTile * group));
        int64_t lo[kQueryTile], hi[kQueryTile];

#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t i = 0; i < n_tiles; ++i) {
            for (int64_t g = 0; g < n_kv; ++g) {
                if (error.failed()) continue;
                const QueryTile tile = tiles[size_t(i)];
                const int64_t s = tile.seq, kv_len = kv_lens[s];
                // Each token's allowed keys form one contiguous range [lo, hi]; the tile walks their union.
                int64_t union_lo = std::numeric_limits<int64_t>::max(), union_hi = -1;
                for (int64_t u = 0; u < tile.count; ++u) {
                    const int64_t p = positions[tile.first + u];
                    lo[u] = 0;
                    hi[u] = kv_len - 1;
                    if (params.causal) hi[u] = std::min(hi[u], p);
                    if (params.window > 0) {
                        lo[u] = std::max<int64_t>(0, p - params.window + 1);
                        if (!params.causal) hi[u] = std::min<int64_t>(hi[u], p + params.window - 1);
                    }
                    if (lo[u] <= hi[u]) {
                        union_lo = std::min(union_lo, lo[u]);
                        union_hi = std::max(union_hi, hi[u]);
                    }
                    for (int64_t h = 0; h < group; ++h) {
                        const size_t row = size_t(u * group + h);
                        running_max[row] =
                            has_sinks ? sink_data[g * group + h] : -std::numeric_limits<float>::infinity();
                        denom[row] = has_sinks ? 1.f : 0.f;  // the sink's own exp(sink - m), m = sink
                    }
                }
                std::fill(acc.begin(), acc.begin() + tile.count * group * dv, 0.f);

                for (int64_t j0 = union_lo; j0 <= union_hi;) {
                    const int64_t n_keys = chunk_keys(j0, union_hi), j1 = j0 + n_keys - 1;
                    bool needed = false;  // by some token of the tile (tokens need not be adjacent)
                    for (int64_t u = 0; u < tile.count && !needed; ++u) needed = lo[u] <= j1 && hi[u] >= j0;
                    if (!needed) {
                        j0 += n_keys;
                        continue;
                    }
                    const int64_t logical_page = j0 / page_size, offset = j0 % page_size;
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
                    if (const int64_t next = j1 + 1; next <= union_hi) {
                        const int32_t next_page = page_table[s * batch.max_pages_per_seq + next / page_size];
                        if (next_page >= 0 && next_page < n_pages) {
                            const int64_t next_keys = chunk_keys(next, union_hi);
                            prefetch_rows(k_view, next_page, next % page_size, g, next_keys);
                            prefetch_rows(v_view, next_page, next % page_size, g, next_keys);
                        }
                    }
                    // Slots offset.. of kv head g of the page, shared by the tile's tokens.
                    const auto [keys, key_stride] = cache_rows_f32(k_view, page, offset, g, n_keys, k_scratch);
                    const auto [values, value_stride] = cache_rows_f32(v_view, page, offset, g, n_keys, v_scratch);

                    for (int64_t u = 0; u < tile.count; ++u) {
                        // This token's keys of the chunk: the same keys, in the same order, as in any
                        // other tile, so its sums do not depend on the batch.
                        const int64_t a = std::max(lo[u], j0), b = std::min(hi[u], j1);
                        if (a > b) continue;
                        const int64_t m = b - a + 1, t = tile.first + u;
                        const float* k_rows = keys + (a - j0) * key_stride;
                        const float* v_rows = values + (a - j0) * value_stride;
                        for (int64_t h = 0; h < group; ++h) {
                            const size_t row = size_t(u * group + h);
                            const float* qh = q_data + (t * n_q + g * group + h) * dk;
                            float* sh = scores.data() + h * kKeyChunk;
                            float chunk_max = running_max[row];
                            for (int64_t j = 0; j < m; ++j) {
                                sh[j] = scale * simd::dot<simd::WeightF32>(qh, k_rows + j * key_stride, dk);
                                chunk_max = std::max(chunk_max, sh[j]);
                            }
                            // Rescale what was accumulated under the old max, then add this chunk.
                            const float correction = std::exp(running_max[row] - chunk_max);
                            running_max[row] = chunk_max;
                            float* acc_h = acc.data() + row * dv;
                            const float chunk_sum = exp_shifted_sum(sh, m, chunk_max);
                            denom[row] = denom[row] * correction + chunk_sum;
                            if (correction != 1.f) {
#pragma omp simd
                                for (int64_t d = 0; d < dv; ++d) acc_h[d] *= correction;
                            }
                            simd::axpy_rows(sh, v_rows, value_stride, m, acc_h, dv);
                        }
                    }
                    j0 += n_keys;
                }

                for (int64_t u = 0; u < tile.count; ++u)
                    for (int64_t h = 0; h < group; ++h) {
                        const size_t row = size_t(u * group + h);
                        float* dst = out_data + ((tile.first + u) * n_q + g * group + h) * dv;
                        const float inv = denom[row] > 0.f ? 1.f / denom[row] : 0.f;
                        const float* acc_h = acc.data() + row * dv;
#pragma omp simd
                        for (int64_t d = 0; d < dv; ++d) dst[d] = acc_h[d] * inv;
                    }
            }
        }
    }
    error.rethrow();
}

}  // namespace xinfer::cpu
