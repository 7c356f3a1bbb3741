// KV_STORE and ATTENTION checks against a float64 reference, mirroring tests/ops/test_attention.cpp:
// caches are built through a shuffled page table, only keys some query may see are filled and
// everything else is NaN (unused slots, keys outside every window, released pages that are -1 in
// the page table, spare physical pages), so a kernel that reads a key it must not see fails.
#include "check_util.h"

#include <numeric>

namespace check {
namespace {

struct SeqSpec {
    int kv_len, n_query, position_shift = 0;
};

struct Case {
    std::string name;
    int n_q, n_kv, dk, dv;
    bool causal;
    int window;
    bool sinks;
    int page_size;
    std::vector<SeqSpec> seqs;
    bool release_pages = false;
    int cache_dtype = XINFER_DTYPE_BF16;
    int act_dtype = XINFER_DTYPE_BF16;  // q and out
    int64_t extra_page_stride = 0;      // > 0: pages this many elements further apart than packed
};

struct Prepared {
    std::vector<float> q, k_cache, v_cache, sinks;
    std::vector<int32_t> cu_q_lens, kv_lens, positions, page_table, seq_of_token;
    int n_pages = 0, max_pages = 0, n_tokens = 0;
    int64_t stride = 0;  // elements between pages (same for K and V)
};

bool key_allowed(const Case& c, int64_t p, int64_t j, int64_t kv_len) {
    if (j < 0 || j >= kv_len) return false;
    if (c.causal) return j <= p && (c.window <= 0 || p - j < c.window);
    return c.window <= 0 || std::abs(p - j) < c.window;
}

int64_t page_stride_of(const Case& c) {
    return c.extra_page_stride > 0
               ? int64_t(c.page_size) * c.n_kv * std::max(c.dk, c.dv) + c.extra_page_stride
               : 0;
}

Prepared prepare(const Case& c, uint32_t seed) {
    Prepared d;
    const int n_seqs = int(c.seqs.size());
    for (const SeqSpec& s : c.seqs) d.max_pages = std::max(d.max_pages, (s.kv_len + c.page_size - 1) / c.page_size);
    d.max_pages = std::max(d.max_pages, 1);
    int used = 0;
    for (const SeqSpec& s : c.seqs) used += (s.kv_len + c.page_size - 1) / c.page_size;
    d.n_pages = used + 3;
    std::vector<int32_t> physical(static_cast<size_t>(d.n_pages));
    std::iota(physical.begin(), physical.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(physical.begin(), physical.end(), rng);

    const int64_t ps = page_stride_of(c);
    d.stride = ps;
    const int64_t k_page = ps ? ps : int64_t(c.page_size) * c.n_kv * c.dk;
    const int64_t v_page = ps ? ps : int64_t(c.page_size) * c.n_kv * c.dv;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    d.k_cache.assign(size_t(d.n_pages * k_page), nan);
    d.v_cache.assign(size_t(d.n_pages * v_page), nan);
    d.page_table.assign(size_t(n_seqs * d.max_pages), -1);
    d.cu_q_lens.push_back(0);
    int next = 0;
    std::mt19937 fill_rng(seed + 99);
    std::uniform_real_distribution<float> unit(-1.f, 1.f);
    for (int s = 0; s < n_seqs; ++s) {
        const SeqSpec& spec = c.seqs[size_t(s)];
        d.kv_lens.push_back(spec.kv_len);
        std::vector<int32_t> pos;
        for (int i = 0; i < spec.n_query; ++i) pos.push_back(spec.kv_len - spec.n_query + i + spec.position_shift);
        const int seq_pages = (spec.kv_len + c.page_size - 1) / c.page_size;
        for (int lp = 0; lp < seq_pages; ++lp) {
            const int page = physical[size_t(next++)];
            // A query at p sees a contiguous key range, so page visibility is an interval test.
            bool page_visible = false;
            const int first = lp * c.page_size, last = std::min(spec.kv_len, (lp + 1) * c.page_size) - 1;
            for (int32_t p : pos) {
                int lo = 0, hi = spec.kv_len - 1;
                if (c.causal) hi = std::min(hi, p);
                if (c.window > 0) {
                    lo = std::max(0, p - c.window + 1);
                    if (!c.causal) hi = std::min(hi, p + c.window - 1);
                }
                page_visible |= lo <= hi && lo <= last && hi >= first;
            }
            if (c.release_pages && !page_visible) continue;
            d.page_table[size_t(s * d.max_pages + lp)] = page;
            for (int j = first; j <= last; ++j) {
                bool visible = false;
                for (int32_t p : pos) visible |= key_allowed(c, p, j, spec.kv_len);
                if (!visible) continue;
                const int64_t slot = j % c.page_size;
                for (int g = 0; g < c.n_kv; ++g) {
                    const int64_t krow = page * k_page + (slot * c.n_kv + g) * c.dk;
                    const int64_t vrow = page * v_page + (slot * c.n_kv + g) * c.dv;
                    for (int i = 0; i < c.dk; ++i) d.k_cache[size_t(krow + i)] = unit(fill_rng);
                    for (int i = 0; i < c.dv; ++i) d.v_cache[size_t(vrow + i)] = unit(fill_rng);
                }
            }
        }
        for (int32_t p : pos) {
            d.positions.push_back(p);
            d.seq_of_token.push_back(s);
        }
        d.cu_q_lens.push_back(d.cu_q_lens.back() + spec.n_query);
    }
    d.n_tokens = d.cu_q_lens.back();
    d.k_cache = rounded(d.k_cache, c.cache_dtype);
    d.v_cache = rounded(d.v_cache, c.cache_dtype);
    d.q = rounded(random_vector(size_t(d.n_tokens) * c.n_q * c.dk, seed + 3, -2.f, 2.f), c.act_dtype);
    if (c.sinks) d.sinks = random_vector(size_t(c.n_q), seed + 4, -1.f, 3.f);
    return d;
}

std::vector<double> reference(const Case& c, const Prepared& d, float scale) {
    std::vector<double> out(size_t(d.n_tokens) * c.n_q * c.dv, 0.0);
    const int group = c.n_q / c.n_kv;
    const int64_t k_page = d.stride ? d.stride : int64_t(c.page_size) * c.n_kv * c.dk;
    const int64_t v_page = d.stride ? d.stride : int64_t(c.page_size) * c.n_kv * c.dv;
    std::vector<double> scores;
    std::vector<int64_t> vrows;
    for (int t = 0; t < d.n_tokens; ++t) {
        const int s = d.seq_of_token[size_t(t)], kv_len = d.kv_lens[size_t(s)];
        const int64_t p = d.positions[size_t(t)];
        int64_t lo = 0, hi = kv_len - 1;
        if (c.causal) hi = std::min<int64_t>(hi, p);
        if (c.window > 0) {
            lo = std::max<int64_t>(0, p - c.window + 1);
            if (!c.causal) hi = std::min<int64_t>(hi, p + c.window - 1);
        }
        for (int h = 0; h < c.n_q; ++h) {
            const int g = h / group;
            scores.clear();
            vrows.clear();
            const float* qh = &d.q[(size_t(t) * c.n_q + h) * c.dk];
            for (int64_t j = lo; j <= hi; ++j) {
                const int32_t page = d.page_table[size_t(s * d.max_pages + j / c.page_size)];
                const int64_t slot = j % c.page_size;
                const float* k = &d.k_cache[size_t(page * k_page + (slot * c.n_kv + g) * c.dk)];
                double dot = 0;
                for (int i = 0; i < c.dk; ++i) dot += double(qh[i]) * k[i];
                scores.push_back(scale * dot);
                vrows.push_back(page * v_page + (slot * c.n_kv + g) * c.dv);
            }
            if (scores.empty()) continue;
            double m = *std::max_element(scores.begin(), scores.end());
            if (c.sinks) m = std::max(m, double(d.sinks[size_t(h)]));
            double denom = c.sinks ? std::exp(d.sinks[size_t(h)] - m) : 0.0;
            for (double sc : scores) denom += std::exp(sc - m);
            double* o = &out[(size_t(t) * c.n_q + h) * c.dv];
            for (size_t j = 0; j < scores.size(); ++j) {
                const double w = std::exp(scores[j] - m) / denom;
                for (int i = 0; i < c.dv; ++i) o[i] += w * d.v_cache[size_t(vrows[j] + i)];
            }
        }
    }
    return out;
}

struct DeviceCase {
    Buf q, k_cache, v_cache, sinks, out, cu, kv_lens, positions, page_table;
    xinfer_op op;
};

DeviceCase upload_case(const Case& c, const Prepared& d) {
    DeviceCase dc;
    dc.q = upload(d.q, c.act_dtype);
    dc.k_cache = upload(d.k_cache, c.cache_dtype);
    dc.v_cache = upload(d.v_cache, c.cache_dtype);
    if (c.sinks) dc.sinks = upload(d.sinks, XINFER_DTYPE_F32);
    dc.out = poisoned(size_t(d.n_tokens) * c.n_q * c.dv, c.act_dtype);
    dc.cu = upload_i32(d.cu_q_lens);
    dc.kv_lens = upload_i32(d.kv_lens);
    dc.positions = upload_i32(d.positions);
    dc.page_table = upload_i32(d.page_table);
    const int n_seqs = int(c.seqs.size());
    xinfer_op op = make_op(XINFER_OP_ATTENTION, "attention");
    op.src[0] = tensor(dc.q, c.act_dtype, {d.n_tokens, c.n_q, c.dk});
    if (d.stride) {
        op.src[1] = tensor(dc.k_cache, c.cache_dtype, {int64_t(d.k_cache.size())});
        op.src[2] = tensor(dc.v_cache, c.cache_dtype, {int64_t(d.v_cache.size())});
    } else {
        op.src[1] = tensor(dc.k_cache, c.cache_dtype, {d.n_pages, c.page_size, c.n_kv, c.dk});
        op.src[2] = tensor(dc.v_cache, c.cache_dtype, {d.n_pages, c.page_size, c.n_kv, c.dv});
    }
    if (c.sinks) op.src[3] = tensor(dc.sinks, XINFER_DTYPE_F32, {c.n_q});
    op.dst[0] = tensor(dc.out, c.act_dtype, {d.n_tokens, c.n_q, c.dv});
    op.params.attention = {c.n_q, c.n_kv, c.dk, c.dv, 1.f / std::sqrt(float(c.dk)), c.window, c.causal ? 1 : 0,
                           1.f, 1.f};
    op.batch.n_seqs = n_seqs;
    op.batch.max_pages_per_seq = d.max_pages;
    op.batch.page_size = c.page_size;
    op.batch.page_stride = d.stride;
    op.batch.cu_q_lens = tensor(dc.cu, XINFER_DTYPE_I32, {n_seqs + 1});
    op.batch.kv_lens = tensor(dc.kv_lens, XINFER_DTYPE_I32, {n_seqs});
    op.batch.positions = tensor(dc.positions, XINFER_DTYPE_I32, {d.n_tokens});
    op.batch.page_table = tensor(dc.page_table, XINFER_DTYPE_I32, {n_seqs, d.max_pages});
    dc.op = op;
    return dc;
}

void run_case(const Case& c, uint32_t seed) {
    const Prepared d = prepare(c, seed);
    DeviceCase dc = upload_case(c, d);
    const std::string name = "attention: " + c.name;
    if (!api->supports_op(ctx, &dc.op)) {
        record(name, false, std::string("supports_op = 0: ") + api->last_error(ctx));
        return;
    }
    if (!run(name, dc.op)) return;
    compare(name, download(dc.out, c.act_dtype, size_t(d.n_tokens) * c.n_q * c.dv),
            reference(c, d, 1.f / std::sqrt(float(c.dk))), 2e-2);
}

void check_kv_store() {
    const int T = 23, n_kv = 4, dk = 192, dv = 128, page_size = 16, n_pages = 8;
    for (int cache_dtype : {XINFER_DTYPE_BF16, XINFER_DTYPE_F32}) {
        const auto k = rounded(random_vector(size_t(T) * n_kv * dk, 11), XINFER_DTYPE_BF16);
        const auto v = rounded(random_vector(size_t(T) * n_kv * dv, 12), XINFER_DTYPE_BF16);
        std::vector<int32_t> slots(T);
        std::vector<int32_t> all(n_pages * page_size);
        std::iota(all.begin(), all.end(), 0);
        std::mt19937 rng(5);
        std::shuffle(all.begin(), all.end(), rng);
        for (int t = 0; t < T; ++t) slots[size_t(t)] = t % 7 == 3 ? -1 : all[size_t(t)];
        Buf kb = upload(k, XINFER_DTYPE_BF16), vb = upload(v, XINFER_DTYPE_BF16), sb = upload_i32(slots);
        Buf kc = poisoned(size_t(n_pages) * page_size * n_kv * dk, cache_dtype);
        Buf vc = poisoned(size_t(n_pages) * page_size * n_kv * dv, cache_dtype);
        xinfer_op op = make_op(XINFER_OP_KV_STORE, "kv_store");
        op.src[0] = tensor(kb, XINFER_DTYPE_BF16, {T, n_kv, dk});
        op.src[1] = tensor(vb, XINFER_DTYPE_BF16, {T, n_kv, dv});
        op.src[2] = tensor(kc, cache_dtype, {n_pages, page_size, n_kv, dk});
        op.src[3] = tensor(vc, cache_dtype, {n_pages, page_size, n_kv, dv});
        op.batch.page_size = page_size;
        op.batch.slot_mapping = tensor(sb, XINFER_DTYPE_I32, {T});
        const std::string name = std::string("kv_store: bf16 -> ") + dname(cache_dtype) + " cache, skipped slots";
        if (!run(name, op)) continue;
        const auto kh = download(kc, cache_dtype, size_t(n_pages) * page_size * n_kv * dk);
        const auto vh = download(vc, cache_dtype, size_t(n_pages) * page_size * n_kv * dv);
        bool ok = true;
        size_t written = 0;
        std::vector<bool> used(size_t(n_pages * page_size), false);
        for (int t = 0; t < T; ++t) {
            if (slots[size_t(t)] < 0) continue;
            used[size_t(slots[size_t(t)])] = true;
            for (int i = 0; i < n_kv * dk; ++i)
                ok &= kh[size_t(slots[size_t(t)]) * n_kv * dk + i] == k[size_t(t) * n_kv * dk + i];
            for (int i = 0; i < n_kv * dv; ++i)
                ok &= vh[size_t(slots[size_t(t)]) * n_kv * dv + i] == v[size_t(t) * n_kv * dv + i];
            ++written;
        }
        for (size_t s = 0; s < used.size(); ++s)
            if (!used[s]) ok &= std::isnan(kh[s * n_kv * dk]) && std::isnan(vh[s * n_kv * dv]);
        record(name, ok, std::to_string(written) + " rows exact, other slots untouched");
    }
}

}  // namespace

void check_attention() {
    check_kv_store();
    const int bf = XINFER_DTYPE_BF16, f32 = XINFER_DTYPE_F32;
    const std::vector<Case> cases = {
        {"decode causal full, GQA 1", 4, 4, 24, 16, true, 0, false, 16, {{37, 1}, {5, 1}, {64, 1}, {1, 1}}},
        {"chunks causal full, GQA 2, sinks", 4, 2, 24, 16, true, 0, true, 16, {{50, 7}, {33, 32}, {16, 16}}},
        {"MiMo full layer: GQA 8, 192/128", 16, 2, 192, 128, true, 0, false, 16, {{70, 1}, {45, 5}, {130, 32}}},
        {"sliding 8, GQA 2, sinks, released pages", 4, 2, 24, 16, true, 8, true, 16,
         {{100, 1}, {90, 12}, {40, 32}, {3, 3}}, true},
        {"sliding 8, no sinks, odd page size 5", 2, 1, 24, 16, true, 8, false, 5, {{61, 1}, {44, 9}}, true},
        {"MiMo sliding: window 128, GQA 8, sinks", 16, 2, 192, 128, true, 128, true, 16,
         {{300, 3}, {200, 1}, {150, 20}}, true},
        {"non-causal symmetric window 4", 2, 2, 24, 16, false, 4, false, 16, {{20, 20}, {30, 8}, {20, 2, 50}}},
        {"non-causal full, GQA 2, sinks, page 7", 4, 2, 24, 16, false, 0, true, 7, {{10, 4}, {17, 17}}},
        {"no visible keys -> zeros", 2, 1, 24, 16, true, 0, true, 16, {{0, 1, 1}, {5, 1}}},
        {"f32 cache + f32 q/out, sliding, GQA 8", 8, 1, 192, 128, true, 16, true, 16, {{80, 4}, {33, 1}}, true, f32,
         f32},
        {"dk 48 / dv 32, GQA 16", 32, 2, 48, 32, true, 0, true, 16, {{77, 3}, {12, 12}}},
        {"dk 16 / dv 16, GQA 1", 3, 3, 16, 16, true, 0, false, 8, {{40, 5}}},
        {"dk 128 / dv 128, GQA 4", 8, 2, 128, 128, true, 0, false, 32, {{100, 9}, {64, 1}}},
        {"page_stride (padded pages)", 8, 2, 64, 32, true, 0, true, 16, {{90, 3}, {41, 8}}, false, bf, bf, 40},
        {"MiMo GA decode, long context (split-KV)", 64, 4, 192, 128, true, 0, false, 64, {{5000, 1}, {3001, 1}}},
        {"MiMo SWA decode, spec-verify 32 tokens", 64, 8, 192, 128, true, 128, true, 32, {{2000, 32}, {700, 17}},
         true},
        {"prefill 600 tokens + 2 seqs (variable length)", 16, 2, 192, 128, true, 0, true, 16,
         {{600, 600}, {150, 150}, {33, 20}}},
        {"DFlash block: non-causal window 16, 16 queries", 8, 2, 64, 64, false, 16, false, 16, {{300, 16}, {40, 16}}},
    };
    uint32_t seed = 7;
    for (const Case& c : cases) run_case(c, seed += 101);

    // Unsupported shapes are refused, not run.
    Case big{"", 4, 2, 320, 128, true, 0, false, 16, {{4, 1}}};
    Prepared d = prepare(big, 1);
    DeviceCase dc = upload_case(big, d);
    const int supported = api->supports_op(ctx, &dc.op);
    record("attention: head_dim_k 320 is refused by supports_op", supported == 0, api->last_error(ctx));
}

// Timings on MiMo-V2-Flash shapes with random bf16 caches (no reference: too slow on the host).
void time_attention() {
    struct Shape {
        const char* name;
        int n_q, n_kv, window, n_seqs, kv_len, n_query;
        bool sinks;
    };
    const Shape shapes[] = {
        {"GA prefill 4096 tokens, 1 seq", 64, 4, 0, 1, 4096, 4096, false},
        {"SWA prefill 4096 tokens, window 128, sinks", 64, 8, 128, 1, 4096, 4096, true},
        {"GA decode, 32 seqs x 8192 keys", 64, 4, 0, 32, 8192, 1, false},
        {"GA decode, 1 seq x 32768 keys", 64, 4, 0, 1, 32768, 1, false},
        {"GA verify 32 tokens, 8 seqs x 4096 keys", 64, 4, 0, 8, 4096, 32, false},
        {"SWA decode, 32 seqs, window 128", 64, 8, 128, 32, 8192, 1, true},
    };
    const int dk = 192, dv = 128, page_size = 64;
    for (const Shape& s : shapes) {
        const int pages_per_seq = (s.kv_len + page_size - 1) / page_size;
        const int n_pages = pages_per_seq * s.n_seqs;
        const int T = s.n_seqs * s.n_query;
        Buf kc(size_t(n_pages) * page_size * s.n_kv * dk * 2), vc(size_t(n_pages) * page_size * s.n_kv * dv * 2);
        fill_random_large(kc, 1, false);
        fill_random_large(vc, 2, false);
        std::vector<int32_t> cu(1, 0), kv_lens, positions, table;
        for (int q = 0; q < s.n_seqs; ++q) {
            cu.push_back(cu.back() + s.n_query);
            kv_lens.push_back(s.kv_len);
            for (int i = 0; i < s.n_query; ++i) positions.push_back(s.kv_len - s.n_query + i);
            for (int p = 0; p < pages_per_seq; ++p) table.push_back(q * pages_per_seq + p);
        }
        Buf cub = upload_i32(cu), kvb = upload_i32(kv_lens), pb = upload_i32(positions), tb = upload_i32(table);
        Buf q = upload(random_vector(size_t(T) * s.n_q * dk, 3), XINFER_DTYPE_BF16);
        Buf sinks = upload(random_vector(size_t(s.n_q), 4), XINFER_DTYPE_F32);
        Buf out(size_t(T) * s.n_q * dv * 2);
        xinfer_op op = make_op(XINFER_OP_ATTENTION, "attention");
        op.src[0] = tensor(q, XINFER_DTYPE_BF16, {T, s.n_q, dk});
        op.src[1] = tensor(kc, XINFER_DTYPE_BF16, {n_pages, page_size, s.n_kv, dk});
        op.src[2] = tensor(vc, XINFER_DTYPE_BF16, {n_pages, page_size, s.n_kv, dv});
        if (s.sinks) op.src[3] = tensor(sinks, XINFER_DTYPE_F32, {s.n_q});
        op.dst[0] = tensor(out, XINFER_DTYPE_BF16, {T, s.n_q, dv});
        op.params.attention = {s.n_q, s.n_kv, dk, dv, 1.f / std::sqrt(float(dk)), s.window, 1, 1.f, 1.f};
        op.batch.n_seqs = s.n_seqs;
        op.batch.max_pages_per_seq = pages_per_seq;
        op.batch.page_size = page_size;
        op.batch.cu_q_lens = tensor(cub, XINFER_DTYPE_I32, {s.n_seqs + 1});
        op.batch.kv_lens = tensor(kvb, XINFER_DTYPE_I32, {s.n_seqs});
        op.batch.positions = tensor(pb, XINFER_DTYPE_I32, {T});
        op.batch.page_table = tensor(tb, XINFER_DTYPE_I32, {s.n_seqs, pages_per_seq});
        if (api->run_op(ctx, &op) != XINFER_OK) {
            record(std::string("attention timing: ") + s.name, false, api->last_error(ctx));
            continue;
        }
        const double ms = time_ms([&] { api->run_op(ctx, &op); }, 10);
        // Keys seen per query row, summed: causal full = Σ (p+1); window: ≤ window.
        double pairs = 0;
        for (int i = 0; i < s.n_query; ++i) {
            const double p = s.kv_len - s.n_query + i;
            pairs += s.window > 0 ? std::min<double>(s.window, p + 1) : p + 1;
        }
        pairs *= s.n_seqs;
        const double flops = 2.0 * pairs * s.n_q * (dk + dv);
        const double key_bytes = (s.window > 0 ? std::min(s.kv_len, s.window + s.n_query) : s.kv_len) *
                                 double(s.n_seqs) * s.n_kv * (dk + dv) * 2;
        char line[256];
        std::snprintf(line, sizeof line, "attention %-44s %8.3f ms  %7.1f TFLOP/s  %7.0f GB/s (KV read once)", s.name,
                      ms, flops / ms / 1e9, key_bytes / ms / 1e6);
        timing(line);
        const auto o = download(out, XINFER_DTYPE_BF16, size_t(std::min(T, 64)) * s.n_q * dv);
        bool finite = true;
        for (float x : o) finite &= std::isfinite(x);
        if (!finite) record(std::string("attention timing output finite: ") + s.name, false, "NaN/inf in output");
    }
}

}  // namespace check
