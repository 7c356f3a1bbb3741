// Op cases of the paged KV cache: KV_STORE and ATTENTION over caches of every layout (own
// tensors or a pool of several layers; bf16/f32/f16/fp8). See op_cases.h.
#include "backend/op_case_builders.h"

#include "backend/cpu/kv_fp8.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

namespace xinfer::op_cases {
namespace {

// Quantizes x[d] into an fp8 cache's raw bytes: values at value_byte, the scale at scale_byte.
void put_fp8_row(std::vector<uint8_t>& raw, int64_t value_byte, int64_t scale_byte, const float* x, int64_t d) {
    const float scale = cpu::kv_fp8_quantize_row(x, d, raw.data() + value_byte);
    std::memcpy(raw.data() + scale_byte, &scale, sizeof scale);
}

// Adds the cache tensors (k_cache at src(k_slot), v_cache at src(k_slot + 1)), every element
// initialised to `fill` (fp8: every byte 0xff, NaN values and NaN scales, when fill is NaN, else
// 0); returns the indices of the tensors holding K and V values (the pool twice when pooled).
std::pair<size_t, size_t> add_caches(CaseData& d, const CacheGeometry& g, int k_slot, Access access, float fill) {
    auto cache = [&](std::string name, Slot slot, std::vector<int64_t> shape, int64_t elements) {
        CaseTensor t = make_tensor(std::move(name), slot, access, !g.dtype, g.dtype.value_or(DType::f32), std::move(shape));
        if (access == Access::inout) t.compare = Compare::exact;
        if (g.fp8()) {
            t.raw.assign(size_t(elements), std::isnan(fill) ? uint8_t(0xff) : uint8_t(0));
        } else if (t.numel() > kMaxHostValues) {
            t.bulk_random = 1.f;  // perf shapes: random on the device, no sentinels
        } else {
            t.values.assign(size_t(t.numel()), fill);
        }
        return t;
    };
    if (!g.pool_layers) {
        CaseTensor k = cache("k_cache", src(k_slot), {g.n_pages, g.page_size, g.n_kv, g.dk}, g.n_pages * g.k_page_elements());
        CaseTensor v = cache("v_cache", src(k_slot + 1), {g.n_pages, g.page_size, g.n_kv, g.dv}, g.n_pages * g.v_page_elements());
        d.tensors.push_back(std::move(k));
        d.tensors.push_back(std::move(v));
        return {d.tensors.size() - 2, d.tensors.size() - 1};
    }
    d.tensors.push_back(cache("kv_pool", Slot{}, {g.n_pages, g.page_stride()}, g.n_pages * g.page_stride()));
    const size_t pool_index = d.tensors.size() - 1;
    for (int which = 0; which < 2; ++which) {
        CaseTensor view = cache(which ? "v_cache" : "k_cache", src(k_slot + which),
                                {g.n_pages, g.page_size, g.n_kv, which ? g.dv : g.dk}, 0);
        view.access = Access::input;
        view.compare = Compare::none;
        view.values.clear();
        view.raw.clear();
        view.bulk_random = 0.f;
        view.view_of = int(pool_index);
        view.view_offset = which ? g.v_offset() : g.k_offset();
        d.tensors.push_back(std::move(view));
    }
    d.op.batch.page_stride = g.page_stride();
    return {pool_index, pool_index};
}


std::string range_text(const std::vector<int>& v) {
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    return *lo == *hi ? std::to_string(*lo) : fmt::format("{}..{}", *lo, *hi);
}

}  // namespace

// The fused prologue against its four ops. Caches compare within the rope tolerance: the reference
// rotates in f32 and rounds once into the cache, a device may differ in the last bit of the f32
// rotation (as ROPE may). No fp8-cache case: the reference's f32 rotation and the device's bf16
// one quantize to different bytes, and fp8 stores are KV_STORE's, which its own cases check.
OpCase rope_kv_store_case(const RopeKvStoreSpec& s) {
    const CacheGeometry& g = s.cache;
    return make_case(XINFER_OP_ROPE_KV_STORE,
                     fmt::format("rope_kv_store(T={}, q_heads={}, kv_heads={}, d={}/{}, rotary={}, value_scale={:g}, {})",
                                 s.T, s.n_q, g.n_kv, g.dk, g.dv, s.rotary_dim, s.value_scale, g.describe()),
                     kElementwise, [s] {
                         std::mt19937 rng(s.seed);
                         const CacheGeometry& g = s.cache;
                         XINFER_CHECK(!g.fp8(), "rope_kv_store_case: fp8 caches are KV_STORE's cases");
                         CaseData d = start(XINFER_OP_ROPE_KV_STORE);
                         d.op.params.rope_kv_store.rotary_dim = s.rotary_dim;
                         d.op.params.rope_kv_store.theta = s.theta;
                         d.op.params.rope_kv_store.value_scale = s.value_scale;
                         d.tensors.push_back(act_inout("k", src(0), {s.T, g.n_kv, g.dk}, rng));
                         d.tensors.push_back(act_inout("v", src(1), {s.T, g.n_kv, g.dv}, rng));
                         const auto [k_index, v_index] = add_caches(d, g, 2, Access::inout, 0.f);
                         for (size_t i : {k_index, v_index}) {
                             for (float& x : d.tensors[i].values) x = std::uniform_real_distribution<float>(-1, 1)(rng);
                             if (d.tensors[i].access == Access::inout) d.tensors[i].compare = Compare::nmse;
                         }
                         d.tensors.push_back(act_inout("q", src(4), {s.T, s.n_q, g.dk}, rng));
                         std::vector<int32_t> positions(size_t(s.T));
                         std::uniform_int_distribution<int32_t> position(0, 200000);
                         for (int32_t& p : positions) p = position(rng);
                         d.tensors.push_back(i32_input("positions", src(5), {s.T}, positions));
                         std::vector<int32_t> slots = distinct(g.n_pages * g.page_size, s.T, rng);
                         for (int64_t t = 0; t < s.T; t += 5) slots[size_t(t)] = -1;  // padding tokens: rotated, not stored
                         d.tensors.push_back(i32_input("slot_mapping", {Slot::slot_mapping}, {s.T}, slots));
                         d.op.batch.page_size = int32_t(g.page_size);
                         return d;
                     });
}

// Keys [lo, hi] query position p of a sequence with kv_len keys may see (the CPU's rule).
std::pair<int64_t, int64_t> visible_keys(int64_t p, int64_t kv_len, int window, bool causal) {
    int64_t lo = 0, hi = kv_len - 1;
    if (causal) hi = std::min(hi, p);
    if (window > 0) {
        lo = std::max<int64_t>(0, p - window + 1);
        if (!causal) hi = std::min<int64_t>(hi, p + window - 1);
    }
    return {lo, hi};
}

OpCase kv_store_case(const KvStoreSpec& s) {
    return make_case(XINFER_OP_KV_STORE,
                     fmt::format("kv_store(T={}, kv_heads={}, d={}/{}, pages={}, {}, skipped slots)", s.T, s.cache.n_kv,
                                 s.cache.dk, s.cache.dv, s.cache.n_pages, s.cache.describe()),
                     kExact, [s] {
                         std::mt19937 rng(s.seed);
                         const CacheGeometry& g = s.cache;
                         CaseData d = start(XINFER_OP_KV_STORE);
                         d.tensors.push_back(act_input("k", src(0), {s.T, g.n_kv, g.dk}, rng));
                         d.tensors.push_back(act_input("v", src(1), {s.T, g.n_kv, g.dv}, rng));
                         if (g.fp8()) {
                             // Rows of very different magnitudes (each gets its own scale), and an
                             // all-zero row (scale 1 by the rule).
                             std::uniform_real_distribution<float> exponent(-8.f, 8.f);
                             for (size_t i : {size_t(0), size_t(1)}) {
                                 CaseTensor& x = d.tensors[i];
                                 const int64_t row = i == 0 ? g.dk : g.dv;
                                 for (int64_t r = 0; r < x.numel() / row; ++r) {
                                     const float factor = r == g.n_kv ? 0.f : std::exp2(exponent(rng));  // token 1, head 0
                                     for (int64_t e = 0; e < row; ++e) x.values[size_t(r * row + e)] *= factor;
                                 }
                             }
                         }
                         const auto [k_index, v_index] = add_caches(d, g, 2, Access::inout, 0.f);
                         // Old contents: random, so that untouched slots are checked too.
                         for (size_t i : {k_index, v_index}) {
                             for (float& x : d.tensors[i].values) x = std::uniform_real_distribution<float>(-1, 1)(rng);
                             for (uint8_t& b : d.tensors[i].raw) b = uint8_t(rng());
                         }
                         std::vector<int32_t> slots = distinct(g.n_pages * g.page_size, s.T, rng);
                         for (int64_t t = 0; t < s.T; t += 5) slots[size_t(t)] = -1;  // padding tokens
                         d.tensors.push_back(i32_input("slot_mapping", {Slot::slot_mapping}, {s.T}, slots));
                         d.op.batch.page_size = int32_t(g.page_size);
                         return d;
                     });
}

OpCase attention_case(const AttentionSpec& s) {
    const int T = std::accumulate(s.q_lens.begin(), s.q_lens.end(), 0);
    std::string mode = s.causal ? "causal" : "non-causal";
    mode += s.window ? fmt::format(", window={}", s.window) : std::string(s.causal ? ", full" : "");
    if (s.sinks) mode += ", sinks";
    const CacheGeometry geometry{.page_size = s.page_size, .n_kv = s.n_kv, .dk = s.dk, .dv = s.dv,
                                 .pool_layers = s.pool_layers, .layer = s.layer, .pad = s.pad, .dtype = s.cache_dtype};
    std::string description =
        fmt::format("attention({}: seqs={}, T={}, q={}, kv={}, heads={}/{} (GQA {}), d={}/{}, {}, {})", s.label,
                    s.q_lens.size(), T, range_text(s.q_lens), range_text(s.kv_lens), s.n_q, s.n_kv, s.n_q / s.n_kv,
                    s.dk, s.dv, mode, geometry.describe());
    return make_case(XINFER_OP_ATTENTION, std::move(description), kAttention, [s, T] {
        std::mt19937 rng(s.seed);
        const int64_t n_seqs = int64_t(s.q_lens.size()), ps = s.page_size;
        CaseData d = start(XINFER_OP_ATTENTION);
        xinfer_attention_params& p = d.op.params.attention;
        p.n_q_heads = s.n_q;
        p.n_kv_heads = s.n_kv;
        p.head_dim_k = s.dk;
        p.head_dim_v = s.dv;
        p.softmax_scale = 1.f / std::sqrt(float(s.dk));
        p.window = s.window;
        p.causal = s.causal ? 1 : 0;
        p.k_scale = p.v_scale = 1.f;

        // Metadata: queries of sequence i are positions kv_len - q_len .. kv_len - 1.
        std::vector<int32_t> cu_q_lens{0}, positions;
        int64_t max_pages = 0;
        for (int64_t i = 0; i < n_seqs; ++i) {
            cu_q_lens.push_back(cu_q_lens.back() + s.q_lens[size_t(i)]);
            for (int q = 0; q < s.q_lens[size_t(i)]; ++q) positions.push_back(s.kv_lens[size_t(i)] - s.q_lens[size_t(i)] + q);
            max_pages = std::max<int64_t>(max_pages, (s.kv_lens[size_t(i)] + ps - 1) / ps);
        }
        max_pages += 1;  // trailing -1 entries, as in a table sized for longer sequences

        // Resident logical pages: all that hold keys, except (with a window) pages wholly before
        // every query's window, which a sliding manager has released (-1 in the table).
        std::vector<std::pair<int64_t, int64_t>> resident;  // (sequence, logical page)
        for (int64_t i = 0; i < n_seqs; ++i) {
            int64_t first_needed = s.kv_lens[size_t(i)];
            for (int32_t t = cu_q_lens[size_t(i)]; t < cu_q_lens[size_t(i) + 1]; ++t)
                first_needed = std::min(first_needed,
                                        visible_keys(positions[size_t(t)], s.kv_lens[size_t(i)], s.window, s.causal).first);
            for (int64_t page = 0; page * ps < s.kv_lens[size_t(i)]; ++page)
                if (s.window == 0 || (page + 1) * ps > first_needed) resident.emplace_back(i, page);
        }
        // A shuffled pool with a few free pages nobody references.
        const CacheGeometry g{.n_pages = int64_t(resident.size()) + 3, .page_size = ps, .n_kv = s.n_kv, .dk = s.dk,
                              .dv = s.dv, .pool_layers = s.pool_layers, .layer = s.layer, .pad = s.pad,
                              .dtype = s.cache_dtype};
        std::vector<int32_t> physical(static_cast<size_t>(g.n_pages));
        std::iota(physical.begin(), physical.end(), 0);
        std::shuffle(physical.begin(), physical.end(), rng);
        std::vector<int32_t> page_table(size_t(n_seqs * max_pages), -1);
        for (size_t r = 0; r < resident.size(); ++r)
            page_table[size_t(resident[r].first * max_pages + resident[r].second)] = physical[r];

        d.tensors.push_back(act_input("q", src(0), {T, s.n_q, s.dk}, rng, -4.f, 4.f));
        // Every cache element starts as NaN: other layers of the pool, free pages and slots past
        // kv_len must never reach the output. Only keys that exist get values.
        const auto [k_index, v_index] = add_caches(d, g, 1, Access::input, kNaN);
        if (!g.fp8() && (d.tensors[k_index].values.empty() || d.tensors[v_index].values.empty())) {
            // perf shapes: the caches are filled on the device
        } else {
            std::vector<float>& k_values = d.tensors[k_index].values;
            std::vector<float>& v_values = d.tensors[v_index].values;
            std::uniform_real_distribution<float> value(-1.f, 1.f);
            for (size_t r = 0; g.fp8() && r < resident.size(); ++r) {
                // fp8: each (slot, head) row quantized with its own scale; magnitudes vary by
                // row (2^-3..2^3) so the scales matter.
                std::uniform_real_distribution<float> exponent(-3.f, 3.f);
                std::vector<float> row(size_t(std::max(s.dk, s.dv)));
                std::vector<uint8_t>& k_raw = d.tensors[k_index].raw;
                std::vector<uint8_t>& v_raw = d.tensors[v_index].raw;
                const auto [seq, page] = resident[r];
                for (int64_t slot = 0; slot < ps && page * ps + slot < s.kv_lens[size_t(seq)]; ++slot)
                    for (int64_t h = 0; h < s.n_kv; ++h) {
                        const float k_factor = std::exp2(exponent(rng)), v_factor = std::exp2(exponent(rng));
                        for (int64_t i = 0; i < s.dk; ++i) row[size_t(i)] = value(rng) * k_factor;
                        put_fp8_row(k_raw, g.k_index(physical[r], slot, h, 0), g.k_scale_byte(physical[r], slot, h),
                                    row.data(), s.dk);
                        for (int64_t i = 0; i < s.dv; ++i) row[size_t(i)] = value(rng) * v_factor;
                        put_fp8_row(v_raw, g.v_index(physical[r], slot, h, 0), g.v_scale_byte(physical[r], slot, h),
                                    row.data(), s.dv);
                    }
            }
            for (size_t r = 0; !g.fp8() && r < resident.size(); ++r) {
                const auto [seq, page] = resident[r];
                for (int64_t slot = 0; slot < ps && page * ps + slot < s.kv_lens[size_t(seq)]; ++slot)
                    for (int64_t h = 0; h < s.n_kv; ++h) {
                        for (int64_t i = 0; i < s.dk; ++i) k_values[size_t(g.k_index(physical[r], slot, h, i))] = value(rng);
                        for (int64_t i = 0; i < s.dv; ++i) v_values[size_t(g.v_index(physical[r], slot, h, i))] = value(rng);
                    }
            }
        }
        if (s.sinks) d.tensors.push_back(fixed_input("sinks", src(3), DType::f32, {s.n_q}, rng, -1.f, 3.f));
        d.tensors.push_back(act_output("out", dst(0), {T, s.n_q, s.dv}));

        d.op.batch.n_seqs = int32_t(n_seqs);
        d.op.batch.max_pages_per_seq = int32_t(max_pages);
        d.op.batch.page_size = int32_t(ps);
        d.tensors.push_back(i32_input("cu_q_lens", {Slot::cu_q_lens}, {n_seqs + 1}, cu_q_lens));
        d.tensors.push_back(i32_input("kv_lens", {Slot::kv_lens}, {n_seqs}, std::vector<int32_t>(s.kv_lens.begin(), s.kv_lens.end())));
        d.tensors.push_back(i32_input("positions", {Slot::positions}, {T}, positions));
        d.tensors.push_back(i32_input("page_table", {Slot::page_table}, {n_seqs, max_pages}, page_table));
        return d;
    });
}

}  // namespace xinfer::op_cases
