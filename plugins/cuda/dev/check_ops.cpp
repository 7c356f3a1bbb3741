// Checks of the elementwise, matmul, MoE and sampling ops against straightforward host
// references (float64 where it matters), following the CPU oracle's semantics
// (src/backend/cpu/*.cpp, src/sample/sampler.cpp).
#include "check_util.h"

#include <numeric>

namespace check {
namespace {

constexpr double kTol = 2e-2;  // bf16 activations / weights
const int bf = XINFER_DTYPE_BF16, f32 = XINFER_DTYPE_F32, f16 = XINFER_DTYPE_F16, i32 = XINFER_DTYPE_I32,
          f8 = XINFER_DTYPE_F8_E4M3;

std::vector<double> to_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// ---- elementwise ---------------------------------------------------------------------------------

void check_embedding() {
    const int V = 1000, H = 256, T = 37;
    const auto table = random_vector(size_t(V) * H, 1);
    std::vector<int32_t> ids(T);
    for (int t = 0; t < T; ++t) ids[size_t(t)] = (t * 397 + 11) % V;
    for (auto [td, od] : {std::pair{bf, bf}, std::pair{bf, f32}, std::pair{f32, bf}, std::pair{f16, f32}}) {
        const auto tr = rounded(table, td);
        Buf tb = upload(tr, td), ib = upload_i32(ids), ob = poisoned(size_t(T) * H, od);
        xinfer_op op = make_op(XINFER_OP_EMBEDDING, "embed");
        op.src[0] = tensor(tb, td, {V, H});
        op.src[1] = tensor(ib, i32, {T});
        op.dst[0] = tensor(ob, od, {T, H});
        const std::string name = std::string("embedding ") + dname(td) + " -> " + dname(od);
        if (!run(name, op)) continue;
        std::vector<double> ref(size_t(T) * H);
        for (int t = 0; t < T; ++t)
            for (int h = 0; h < H; ++h) ref[size_t(t) * H + h] = round_to(od, tr[size_t(ids[size_t(t)]) * H + h]);
        compare(name, download(ob, od, size_t(T) * H), ref, 1e-6);
    }
}

void check_norms() {
    const int R = 37, N = 4096;
    const float eps = 1e-5f;
    for (int dt : {bf, f32}) {
        const auto x = rounded(random_vector(size_t(R) * N, 2, -3.f, 3.f), dt);
        const auto d = rounded(random_vector(size_t(R) * N, 3), dt);
        const auto w = rounded(random_vector(size_t(N), 4, 0.5f, 1.5f), bf);
        // rmsnorm
        {
            Buf xb = upload(x, dt), wb = upload(w, bf), ob = poisoned(size_t(R) * N, dt);
            xinfer_op op = make_op(XINFER_OP_RMSNORM, "norm");
            op.src[0] = tensor(xb, dt, {R, N});
            op.src[1] = tensor(wb, bf, {N});
            op.dst[0] = tensor(ob, dt, {R, N});
            op.params.norm.eps = eps;
            const std::string name = std::string("rmsnorm ") + dname(dt) + " [37, 4096]";
            if (run(name, op)) {
                std::vector<double> ref(x.size());
                for (int r = 0; r < R; ++r) {
                    double ss = 0;
                    for (int i = 0; i < N; ++i) ss += double(x[size_t(r) * N + i]) * x[size_t(r) * N + i];
                    const double inv = 1.0 / std::sqrt(ss / N + eps);
                    for (int i = 0; i < N; ++i) ref[size_t(r) * N + i] = x[size_t(r) * N + i] * inv * w[size_t(i)];
                }
                compare(name, download(ob, dt, x.size()), ref, kTol);
            }
        }
        // add_rmsnorm: residual += d (rounded to its dtype), out = rmsnorm(residual)
        {
            Buf rb = upload(x, dt), db = upload(d, dt), wb = upload(w, bf), ob = poisoned(size_t(R) * N, dt);
            xinfer_op op = make_op(XINFER_OP_ADD_RMSNORM, "add_norm");
            op.src[0] = tensor(rb, dt, {R, N});
            op.src[1] = tensor(db, dt, {R, N});
            op.src[2] = tensor(wb, bf, {N});
            op.dst[0] = tensor(ob, dt, {R, N});
            op.params.norm.eps = eps;
            const std::string name = std::string("add_rmsnorm ") + dname(dt) + " [37, 4096]";
            if (run(name, op)) {
                std::vector<double> res(x.size()), ref(x.size());
                for (size_t i = 0; i < x.size(); ++i) res[i] = round_to(dt, x[i] + d[i]);
                for (int r = 0; r < R; ++r) {
                    double ss = 0;
                    for (int i = 0; i < N; ++i) ss += res[size_t(r) * N + i] * res[size_t(r) * N + i];
                    const double inv = 1.0 / std::sqrt(ss / N + eps);
                    for (int i = 0; i < N; ++i) ref[size_t(r) * N + i] = res[size_t(r) * N + i] * inv * w[size_t(i)];
                }
                compare(name + " (residual)", download(rb, dt, x.size()), res, 1e-6);
                compare(name + " (out)", download(ob, dt, x.size()), ref, kTol);
            }
        }
    }
}

void check_rope() {
    struct Shape {
        int T, heads, D, rotary;
        float theta;
        int dt;
    };
    for (const Shape& s : {Shape{19, 8, 192, 64, 5e6f, bf}, Shape{5, 4, 24, 8, 1e4f, f32}, Shape{7, 2, 64, 64, 1e4f, bf}}) {
        const auto x = rounded(random_vector(size_t(s.T) * s.heads * s.D, 5), s.dt);
        std::vector<int32_t> pos(s.T);
        for (int t = 0; t < s.T; ++t) pos[size_t(t)] = (t * 7919 + 3) % 200000;
        Buf xb = upload(x, s.dt), pb = upload_i32(pos);
        xinfer_op op = make_op(XINFER_OP_ROPE, "rope");
        op.src[0] = tensor(xb, s.dt, {s.T, s.heads, s.D});
        op.src[1] = tensor(pb, i32, {s.T});
        op.params.rope.rotary_dim = s.rotary;
        op.params.rope.theta = s.theta;
        const std::string name = "rope " + std::string(dname(s.dt)) + " D " + std::to_string(s.D) + " rotary " +
                                 std::to_string(s.rotary) + ", positions to 2e5";
        if (!run(name, op)) continue;
        std::vector<double> ref(to_double(x));
        const int half = s.rotary / 2;
        for (int t = 0; t < s.T; ++t)
            for (int h = 0; h < s.heads; ++h)
                for (int j = 0; j < half; ++j) {
                    const double a = pos[size_t(t)] * std::pow(double(s.theta), -2.0 * j / s.rotary);
                    const size_t b = (size_t(t) * s.heads + h) * s.D;
                    const double lo = x[b + j], hi = x[b + j + half];
                    ref[b + j] = lo * std::cos(a) - hi * std::sin(a);
                    ref[b + j + half] = hi * std::cos(a) + lo * std::sin(a);
                }
        compare(name, download(xb, s.dt, x.size()), ref, kTol);
    }
}

void check_simple() {
    const int R = 33, I = 1024;
    {  // swiglu
        const auto gu = rounded(random_vector(size_t(R) * 2 * I, 6, -4.f, 4.f), bf);
        Buf gb = upload(gu, bf), ob = poisoned(size_t(R) * I, bf);
        xinfer_op op = make_op(XINFER_OP_SWIGLU, "swiglu");
        op.src[0] = tensor(gb, bf, {R, 2 * I});
        op.dst[0] = tensor(ob, bf, {R, I});
        if (run("swiglu bf16 [33, 2048]", op)) {
            std::vector<double> ref(size_t(R) * I);
            for (int r = 0; r < R; ++r)
                for (int i = 0; i < I; ++i) {
                    const double g = gu[size_t(r) * 2 * I + i], u = gu[size_t(r) * 2 * I + I + i];
                    ref[size_t(r) * I + i] = g / (1 + std::exp(-g)) * u;
                }
            compare("swiglu bf16 [33, 2048]", download(ob, bf, ref.size()), ref, kTol);
        }
    }
    const auto a = rounded(random_vector(size_t(R) * I, 7), bf), b = rounded(random_vector(size_t(R) * I, 8), bf);
    {  // scale
        Buf xb = upload(a, bf);
        xinfer_op op = make_op(XINFER_OP_SCALE, "scale");
        op.src[0] = tensor(xb, bf, {R, I});
        op.params.scale.factor = 0.707f;
        if (run("scale bf16", op)) {
            std::vector<double> ref(a.size());
            for (size_t i = 0; i < a.size(); ++i) ref[i] = a[i] * 0.707;
            compare("scale bf16", download(xb, bf, a.size()), ref, kTol);
        }
    }
    for (int yd : {bf, f32}) {  // add
        Buf xb = upload(a, bf), yb = upload(b, yd);
        xinfer_op op = make_op(XINFER_OP_ADD, "add");
        op.src[0] = tensor(xb, bf, {R, I});
        op.src[1] = tensor(yb, yd, {R, I});
        const std::string name = std::string("add bf16 += ") + dname(yd);
        if (run(name, op)) {
            std::vector<double> ref(a.size());
            for (size_t i = 0; i < a.size(); ++i) ref[i] = double(a[i]) + b[i];
            compare(name, download(xb, bf, a.size()), ref, kTol);
        }
    }
    const auto v = random_vector(size_t(R) * I, 9, -100.f, 100.f);
    for (auto [from, to] : {std::pair{f32, bf}, std::pair{bf, f32}, std::pair{f32, f16}, std::pair{f16, f32},
                            std::pair{bf, f16}, std::pair{f16, bf}}) {
        const auto src = rounded(v, from);
        Buf sb = upload(src, from), db = poisoned(src.size(), to);
        xinfer_op op = make_op(XINFER_OP_CONVERT, "convert");
        op.src[0] = tensor(sb, from, {R, I});
        op.dst[0] = tensor(db, to, {R, I});
        const std::string name = std::string("convert ") + dname(from) + " -> " + dname(to);
        if (!run(name, op)) continue;
        std::vector<double> ref(src.size());
        for (size_t i = 0; i < src.size(); ++i) ref[i] = round_to(to, src[i]);
        compare(name + " (exact rounding)", download(db, to, src.size()), ref, 0.0);
    }
}

// ---- matmul --------------------------------------------------------------------------------------

struct Fp8Weight {
    std::vector<uint8_t> bytes;   // [N, K]
    std::vector<float> scale;     // [scale_rows, scale_cols]
    std::vector<float> dequant;   // [N, K] exact f32
    int64_t scale_rows = 0, scale_cols = 0;
};

// shards > 1: the scale grid restarts every N / shards rows (tensor-parallel export).
Fp8Weight make_fp8(int64_t N, int64_t K, int br, int bc, int shards, uint32_t seed) {
    Fp8Weight w;
    std::mt19937 rng(seed);
    w.bytes.resize(size_t(N * K));
    for (auto& x : w.bytes) x = uint8_t((rng() & 0x80u) | (rng() % 0x70u + 0x08u));  // no NaN codes
    const int64_t shard_rows = N / shards, blocks = (shard_rows + br - 1) / br;
    w.scale_rows = shards * blocks;
    w.scale_cols = (K + bc - 1) / bc;
    w.scale = random_vector(size_t(w.scale_rows * w.scale_cols), seed + 1, 0.001f, 0.01f);
    w.dequant.resize(size_t(N * K));
    for (int64_t r = 0; r < N; ++r) {
        const int64_t srow = (r / shard_rows) * blocks + (r % shard_rows) / br;
        for (int64_t c = 0; c < K; ++c)
            w.dequant[size_t(r * K + c)] =
                fp8_to_f32(w.bytes[size_t(r * K + c)]) * w.scale[size_t(srow * w.scale_cols + c / bc)];
    }
    return w;
}

std::vector<double> ref_matmul(const std::vector<float>& x, const std::vector<float>& w, int64_t T, int64_t N,
                               int64_t K) {
    std::vector<double> y(size_t(T * N));
    for (int64_t t = 0; t < T; ++t)
        for (int64_t n = 0; n < N; ++n) {
            double acc = 0;
            const float* xr = &x[size_t(t * K)];
            const float* wr = &w[size_t(n * K)];
            for (int64_t k = 0; k < K; ++k) acc += double(xr[k]) * wr[k];
            y[size_t(t * N + n)] = acc;
        }
    return y;
}

void check_matmul() {
    struct Dense {
        int64_t T, N, K;
        int xd, wd, yd;
    };
    const Dense dense[] = {
        {1, 768, 1024, bf, bf, bf},  {7, 768, 1024, bf, bf, f32}, {133, 768, 1024, bf, bf, bf},
        {40, 512, 256, f32, bf, f32}, {33, 200, 256, f32, f32, f32}, {17, 256, 512, f16, f16, f16},
        {9, 70, 100, bf, bf, bf},
    };
    uint32_t seed = 100;
    for (const Dense& m : dense) {
        const auto x = rounded(random_vector(size_t(m.T * m.K), ++seed), m.xd);
        const auto w = rounded(random_vector(size_t(m.N * m.K), ++seed, -0.1f, 0.1f), m.wd);
        Buf xb = upload(x, m.xd), wb = upload(w, m.wd), yb = poisoned(size_t(m.T * m.N), m.yd);
        xinfer_op op = make_op(XINFER_OP_MATMUL, "matmul");
        op.src[0] = tensor(xb, m.xd, {m.T, m.K});
        op.src[1] = tensor(wb, m.wd, {m.N, m.K});
        op.dst[0] = tensor(yb, m.yd, {m.T, m.N});
        char name[160];
        std::snprintf(name, sizeof name, "matmul x %s w %s -> %s  T %lld N %lld K %lld", dname(m.xd), dname(m.wd),
                      dname(m.yd), (long long)m.T, (long long)m.N, (long long)m.K);
        if (!run(name, op)) continue;
        compare(name, download(yb, m.yd, size_t(m.T * m.N)), ref_matmul(x, w, m.T, m.N, m.K),
                m.wd == f32 ? 1e-4 : kTol);
    }
    struct Fp8Case {
        int64_t T, N, K;
        int br, bc, shards, xd, yd;
    };
    const Fp8Case fp8_cases[] = {
        {1, 384, 640, 128, 128, 1, bf, bf},  {70, 300, 200, 128, 128, 1, bf, f32}, {5, 768, 256, 128, 128, 4, f32, bf},
        {3, 256, 256, 64, 48, 1, bf, f32},   {130, 512, 1024, 128, 128, 1, bf, bf},
    };
    for (const Fp8Case& m : fp8_cases) {
        const Fp8Weight w = make_fp8(m.N, m.K, m.br, m.bc, m.shards, ++seed);
        const auto x = rounded(random_vector(size_t(m.T * m.K), ++seed), m.xd);
        auto xr = rounded(x, bf);  // the kernel runs on bf16 activations
        Buf xb = upload(x, m.xd), wb = upload_u8(w.bytes), sb = upload(w.scale, f32),
            yb = poisoned(size_t(m.T * m.N), m.yd);
        xinfer_op op = make_op(XINFER_OP_MATMUL, "matmul_fp8");
        op.src[0] = tensor(xb, m.xd, {m.T, m.K});
        op.src[1] = tensor(wb, f8, {m.N, m.K});
        op.src[2] = tensor(sb, f32, {w.scale_rows, w.scale_cols});
        op.dst[0] = tensor(yb, m.yd, {m.T, m.N});
        op.params.matmul.block_rows = m.br;
        op.params.matmul.block_cols = m.bc;
        char name[160];
        std::snprintf(name, sizeof name, "matmul fp8 %dx%d%s x %s -> %s  T %lld N %lld K %lld", m.br, m.bc,
                      m.shards > 1 ? " 4 shards" : "", dname(m.xd), dname(m.yd), (long long)m.T, (long long)m.N,
                      (long long)m.K);
        if (!run(name, op)) continue;
        compare(name, download(yb, m.yd, size_t(m.T * m.N)), ref_matmul(xr, w.dequant, m.T, m.N, m.K), kTol);
    }
    {  // shape errors are refused with a message
        Buf xb(64), wb(64), yb(64);
        xinfer_op op = make_op(XINFER_OP_MATMUL, "bad");
        op.src[0] = tensor(xb, bf, {2, 8});
        op.src[1] = tensor(wb, bf, {4, 7});
        op.dst[0] = tensor(yb, bf, {2, 4});
        const int s = api->supports_op(ctx, &op), rc = api->run_op(ctx, &op);
        record("matmul K mismatch refused (supports 0, run UNSUPPORTED)", s == 0 && rc == XINFER_UNSUPPORTED,
               api->last_error(ctx));
    }
}

// ---- MoE -----------------------------------------------------------------------------------------

struct RouteCase {
    const char* name;
    int T, E, top_k, scoring, n_group, topk_group, norm;
    float scaling;
    bool bias, quantized;  // quantized: logits on a coarse grid, so exact ties occur
};

void ref_route(const RouteCase& c, const std::vector<float>& logits, const std::vector<float>& bias,
               std::vector<int32_t>& ids, std::vector<float>& weights) {
    const int E = c.E, k = c.top_k, gs = E / c.n_group;
    ids.assign(size_t(c.T * k), 0);
    weights.assign(size_t(c.T * k), 0);
    for (int t = 0; t < c.T; ++t) {
        const float* row = &logits[size_t(t) * E];
        std::vector<float> sc(static_cast<size_t>(E)), sel(static_cast<size_t>(E));
        if (c.scoring == 0) {
            const float mx = *std::max_element(row, row + E);
            float sum = 0;
            for (int e = 0; e < E; ++e) sum += sc[size_t(e)] = std::exp(row[e] - mx);
            for (int e = 0; e < E; ++e) sc[size_t(e)] /= sum;
        } else {
            for (int e = 0; e < E; ++e) sc[size_t(e)] = 1.f / (1.f + std::exp(-row[e]));
        }
        for (int e = 0; e < E; ++e) sel[size_t(e)] = sc[size_t(e)] + (c.bias ? bias[size_t(e)] : 0.f);
        auto better = [](const std::vector<float>& s, int a, int b) { return s[size_t(a)] > s[size_t(b)] || (s[size_t(a)] == s[size_t(b)] && a < b); };
        if (c.topk_group < c.n_group) {
            std::vector<float> gsc(static_cast<size_t>(c.n_group));
            for (int g = 0; g < c.n_group; ++g) {
                std::vector<float> v(sel.begin() + g * gs, sel.begin() + (g + 1) * gs);
                std::sort(v.rbegin(), v.rend());
                gsc[size_t(g)] = gs >= 2 ? v[0] + v[1] : v[0];
            }
            std::vector<int> order(static_cast<size_t>(c.n_group));
            std::iota(order.begin(), order.end(), 0);
            std::sort(order.begin(), order.end(), [&](int a, int b) { return better(gsc, a, b); });
            std::vector<bool> keep(size_t(c.n_group), false);
            for (int i = 0; i < c.topk_group; ++i) keep[size_t(order[size_t(i)])] = true;
            for (int e = 0; e < E; ++e)
                if (!keep[size_t(e / gs)]) sel[size_t(e)] = -INFINITY;
        }
        std::vector<int> order(static_cast<size_t>(E));
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int a, int b) { return better(sel, a, b); });
        float sum = 0;
        for (int i = 0; i < k; ++i) {
            ids[size_t(t * k + i)] = order[size_t(i)];
            sum += weights[size_t(t * k + i)] = sc[size_t(order[size_t(i)])];
        }
        const float f = c.scaling / (c.norm ? sum + 1e-20f : 1.f);
        for (int i = 0; i < k; ++i) weights[size_t(t * k + i)] *= f;
    }
}

void check_moe_route() {
    const RouteCase cases[] = {
        {"MiMo: sigmoid + bias, E 256, top 8", 37, 256, 8, 1, 1, 1, 1, 1.f, true, false},
        {"DeepSeek groups: sigmoid, 8 groups keep 3, top 6", 21, 64, 6, 1, 8, 3, 1, 2.5f, true, false},
        {"softmax, no norm, top 2, E 8", 50, 8, 2, 0, 1, 1, 0, 1.f, false, false},
        {"ties -> lower index (quantized logits)", 40, 32, 4, 1, 4, 2, 1, 1.f, false, true},
        {"softmax groups, E 160, 10 groups keep 4", 9, 160, 8, 0, 10, 4, 1, 1.f, true, false},
    };
    uint32_t seed = 300;
    for (const RouteCase& c : cases) {
        auto logits = random_vector(size_t(c.T) * c.E, ++seed, -4.f, 4.f);
        if (c.quantized)
            for (float& x : logits) x = std::round(x);
        const auto bias = random_vector(size_t(c.E), ++seed, -0.2f, 0.2f);
        Buf lb = upload(logits, f32), bb = upload(bias, f32), ib = poisoned(size_t(c.T * c.top_k), i32),
            wb = poisoned(size_t(c.T * c.top_k), f32);
        xinfer_op op = make_op(XINFER_OP_MOE_ROUTE, "route");
        op.src[0] = tensor(lb, f32, {c.T, c.E});
        if (c.bias) op.src[1] = tensor(bb, f32, {c.E});
        op.dst[0] = tensor(ib, i32, {c.T, c.top_k});
        op.dst[1] = tensor(wb, f32, {c.T, c.top_k});
        op.params.route = {c.scoring, c.top_k, c.n_group, c.topk_group, c.norm, c.scaling};
        const std::string name = std::string("moe_route ") + c.name;
        if (!run(name, op)) continue;
        std::vector<int32_t> ref_ids;
        std::vector<float> ref_w;
        ref_route(c, logits, bias, ref_ids, ref_w);
        const auto got_ids = download_i32(ib, ref_ids.size());
        size_t mismatches = 0;
        for (size_t i = 0; i < ref_ids.size(); ++i) mismatches += got_ids[i] != ref_ids[i];
        record(name + " (ids exact)", mismatches == 0, std::to_string(mismatches) + " of " +
                                                           std::to_string(ref_ids.size()) + " ids differ");
        compare(name + " (weights)", download(wb, f32, ref_w.size()), to_double(ref_w), 1e-5);
    }
}

void check_moe_experts() {
    struct Case {
        const char* name;
        int T, H, I, E, k, xd, od, wd;
    };
    const Case cases[] = {
        {"bf16 T 45 H 256 I 128 E 16 top 4 (P 180: tiled)", 45, 256, 128, 16, 4, bf, bf, bf},
        {"bf16 x f32 -> f32, T 3, E 64 top 8 (P 24: GEMV)", 3, 512, 256, 64, 8, f32, f32, bf},
        {"fp8 128x128 T 70 H 256 I 384 E 8 top 2", 70, 256, 384, 8, 2, bf, bf, f8},
        {"fp8 T 1 H 512 I 256 E 32 top 8 (GEMV)", 1, 512, 256, 32, 8, bf, f32, f8},
        {"bf16 T 100 top 4 (P 400: tiled path)", 100, 256, 128, 16, 4, bf, bf, bf},
        {"fp8 T 150 top 2 E 8 (P 300: tiled path)", 150, 256, 384, 8, 2, f32, bf, f8},
    };
    uint32_t seed = 500;
    for (const Case& c : cases) {
        const auto x = rounded(random_vector(size_t(c.T) * c.H, ++seed), c.xd);
        std::mt19937 rng(++seed);
        std::vector<int32_t> ids(size_t(c.T * c.k));
        for (int t = 0; t < c.T; ++t) {
            std::vector<int> experts(static_cast<size_t>(c.E));
            std::iota(experts.begin(), experts.end(), 0);
            std::shuffle(experts.begin(), experts.end(), rng);
            for (int s = 0; s < c.k; ++s) ids[size_t(t * c.k + s)] = experts[size_t(s)];
        }
        const auto weights = random_vector(size_t(c.T * c.k), ++seed, 0.f, 1.f);
        std::vector<float> gu_deq, dn_deq;  // [E, 2I, H], [E, H, I]
        Buf gub, dnb, gus, dns;
        std::vector<float> gus_h, dns_h;
        int64_t gus_rows = 0, gus_cols = 0, dns_rows = 0, dns_cols = 0;
        if (c.wd == bf) {
            gu_deq = rounded(random_vector(size_t(c.E) * 2 * c.I * c.H, ++seed, -0.1f, 0.1f), bf);
            dn_deq = rounded(random_vector(size_t(c.E) * c.H * c.I, ++seed, -0.1f, 0.1f), bf);
            gub = upload(gu_deq, bf);
            dnb = upload(dn_deq, bf);
        } else {
            std::vector<uint8_t> gu_bytes, dn_bytes;
            for (int e = 0; e < c.E; ++e) {
                const Fp8Weight g = make_fp8(2 * c.I, c.H, 128, 128, 1, ++seed);
                const Fp8Weight d = make_fp8(c.H, c.I, 128, 128, 1, ++seed);
                gu_bytes.insert(gu_bytes.end(), g.bytes.begin(), g.bytes.end());
                dn_bytes.insert(dn_bytes.end(), d.bytes.begin(), d.bytes.end());
                gu_deq.insert(gu_deq.end(), g.dequant.begin(), g.dequant.end());
                dn_deq.insert(dn_deq.end(), d.dequant.begin(), d.dequant.end());
                gus_h.insert(gus_h.end(), g.scale.begin(), g.scale.end());
                dns_h.insert(dns_h.end(), d.scale.begin(), d.scale.end());
                gus_rows = g.scale_rows, gus_cols = g.scale_cols, dns_rows = d.scale_rows, dns_cols = d.scale_cols;
            }
            gub = upload_u8(gu_bytes);
            dnb = upload_u8(dn_bytes);
            gus = upload(gus_h, f32);
            dns = upload(dns_h, f32);
        }
        Buf xb = upload(x, c.xd), ib = upload_i32(ids), wb = upload(weights, f32),
            ob = poisoned(size_t(c.T) * c.H, c.od);
        xinfer_op op = make_op(XINFER_OP_MOE_EXPERTS, "experts");
        op.src[0] = tensor(xb, c.xd, {c.T, c.H});
        op.src[1] = tensor(ib, i32, {c.T, c.k});
        op.src[2] = tensor(wb, f32, {c.T, c.k});
        op.src[3] = tensor(gub, c.wd, {c.E, 2 * c.I, c.H});
        op.src[4] = tensor(dnb, c.wd, {c.E, c.H, c.I});
        if (c.wd == f8) {
            op.src[5] = tensor(gus, f32, {c.E, gus_rows, gus_cols});
            op.src[6] = tensor(dns, f32, {c.E, dns_rows, dns_cols});
        }
        op.dst[0] = tensor(ob, c.od, {c.T, c.H});
        op.params.matmul.block_rows = 128;
        op.params.matmul.block_cols = 128;
        const std::string name = std::string("moe_experts ") + c.name;
        if (!run(name, op)) continue;
        const auto xr = rounded(x, bf);
        std::vector<double> ref(size_t(c.T) * c.H, 0.0), h(size_t(c.I));
        for (int t = 0; t < c.T; ++t)
            for (int s = 0; s < c.k; ++s) {
                const int e = ids[size_t(t * c.k + s)];
                const float* gu = &gu_deq[size_t(e) * 2 * c.I * c.H];
                const float* dn = &dn_deq[size_t(e) * c.H * c.I];
                for (int i = 0; i < c.I; ++i) {
                    double g = 0, u = 0;
                    for (int j = 0; j < c.H; ++j) {
                        g += double(xr[size_t(t) * c.H + j]) * gu[size_t(i) * c.H + j];
                        u += double(xr[size_t(t) * c.H + j]) * gu[size_t(c.I + i) * c.H + j];
                    }
                    h[size_t(i)] = g / (1 + std::exp(-g)) * u;
                }
                for (int j = 0; j < c.H; ++j) {
                    double acc = 0;
                    for (int i = 0; i < c.I; ++i) acc += h[size_t(i)] * dn[size_t(j) * c.I + i];
                    ref[size_t(t) * c.H + j] += weights[size_t(t * c.k + s)] * acc;
                }
            }
        compare(name, download(ob, c.od, ref.size()), ref, kTol);
    }
}

// ---- sampling ------------------------------------------------------------------------------------

int32_t ref_sample(const float* logits, int V, float temp, float top_p, int top_k, float u) {
    int32_t best = 0;
    for (int i = 1; i < V; ++i)
        if (logits[i] > logits[best]) best = i;
    if (temp <= 0.f) return best;
    std::vector<int32_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    const int k = top_k > 0 ? std::min(top_k, V) : V;
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    order.resize(size_t(k));
    std::vector<double> probs(order.size());
    double total = 0;
    for (size_t i = 0; i < order.size(); ++i)
        total += probs[i] = std::exp((double(logits[order[i]]) - logits[order[0]]) / temp);
    size_t keep = probs.size();
    if (top_p < 1.f) {
        double mass = 0;
        for (size_t i = 0; i < probs.size(); ++i) {
            mass += probs[i] / total;
            if (mass >= top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    double kept = 0;
    for (size_t i = 0; i < keep; ++i) kept += probs[i];
    double draw = double(u) * kept;
    for (size_t i = 0; i < keep; ++i) {
        draw -= probs[i];
        if (draw < 0) return order[i];
    }
    return order[keep - 1];
}

void check_sampling() {
    for (int V : {1000, 152576}) {
        struct Params {
            float temp, top_p;
            int top_k;
            float u;
        };
        std::vector<Params> params = {{0.f, 1.f, 0, 0.5f},   {1.f, 1.f, 0, 0.5f},   {0.7f, 0.9f, 50, 0.3f},
                                      {1.3f, 1.f, 1, 0.9f},  {1.f, 0.5f, 0, 0.99f}, {2.f, 0.95f, 10, 0.01f},
                                      {0.5f, 0.99f, 0, 0.f}, {1.f, 1.f, 5000000, 0.999999f},
                                      {1.f, 0.8f, 3, 0.7f},  {0.9f, 0.3f, 0, 0.42f}};
        std::mt19937 rng(77);
        for (int i = 0; i < 22; ++i)
            params.push_back({float(rng() % 200) / 100.f, float(rng() % 100 + 1) / 100.f, int(rng() % 60),
                              float(rng() % 1000) / 1000.f});
        const int R = int(params.size());
        auto logits = random_vector(size_t(R) * V, 900 + uint32_t(V), -6.f, 6.f);
        // Coarse values in half the rows make exact ties; keep them ordered by index.
        for (int r = 0; r < R; r += 2)
            for (int i = 0; i < V; ++i) logits[size_t(r) * V + i] = std::round(logits[size_t(r) * V + i] * 2) / 2;
        std::vector<float> temp, top_p, u;
        std::vector<int32_t> top_k;
        for (const Params& p : params) {
            temp.push_back(p.temp);
            top_p.push_back(p.top_p);
            top_k.push_back(p.top_k);
            u.push_back(p.u);
        }
        Buf lb = upload(logits, f32), tb = upload(temp, f32), pb = upload(top_p, f32), kb = upload_i32(top_k),
            ub = upload(u, f32), ob = poisoned(size_t(R), i32), ab = poisoned(size_t(R), i32);
        xinfer_op op = make_op(XINFER_OP_SAMPLE, "sample");
        op.src[0] = tensor(lb, f32, {R, V});
        op.src[1] = tensor(tb, f32, {R});
        op.src[2] = tensor(pb, f32, {R});
        op.src[3] = tensor(kb, i32, {R});
        op.src[4] = tensor(ub, f32, {R});
        op.dst[0] = tensor(ob, i32, {R});
        xinfer_op am = make_op(XINFER_OP_ARGMAX, "argmax");
        am.src[0] = tensor(lb, f32, {R, V});
        am.dst[0] = tensor(ab, i32, {R});
        const std::string vs = " V " + std::to_string(V);
        if (run("argmax" + vs, am)) {
            const auto got = download_i32(ab, size_t(R));
            int bad = 0;
            for (int r = 0; r < R; ++r) bad += got[size_t(r)] != ref_sample(&logits[size_t(r) * V], V, 0.f, 1.f, 0, 0.f);
            record("argmax" + vs + " (ties -> lowest index)", bad == 0, std::to_string(bad) + " of " + std::to_string(R) + " rows differ");
        }
        if (run("sample" + vs, op)) {
            const auto got = download_i32(ob, size_t(R));
            int bad = 0;
            std::string first;
            for (int r = 0; r < R; ++r) {
                const int32_t want = ref_sample(&logits[size_t(r) * V], V, temp[size_t(r)], top_p[size_t(r)],
                                                top_k[size_t(r)], u[size_t(r)]);
                if (got[size_t(r)] != want) {
                    ++bad;
                    if (first.empty())
                        first = " first: row " + std::to_string(r) + " got " + std::to_string(got[size_t(r)]) +
                                " want " + std::to_string(want);
                }
            }
            record("sample" + vs + " (temperature/top-k/top-p, exact ids)", bad == 0,
                   std::to_string(bad) + " of " + std::to_string(R) + " rows differ" + first);
        }
    }
}

}  // namespace

void check_ops() {
    check_embedding();
    check_norms();
    check_rope();
    check_simple();
    check_matmul();
    check_moe_route();
    check_moe_experts();
    check_sampling();
}

}  // namespace check
