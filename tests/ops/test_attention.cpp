// kv_store and paged attention against a float64 reference.
//
// Every attention case builds a paged cache through a shuffled page table, fills only the keys
// some query may see, and leaves everything else NaN: unused slots at the end of a page, keys
// outside every query's window, whole pages that a sliding window released (those are also -1 in
// the page table), and physical pages nobody owns. A kernel that reads a key it must not see
// turns the output NaN and fails.
#include "op_test_util.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace xinfer::test {
namespace {

// f32 dot products and an f32 online softmax against float64, relative to max|out|.
constexpr double kAttentionTolerance = 1e-5;

struct SeqSpec {
    int kv_len;              // keys in the cache after this step
    int n_query;             // query tokens; by default the last n_query keys (positions kv_len - n_query + i)
    int position_shift = 0;  // added to every query position (queries with no visible keys)
};

struct AttentionCase {
    std::string name;
    int n_q, n_kv, dk, dv;
    bool causal;
    int window;
    bool sinks;
    int page_size;
    std::vector<SeqSpec> seqs;
    bool release_pages = false;  // pages no query can see become -1 in the page table
    DType cache_dtype = DType::f32;
};

struct Prepared {
    std::vector<float> q, k_cache, v_cache, sinks;  // host copies; caches hold rounded values or NaN
    std::vector<int32_t> cu_q_lens, kv_lens, positions, page_table, seq_of_token;
    int n_pages = 0, max_pages = 0, n_tokens = 0;
};

bool key_allowed(const AttentionCase& c, int64_t p, int64_t j, int64_t kv_len) {
    if (j < 0 || j >= kv_len) return false;
    if (c.causal) return j <= p && (c.window <= 0 || p - j < c.window);
    return c.window <= 0 || std::abs(p - j) < c.window;
}

Prepared prepare(const AttentionCase& c, uint32_t seed) {
    Prepared d;
    const int n_seqs = int(c.seqs.size());
    for (const SeqSpec& s : c.seqs) d.max_pages = std::max(d.max_pages, (s.kv_len + c.page_size - 1) / c.page_size);
    d.max_pages = std::max(d.max_pages, 1);
    int used_pages = 0;
    for (const SeqSpec& s : c.seqs) used_pages += (s.kv_len + c.page_size - 1) / c.page_size;
    d.n_pages = used_pages + 3;  // spare physical pages that stay NaN

    std::vector<int32_t> physical(size_t(d.n_pages));
    std::iota(physical.begin(), physical.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(physical.begin(), physical.end(), rng);

    const float nan = std::numeric_limits<float>::quiet_NaN();
    d.k_cache.assign(size_t(d.n_pages) * c.page_size * c.n_kv * c.dk, nan);
    d.v_cache.assign(size_t(d.n_pages) * c.page_size * c.n_kv * c.dv, nan);
    d.page_table.assign(size_t(n_seqs * d.max_pages), -1);
    d.cu_q_lens.push_back(0);
    int next_physical = 0;
    for (int s = 0; s < n_seqs; ++s) {
        const SeqSpec& spec = c.seqs[size_t(s)];
        d.kv_lens.push_back(spec.kv_len);
        std::vector<int32_t> seq_positions;
        for (int i = 0; i < spec.n_query; ++i)
            seq_positions.push_back(spec.kv_len - spec.n_query + i + spec.position_shift);
        const int seq_pages = (spec.kv_len + c.page_size - 1) / c.page_size;
        for (int lp = 0; lp < seq_pages; ++lp) {
            bool page_visible = false;
            for (int j = lp * c.page_size; j < std::min(spec.kv_len, (lp + 1) * c.page_size); ++j)
                for (int32_t p : seq_positions) page_visible |= key_allowed(c, p, j, spec.kv_len);
            const int32_t page = physical[size_t(next_physical++)];
            if (c.release_pages && !page_visible) continue;  // released: -1, contents NaN
            d.page_table[size_t(s * d.max_pages + lp)] = page;
            for (int j = lp * c.page_size; j < std::min(spec.kv_len, (lp + 1) * c.page_size); ++j) {
                bool visible = false;
                for (int32_t p : seq_positions) visible |= key_allowed(c, p, j, spec.kv_len);
                if (!visible) continue;  // stays NaN
                const size_t row = size_t(page) * c.page_size + size_t(j % c.page_size);
                const auto k = random_vector(size_t(c.n_kv * c.dk), seed + 1000 + uint32_t(s * 7919 + j));
                const auto v = random_vector(size_t(c.n_kv * c.dv), seed + 2000 + uint32_t(s * 7919 + j));
                std::copy(k.begin(), k.end(), d.k_cache.begin() + row * c.n_kv * c.dk);
                std::copy(v.begin(), v.end(), d.v_cache.begin() + row * c.n_kv * c.dv);
            }
        }
        for (int32_t p : seq_positions) {
            d.positions.push_back(p);
            d.seq_of_token.push_back(s);
        }
        d.cu_q_lens.push_back(d.cu_q_lens.back() + spec.n_query);
    }
    d.n_tokens = d.cu_q_lens.back();
    d.k_cache = rounded(d.k_cache, c.cache_dtype);
    d.v_cache = rounded(d.v_cache, c.cache_dtype);
    // Queries scaled up so the softmax is far from uniform.
    d.q = random_vector(size_t(d.n_tokens) * c.n_q * c.dk, seed + 3, -2.f, 2.f);
    if (c.sinks) d.sinks = random_vector(size_t(c.n_q), seed + 4, -1.f, 3.f);
    return d;
}

std::vector<double> reference_attention(const AttentionCase& c, const Prepared& d, float softmax_scale) {
    std::vector<double> out(size_t(d.n_tokens) * c.n_q * c.dv, 0.0);
    const int group = c.n_q / c.n_kv;
    for (int t = 0; t < d.n_tokens; ++t) {
        const int s = d.seq_of_token[size_t(t)], kv_len = d.kv_lens[size_t(s)];
        const int64_t p = d.positions[size_t(t)];
        for (int h = 0; h < c.n_q; ++h) {
            const int g = h / group;
            std::vector<double> scores;
            std::vector<size_t> rows;
            for (int j = 0; j < kv_len; ++j) {
                if (!key_allowed(c, p, j, kv_len)) continue;
                const int32_t page = d.page_table[size_t(s * d.max_pages + j / c.page_size)];
                const size_t row = (size_t(page) * c.page_size + size_t(j % c.page_size)) * c.n_kv + size_t(g);
                double dot = 0.0;
                for (int i = 0; i < c.dk; ++i)
                    dot += double(d.q[(size_t(t) * c.n_q + h) * c.dk + i]) * d.k_cache[row * c.dk + i];
                scores.push_back(softmax_scale * dot);
                rows.push_back(row);
            }
            if (scores.empty()) continue;  // no visible key: zeros
            double m = *std::max_element(scores.begin(), scores.end());
            if (c.sinks) m = std::max(m, double(d.sinks[size_t(h)]));
            double denom = c.sinks ? std::exp(d.sinks[size_t(h)] - m) : 0.0;
            for (double sc : scores) denom += std::exp(sc - m);
            for (size_t j = 0; j < scores.size(); ++j) {
                const double weight = std::exp(scores[j] - m) / denom;
                for (int i = 0; i < c.dv; ++i)
                    out[(size_t(t) * c.n_q + h) * c.dv + i] += weight * d.v_cache[rows[j] * c.dv + i];
            }
        }
    }
    return out;
}

struct DeviceBatch {
    DeviceTensor cu_q_lens, kv_lens, positions, page_table, slot_mapping;
    AttentionBatch batch;
};

DeviceBatch upload_batch(const Prepared& d, int n_seqs) {
    DeviceBatch b;
    b.cu_q_lens = device_from_i32(d.cu_q_lens, {n_seqs + 1});
    b.kv_lens = device_from_i32(d.kv_lens, {n_seqs});
    b.positions = device_from_i32(d.positions, {d.n_tokens});
    b.page_table = device_from_i32(d.page_table, {n_seqs, d.max_pages});
    b.batch = AttentionBatch{n_seqs, d.max_pages, b.cu_q_lens, b.kv_lens, b.positions, b.page_table, Tensor()};
    return b;
}

void run_case(const AttentionCase& c, uint32_t seed) {
    const Prepared d = prepare(c, seed);
    if (c.release_pages) {
        // The case must really hand the kernel -1 entries below kv_len, or it tests nothing.
        int released = 0;
        for (size_t s = 0; s < c.seqs.size(); ++s)
            for (int lp = 0; lp < (c.seqs[s].kv_len + c.page_size - 1) / c.page_size; ++lp)
                released += d.page_table[s * size_t(d.max_pages) + size_t(lp)] < 0;
        EXPECT_GT(released, 0) << c.name;
    }
    const float softmax_scale = 1.f / std::sqrt(float(c.dk));
    DeviceBatch b = upload_batch(d, int(c.seqs.size()));
    DeviceTensor q = device_from(d.q, DType::f32, {d.n_tokens, c.n_q, c.dk});
    DeviceTensor k_cache = device_from(d.k_cache, c.cache_dtype, {d.n_pages, c.page_size, c.n_kv, c.dk});
    DeviceTensor v_cache = device_from(d.v_cache, c.cache_dtype, {d.n_pages, c.page_size, c.n_kv, c.dv});
    DeviceTensor sinks = c.sinks ? device_from(d.sinks, DType::f32, {c.n_q}) : DeviceTensor{};
    DeviceTensor out = device_poisoned({d.n_tokens, c.n_q, c.dv});
    AttentionParams params{c.n_q, c.n_kv, c.dk, c.dv, softmax_scale, c.window, c.causal, c.page_size};
    cpu_backend().attention(q, k_cache, v_cache, sinks.tensor, b.batch, params, out);
    EXPECT_CLOSE(to_host(out), reference_attention(c, d, softmax_scale), kAttentionTolerance, c.name);
}

TEST(Attention, MatchesFloat64ReferenceAcrossVariants) {
    const std::vector<AttentionCase> cases = {
        {"decode causal full, GQA 1", 4, 4, 24, 16, true, 0, false, 16, {{37, 1}, {5, 1}, {64, 1}, {1, 1}}},
        {"chunks causal full, GQA 2, sinks", 4, 2, 24, 16, true, 0, true, 16, {{50, 7}, {33, 32}, {16, 16}}},
        {"MiMo full layer: GQA 8, 192/128", 16, 2, 192, 128, true, 0, false, 16, {{70, 1}, {45, 5}, {130, 32}}},
        {"sliding 8, GQA 2, sinks, released pages",
         4,
         2,
         24,
         16,
         true,
         8,
         true,
         16,
         {{100, 1}, {90, 12}, {40, 32}, {3, 3}},
         true},
        {"sliding 8 without sinks, odd page size 5", 2, 1, 24, 16, true, 8, false, 5, {{61, 1}, {44, 9}}, true},
        {"MiMo sliding layer: window 128, GQA 8, sinks",
         16,
         2,
         192,
         128,
         true,
         128,
         true,
         16,
         {{300, 3}, {200, 1}, {150, 20}},
         true},
        {"non-causal symmetric window 4", 2, 2, 24, 16, false, 4, false, 16, {{20, 20}, {30, 8}, {20, 2, 50}}},
        {"non-causal full, GQA 2, sinks, page size 7", 4, 2, 24, 16, false, 0, true, 7, {{10, 4}, {17, 17}}},
        {"no visible keys -> zeros", 2, 1, 24, 16, true, 0, true, 16, {{0, 1, 1}, {5, 1}}},
        {"bf16 cache, sliding, GQA 8", 8, 1, 192, 128, true, 16, true, 16, {{80, 4}, {33, 1}}, true, DType::bf16},
        {"f16 cache, full", 4, 2, 24, 16, true, 0, false, 16, {{29, 3}}, false, DType::f16},
    };
    uint32_t seed = 7;
    for (const AttentionCase& c : cases) run_case(c, seed += 101);
}

// A token's output does not depend on the batch around it (the CPU walks tiles of several query
// tokens, each token seeing the same keys in the same chunks in any tile; batched = alone and
// speculative verification rely on it): every token of a batch, run alone, gives the same bits.
TEST(Attention, EachTokenEqualsItselfRunAlone) {
    const std::vector<AttentionCase> cases = {
        {"sliding 8, sinks, odd page size 5", 4, 2, 24, 16, true, 8, true, 5, {{61, 19}, {44, 9}}, true},
        {"full causal, sinks, 40-token chunk", 4, 2, 24, 16, true, 0, true, 16, {{90, 40}, {17, 3}}},
        {"non-causal window 6, page size 7", 2, 1, 24, 16, false, 6, false, 7, {{30, 11}}},
        {"bf16 cache, sliding 16, GQA 8", 8, 1, 192, 128, true, 16, true, 16, {{80, 12}}, true, DType::bf16},
        // Pages longer than a key chunk: chunks must follow one grid inside the page.
        {"sliding 40, sinks, page size 64", 4, 2, 24, 16, true, 40, true, 64, {{150, 21}, {70, 10}}, true},
        {"full causal, page size 128", 4, 4, 24, 16, true, 0, false, 128, {{200, 17}}},
    };
    uint32_t seed = 11;
    for (const AttentionCase& c : cases) {
        const Prepared d = prepare(c, seed += 101);
        const AttentionParams params{c.n_q, c.n_kv, c.dk, c.dv, 0.25f, c.window, c.causal, c.page_size};
        DeviceTensor k_cache = device_from(d.k_cache, c.cache_dtype, {d.n_pages, c.page_size, c.n_kv, c.dk});
        DeviceTensor v_cache = device_from(d.v_cache, c.cache_dtype, {d.n_pages, c.page_size, c.n_kv, c.dv});
        DeviceTensor sinks = c.sinks ? device_from(d.sinks, DType::f32, {c.n_q}) : DeviceTensor{};
        const auto run = [&](const Prepared& batch, const std::vector<float>& q, int n_seqs) {
            DeviceBatch b = upload_batch(batch, n_seqs);
            DeviceTensor dq = device_from(q, DType::f32, {batch.n_tokens, c.n_q, c.dk});
            DeviceTensor out = device_poisoned({batch.n_tokens, c.n_q, c.dv});
            cpu_backend().attention(dq, k_cache, v_cache, sinks.tensor, b.batch, params, out);
            return to_host(out);
        };
        const std::vector<float> together = run(d, d.q, int(c.seqs.size()));
        const size_t row = size_t(c.n_q * c.dv);
        for (int t = 0; t < d.n_tokens; ++t) {
            const int s = d.seq_of_token[size_t(t)];
            Prepared alone = d;
            alone.cu_q_lens = {0, 1};
            alone.kv_lens = {d.kv_lens[size_t(s)]};
            alone.positions = {d.positions[size_t(t)]};
            alone.page_table.assign(d.page_table.begin() + s * d.max_pages, d.page_table.begin() + (s + 1) * d.max_pages);
            alone.n_tokens = 1;
            const size_t q_row = size_t(c.n_q * c.dk);
            const std::vector<float> q(d.q.begin() + long(t * q_row), d.q.begin() + long((t + 1) * q_row));
            const std::vector<float> got = run(alone, q, 1);
            ASSERT_TRUE(std::equal(got.begin(), got.end(), together.begin() + long(t * row)))
                << c.name << ": token " << t << " (sequence " << s << ", position " << d.positions[size_t(t)]
                << ") differs alone";
        }
    }
}

TEST(Attention, ReportsAReleasedPageInsideTheWindow) {
    AttentionCase c{"", 2, 1, 24, 16, true, 0, false, 16, {{40, 1}}};
    Prepared d = prepare(c, 3);
    d.page_table[1] = -1;  // keys 16..31 are needed by a full-attention query at position 39
    DeviceBatch b = upload_batch(d, 1);
    DeviceTensor q = device_from(d.q, DType::f32, {1, 2, 24});
    DeviceTensor k_cache = device_from(d.k_cache, DType::f32, {d.n_pages, 16, 1, 24});
    DeviceTensor v_cache = device_from(d.v_cache, DType::f32, {d.n_pages, 16, 1, 16});
    DeviceTensor out = device_poisoned({1, 2, 16});
    AttentionParams params{2, 1, 24, 16, 0.2f, 0, true, 16};
    expect_error([&] { cpu_backend().attention(q, k_cache, v_cache, Tensor(), b.batch, params, out); },
                 {"attention", "sequence 0", "logical page 1", "-1"});
}

TEST(Attention, RejectsMismatchedHeadDims) {
    DeviceTensor q = device_poisoned({1, 2, 24});
    DeviceTensor k_cache = device_poisoned({2, 16, 1, 24});
    DeviceTensor v_cache = device_poisoned({2, 16, 1, 16});
    DeviceTensor out = device_poisoned({1, 2, 24});  // should be dv = 16
    Prepared d = prepare(AttentionCase{"", 2, 1, 24, 16, true, 0, false, 16, {{5, 1}}}, 1);
    DeviceBatch b = upload_batch(d, 1);
    AttentionParams params{2, 1, 24, 16, 0.2f, 0, true, 16};
    expect_error([&] { cpu_backend().attention(q, k_cache, v_cache, Tensor(), b.batch, params, out); },
                 {"attention", "out", "[1, 2, 24]", "[1, 2, 16]"});
}

TEST(KvStore, WritesEachTokenIntoItsSlotAndSkipsMinusOne) {
    const int n_pages = 4, page_size = 4, n_kv = 2, dk = 24, dv = 16, T = 7;
    const std::vector<int32_t> slots = {5, -1, 0, 15, 9, -1, 10};
    for (DType dtype : {DType::f32, DType::bf16}) {
        const auto k = random_vector(size_t(T * n_kv * dk), 1), v = random_vector(size_t(T * n_kv * dv), 2);
        const auto k_old = rounded(random_vector(size_t(n_pages * page_size * n_kv * dk), 3), dtype);
        const auto v_old = rounded(random_vector(size_t(n_pages * page_size * n_kv * dv), 4), dtype);
        DeviceTensor dk_ = device_from(k, DType::f32, {T, n_kv, dk});
        DeviceTensor dv_ = device_from(v, DType::f32, {T, n_kv, dv});
        DeviceTensor k_cache = device_from(k_old, dtype, {n_pages, page_size, n_kv, dk});
        DeviceTensor v_cache = device_from(v_old, dtype, {n_pages, page_size, n_kv, dv});
        DeviceTensor slot_mapping = device_from_i32(slots, {T});
        AttentionBatch batch;
        batch.slot_mapping = slot_mapping;
        cpu_backend().kv_store(dk_, dv_, k_cache, v_cache, batch);

        std::vector<double> k_want(k_old.begin(), k_old.end()), v_want(v_old.begin(), v_old.end());
        const auto k_new = rounded(k, dtype), v_new = rounded(v, dtype);
        for (int t = 0; t < T; ++t) {
            if (slots[size_t(t)] < 0) continue;
            // slot = page · page_size + offset is the flat row of [pages, page_size].
            for (int i = 0; i < n_kv * dk; ++i)
                k_want[size_t(slots[size_t(t)]) * n_kv * dk + i] = k_new[size_t(t) * n_kv * dk + i];
            for (int i = 0; i < n_kv * dv; ++i)
                v_want[size_t(slots[size_t(t)]) * n_kv * dv + i] = v_new[size_t(t) * n_kv * dv + i];
        }
        EXPECT_CLOSE(to_host(k_cache), k_want, 0.0, "k cache " << dtype_name(dtype));
        EXPECT_CLOSE(to_host(v_cache), v_want, 0.0, "v cache " << dtype_name(dtype));

        DeviceTensor bad_slots = device_from_i32({0, 0, 0, 0, 0, 0, 64}, {T});
        batch.slot_mapping = bad_slots;
        expect_error([&] { cpu_backend().kv_store(dk_, dv_, k_cache, v_cache, batch); },
                     {"kv_store", "slot_mapping[6] = 64"});
    }
}

// rope(q), rope(k), scale(v), kv_store(k, v) one by one; the fused op; and the fallback of a
// backend without it (unfused_cpu_api): bit-identical q, k, v and caches (f32 activations, as the
// CPU runs them; bf16 caches); one token with q, k, v adjacent in one projection row (the
// fallback's single rope launch) and three tokens in separate tensors (one of them a padding
// token, slot -1).
TEST(RopeKvStore, FusedOpAndFallbackEqualTheFourOps) {
    Backend unfused(unfused_cpu_api(), 0, "cpu-unfused");
    const int n_q = 4, n_kv = 2, dk = 24, dv = 16, n_pages = 3, page_size = 4;
    const RopeParams rope{16, 10000.f};
    const float value_scale = 0.707f;
    for (const int T : {1, 3}) {
        const std::vector<int32_t> slots = T == 1 ? std::vector<int32_t>{6} : std::vector<int32_t>{3, -1, 9};
        const std::vector<int32_t> positions = T == 1 ? std::vector<int32_t>{17} : std::vector<int32_t>{5, 0, 123456};
        const int64_t row = int64_t(n_q + n_kv) * dk + int64_t(n_kv) * dv;  // one token's [q | k | v]
        const auto qkv_values = random_vector(size_t(T * row), 11, -2.f, 2.f);
        const auto k_cache_old = random_vector(size_t(n_pages * page_size * n_kv * dk), 12);
        const auto v_cache_old = random_vector(size_t(n_pages * page_size * n_kv * dv), 13);
        struct Run {
            DeviceTensor qkv, k_cache, v_cache;
            Tensor q, k, v;
        };
        auto prepare = [&] {
            Run r{device_from(qkv_values, DType::f32, {T, row}), device_from(k_cache_old, DType::bf16, {n_pages, page_size, n_kv, dk}),
                  device_from(v_cache_old, DType::bf16, {n_pages, page_size, n_kv, dv}), {}, {}, {}};
            char* base = static_cast<char*>(r.qkv.tensor.data);
            if (T == 1) {  // adjacent slices of the one row
                r.q = Tensor(base, DType::f32, {1, n_q, dk});
                r.k = Tensor(base + size_t(n_q * dk) * 4, DType::f32, {1, n_kv, dk});
                r.v = Tensor(base + size_t((n_q + n_kv) * dk) * 4, DType::f32, {1, n_kv, dv});
            } else {  // the buffer split into three tensors, each [T, heads, d]
                r.q = Tensor(base, DType::f32, {T, n_q, dk});
                r.k = Tensor(base + size_t(T * n_q * dk) * 4, DType::f32, {T, n_kv, dk});
                r.v = Tensor(base + size_t(T * (n_q + n_kv) * dk) * 4, DType::f32, {T, n_kv, dv});
            }
            return r;
        };
        DeviceTensor pos = device_from_i32(positions, {T}), slot_mapping = device_from_i32(slots, {T});
        AttentionBatch batch;
        batch.slot_mapping = slot_mapping;

        Run want = prepare(), fused = prepare(), fallback = prepare();
        Backend& cpu = cpu_backend();
        cpu.rope(want.q, pos, rope);
        cpu.rope(want.k, pos, rope);
        cpu.scale(want.v, value_scale);
        cpu.kv_store(want.k, want.v, want.k_cache, want.v_cache, batch);
        cpu.rope_kv_store(fused.q, fused.k, fused.v, pos, rope, value_scale, fused.k_cache, fused.v_cache, batch);
        unfused.rope_kv_store(fallback.q, fallback.k, fallback.v, pos, rope, value_scale, fallback.k_cache,
                              fallback.v_cache, batch);
        for (const Run* got : {&fused, &fallback}) {
            const char* which = got == &fused ? "fused" : "fallback";
            EXPECT_EQ(to_host(got->qkv), to_host(want.qkv)) << which << ", T = " << T;
            EXPECT_EQ(to_host(got->k_cache), to_host(want.k_cache)) << which << ", T = " << T;
            EXPECT_EQ(to_host(got->v_cache), to_host(want.v_cache)) << which << ", T = " << T;
        }
        EXPECT_NE(to_host(want.qkv), qkv_values) << "the ops changed nothing, T = " << T;
    }
}

}  // namespace
}  // namespace xinfer::test
