// The op-case grid and the machinery that runs a case on two backends (see op_cases.h). The
// shared tensor builders are declared in op_case_builders.h; the paged-KV cases are built in
// op_cases_attention.cpp.
#include "backend/op_cases.h"

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kv_fp8.h"
#include "backend/op_case_builders.h"
#include "backend/op_desc.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

namespace xinfer::op_cases {

// ---- building tensors ----------------------------------------------------------------------------

int64_t product(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
}

std::vector<float> uniform(int64_t n, std::mt19937& rng, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = dist(rng);
    return v;
}

CaseTensor make_tensor(std::string name, Slot slot, Access access, bool activation, DType dtype,
                       std::vector<int64_t> shape) {
    CaseTensor t;
    t.name = std::move(name);
    t.slot = slot;
    t.access = access;
    t.activation = activation;
    t.dtype = activation ? DType::f32 : dtype;
    t.shape = std::move(shape);
    if (access != Access::input) t.compare = Compare::nmse;
    return t;
}

// Random values in [lo, hi], or a device fill of that magnitude for very large tensors.
void fill_uniform(CaseTensor& t, std::mt19937& rng, float lo, float hi) {
    const int64_t n = t.numel();
    if (n > kMaxHostValues) {
        t.bulk_random = std::max(std::fabs(lo), std::fabs(hi));
        return;
    }
    t.values = uniform(n, rng, lo, hi);
}

CaseTensor act_input(std::string name, Slot slot, std::vector<int64_t> shape, std::mt19937& rng, float lo, float hi) {
    CaseTensor t = make_tensor(std::move(name), slot, Access::input, true, DType::f32, std::move(shape));
    fill_uniform(t, rng, lo, hi);
    return t;
}
CaseTensor act_inout(std::string name, Slot slot, std::vector<int64_t> shape, std::mt19937& rng, float lo, float hi) {
    CaseTensor t = make_tensor(std::move(name), slot, Access::inout, true, DType::f32, std::move(shape));
    fill_uniform(t, rng, lo, hi);
    return t;
}
CaseTensor act_output(std::string name, Slot slot, std::vector<int64_t> shape) {
    return make_tensor(std::move(name), slot, Access::output, true, DType::f32, std::move(shape));
}
CaseTensor fixed_input(std::string name, Slot slot, DType dtype, std::vector<int64_t> shape, std::mt19937& rng,
                       float lo, float hi) {
    CaseTensor t = make_tensor(std::move(name), slot, Access::input, false, dtype, std::move(shape));
    fill_uniform(t, rng, lo, hi);
    return t;
}
CaseTensor fixed_values(std::string name, Slot slot, DType dtype, std::vector<int64_t> shape, std::vector<float> values) {
    CaseTensor t = make_tensor(std::move(name), slot, Access::input, false, dtype, std::move(shape));
    t.values = std::move(values);
    return t;
}
CaseTensor fixed_output(std::string name, Slot slot, DType dtype, std::vector<int64_t> shape, Compare compare) {
    CaseTensor t = make_tensor(std::move(name), slot, Access::output, false, dtype, std::move(shape));
    t.compare = compare;
    return t;
}
CaseTensor i32_input(std::string name, Slot slot, std::vector<int64_t> shape, std::vector<int32_t> ints) {
    CaseTensor t = make_tensor(std::move(name), slot, Access::input, false, DType::i32, std::move(shape));
    t.ints = std::move(ints);
    return t;
}
CaseTensor i32_output(std::string name, Slot slot, std::vector<int64_t> shape) {
    CaseTensor t = make_tensor(std::move(name), slot, Access::output, false, DType::i32, std::move(shape));
    t.compare = Compare::exact;
    return t;
}

OpCase make_case(xinfer_op_type type, std::string description, Tolerance tolerance, std::function<CaseData()> build) {
    return {op_type_name(type), std::move(description), tolerance, std::move(build)};
}

CaseData start(xinfer_op_type type) {
    CaseData data;
    data.op = make_op(type, -1);
    data.op.name = "ops-test";
    return data;
}

// k distinct values of [0, n), in random order.
std::vector<int32_t> distinct(int64_t n, int64_t k, std::mt19937& rng) {
    std::vector<int32_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    for (int64_t i = 0; i < k; ++i) {
        std::uniform_int_distribution<int64_t> pick(i, n - 1);
        std::swap(all[size_t(i)], all[size_t(pick(rng))]);
    }
    all.resize(size_t(k));
    return all;
}

namespace {

// ---- elementwise, norms, rope ------------------------------------------------------------------------

OpCase embedding_case(int64_t vocab, int64_t hidden, int64_t T, DType table_dtype, uint32_t seed) {
    return make_case(XINFER_OP_EMBEDDING,
                     fmt::format("embedding(V={}, H={}, T={}, table={})", vocab, hidden, T, dtype_name(table_dtype)),
                     kExact, [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_EMBEDDING);
                         d.tensors.push_back(fixed_input("table", src(0), table_dtype, {vocab, hidden}, rng, -1.f, 1.f));
                         std::vector<int32_t> ids(static_cast<size_t>(T));
                         std::uniform_int_distribution<int32_t> token(0, int32_t(vocab - 1));
                         for (int32_t& id : ids) id = token(rng);
                         ids[0] = int32_t(vocab - 1);  // the last row is where off-by-one reads show
                         d.tensors.push_back(i32_input("ids", src(1), {T}, ids));
                         CaseTensor out = act_output("out", dst(0), {T, hidden});
                         out.compare = Compare::exact;
                         d.tensors.push_back(out);
                         return d;
                     });
}

OpCase rmsnorm_case(int64_t rows, int64_t n, DType w_dtype, float eps, uint32_t seed) {
    return make_case(XINFER_OP_RMSNORM,
                     fmt::format("rmsnorm(rows={}, n={}, w={}, eps={:g})", rows, n, dtype_name(w_dtype), eps),
                     kElementwise, [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_RMSNORM);
                         d.op.params.norm.eps = eps;
                         d.tensors.push_back(act_input("x", src(0), {rows, n}, rng, -3.f, 3.f));
                         d.tensors.push_back(fixed_input("weight", src(1), w_dtype, {n}, rng, 0.5f, 1.5f));
                         d.tensors.push_back(act_output("out", dst(0), {rows, n}));
                         return d;
                     });
}

OpCase add_rmsnorm_case(int64_t rows, int64_t n, DType w_dtype, uint32_t seed) {
    return make_case(XINFER_OP_ADD_RMSNORM,
                     fmt::format("add_rmsnorm(rows={}, n={}, w={})", rows, n, dtype_name(w_dtype)), kElementwise, [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_ADD_RMSNORM);
                         d.op.params.norm.eps = 1e-6f;
                         d.tensors.push_back(act_inout("residual", src(0), {rows, n}, rng, -3.f, 3.f));
                         d.tensors.push_back(act_input("x", src(1), {rows, n}, rng));
                         d.tensors.push_back(fixed_input("weight", src(2), w_dtype, {n}, rng, 0.5f, 1.5f));
                         d.tensors.push_back(act_output("out", dst(0), {rows, n}));
                         return d;
                     });
}

OpCase rope_case(int64_t T, int64_t heads, int64_t head_dim, int rotary_dim, float theta, int32_t max_position,
                 uint32_t seed) {
    return make_case(XINFER_OP_ROPE,
                     fmt::format("rope(T={}, heads={}, D={}, rotary={}, theta={:g}, positions<={})", T, heads,
                                 head_dim, rotary_dim, theta, max_position),
                     kElementwise, [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_ROPE);
                         d.op.params.rope.rotary_dim = rotary_dim;
                         d.op.params.rope.theta = theta;
                         d.tensors.push_back(act_inout("x", src(0), {T, heads, head_dim}, rng));
                         std::vector<int32_t> positions(static_cast<size_t>(T));
                         std::uniform_int_distribution<int32_t> position(0, max_position);
                         for (int32_t& p : positions) p = position(rng);
                         positions.back() = max_position;
                         d.tensors.push_back(i32_input("positions", src(1), {T}, positions));
                         return d;
                     });
}

OpCase swiglu_case(int64_t T, int64_t I, uint32_t seed) {
    return make_case(XINFER_OP_SWIGLU, fmt::format("swiglu(T={}, I={})", T, I), kElementwise, [=] {
        std::mt19937 rng(seed);
        CaseData d = start(XINFER_OP_SWIGLU);
        d.tensors.push_back(act_input("gate_up", src(0), {T, 2 * I}, rng, -4.f, 4.f));
        d.tensors.push_back(act_output("out", dst(0), {T, I}));
        return d;
    });
}

OpCase scale_case(int64_t rows, int64_t n, float factor, uint32_t seed) {
    return make_case(XINFER_OP_SCALE, fmt::format("scale(rows={}, n={}, factor={:g})", rows, n, factor), kElementwise,
                     [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_SCALE);
                         d.op.params.scale.factor = factor;
                         d.tensors.push_back(act_inout("x", src(0), {rows, n}, rng, -2.f, 2.f));
                         return d;
                     });
}

OpCase add_case(int64_t rows, int64_t n, uint32_t seed) {
    return make_case(XINFER_OP_ADD, fmt::format("add(rows={}, n={})", rows, n), kElementwise, [=] {
        std::mt19937 rng(seed);
        CaseData d = start(XINFER_OP_ADD);
        d.tensors.push_back(act_inout("x", src(0), {rows, n}, rng, -2.f, 2.f));
        d.tensors.push_back(act_input("y", src(1), {rows, n}, rng));
        return d;
    });
}

OpCase convert_case(DType from, DType to, int64_t rows, int64_t n, uint32_t seed) {
    return make_case(XINFER_OP_CONVERT,
                     fmt::format("convert({} -> {}, rows={}, n={})", dtype_name(from), dtype_name(to), rows, n), kExact,
                     [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_CONVERT);
                         d.tensors.push_back(fixed_input("src", src(0), from, {rows, n}, rng, -100.f, 100.f));
                         d.tensors.push_back(fixed_output("dst", dst(0), to, {rows, n}, Compare::exact));
                         return d;
                     });
}

// ---- matmul and MoE --------------------------------------------------------------------------------

}  // namespace

OpCase matmul_case(int64_t T, int64_t N, int64_t K, DType w_dtype, uint32_t seed) {
    return make_case(XINFER_OP_MATMUL, fmt::format("matmul(T={}, N={}, K={}, w={})", T, N, K, dtype_name(w_dtype)),
                     kMatmul, [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_MATMUL);
                         const float a = std::sqrt(3.f / float(K));  // unit-variance outputs
                         d.tensors.push_back(act_input("x", src(0), {T, K}, rng));
                         d.tensors.push_back(fixed_input("w", src(1), w_dtype, {N, K}, rng, -a, a));
                         d.tensors.push_back(act_output("y", dst(0), {T, N}));
                         return d;
                     });
}

namespace {

struct RouteSpec {
    int64_t T, E;
    bool sigmoid, bias;
    int n_group, topk_group, top_k;
    bool norm;
    float scaling;
    bool ties;  // logits on a coarse grid, so many scores tie
    uint32_t seed;
};

OpCase moe_route_case(const RouteSpec& s) {
    std::string mode = s.sigmoid ? "sigmoid" : "softmax";
    if (s.bias) mode += "+bias";
    if (s.n_group > 1) mode += fmt::format(", groups={}/{}", s.topk_group, s.n_group);
    if (s.norm) mode += ", norm";
    if (s.scaling != 1.f) mode += fmt::format(", scale={:g}", s.scaling);
    if (s.ties) mode += ", ties";
    return make_case(XINFER_OP_MOE_ROUTE, fmt::format("moe_route(T={}, E={}, top_k={}, {})", s.T, s.E, s.top_k, mode),
                     kRouter, [s] {
                         std::mt19937 rng(s.seed);
                         CaseData d = start(XINFER_OP_MOE_ROUTE);
                         xinfer_route_params& p = d.op.params.route;
                         p.scoring = s.sigmoid ? 1 : 0;
                         p.top_k = s.top_k;
                         p.n_group = s.n_group;
                         p.topk_group = s.topk_group;
                         p.norm_topk_prob = s.norm ? 1 : 0;
                         p.routed_scaling_factor = s.scaling;
                         CaseTensor logits = fixed_input("logits", src(0), DType::f32, {s.T, s.E}, rng, -4.f, 4.f);
                         if (s.ties)
                             for (float& v : logits.values) v = std::round(v * 2.f) / 2.f;
                         d.tensors.push_back(logits);
                         if (s.bias) {
                             CaseTensor bias = fixed_input("bias", src(1), DType::f32, {s.E}, rng, -0.3f, 0.3f);
                             if (s.ties)
                                 for (float& v : bias.values) v = std::round(v * 8.f) / 8.f;
                             d.tensors.push_back(bias);
                         }
                         d.tensors.push_back(i32_output("ids", dst(0), {s.T, s.top_k}));
                         d.tensors.push_back(fixed_output("weights", dst(1), DType::f32, {s.T, s.top_k}, Compare::nmse));
                         return d;
                     });
}

// Expert e with weight 1 / (e + 1)^zipf: k distinct ones, by Efraimidis-Spirakis keys u^(1/weight).
std::vector<int32_t> distinct_skewed(int64_t n, int64_t k, double zipf, std::mt19937& rng) {
    std::uniform_real_distribution<double> u(1e-12, 1.0);
    std::vector<std::pair<double, int32_t>> keyed;
    for (int64_t e = 0; e < n; ++e) keyed.emplace_back(std::pow(u(rng), std::pow(double(e + 1), zipf)), int32_t(e));
    std::partial_sort(keyed.begin(), keyed.begin() + k, keyed.end(), std::greater<>());
    std::vector<int32_t> chosen;
    for (int64_t i = 0; i < k; ++i) chosen.push_back(keyed[size_t(i)].second);
    return chosen;
}

// MOE_EXPERTS routing inputs: each token's top_k distinct experts (src 1) and weights summing
// to 1 (src 2), as a router with norm_topk_prob would give them. zipf > 0 skews the choice toward
// low expert ids, as the dummy-weight serving bench routes (2.5: 64 tokens touch ~26 of 32 experts,
// the busiest picked by every token).
void push_routing(CaseData& d, int64_t T, int64_t E, int64_t top_k, std::mt19937& rng, double zipf = 0) {
    std::vector<int32_t> ids;
    std::vector<float> weights;
    for (int64_t t = 0; t < T; ++t) {
        const std::vector<int32_t> chosen = zipf > 0 ? distinct_skewed(E, top_k, zipf, rng) : distinct(E, top_k, rng);
        ids.insert(ids.end(), chosen.begin(), chosen.end());
        std::vector<float> w = uniform(top_k, rng, 0.1f, 1.f);
        const float sum = std::accumulate(w.begin(), w.end(), 0.f);
        for (float v : w) weights.push_back(v / sum);
    }
    d.tensors.push_back(i32_input("ids", src(1), {T, top_k}, ids));
    d.tensors.push_back(fixed_values("weights", src(2), DType::f32, {T, top_k}, weights));
}

OpCase moe_experts_case(int64_t T, int64_t H, int64_t I, int64_t E, int64_t top_k, DType w_dtype, uint32_t seed,
                        double zipf = 0) {
    return make_case(XINFER_OP_MOE_EXPERTS,
                     fmt::format("moe_experts(T={}, H={}, I={}, E={}, top_k={}, w={}{})", T, H, I, E, top_k,
                                 dtype_name(w_dtype), zipf > 0 ? fmt::format(", zipf {}", zipf) : ""),
                     kMoeExperts, [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_MOE_EXPERTS);
                         d.tensors.push_back(act_input("x", src(0), {T, H}, rng));
                         push_routing(d, T, E, top_k, rng, zipf);
                         const float a_gate = std::sqrt(3.f / float(H)) * 2.f, a_down = std::sqrt(3.f / float(I));
                         d.tensors.push_back(fixed_input("gate_up", src(3), w_dtype, {E, 2 * I, H}, rng, -a_gate, a_gate));
                         d.tensors.push_back(fixed_input("down", src(4), w_dtype, {E, H, I}, rng, -a_down, a_down));
                         d.tensors.push_back(act_output("out", dst(0), {T, H}));
                         return d;
                     });
}

// ---- FP8 block-scaled experts (plugins/cuda/moe.cu grouped path; the CPU dequantizes) ----------------

// A finite e4m3 code, every one equally likely (zeros and subnormals included; 0x7f/0xff are NaN).
uint8_t random_e4m3(std::mt19937& rng) {
    const int b = std::uniform_int_distribution<int>(0, 253)(rng);
    return uint8_t(b >= 0x7f ? b + 1 : b);
}

// One f8_e4m3 expert weight [E, rows, cols] with its f32 block scales [E, ceil(rows/br), ceil(cols/bc)]:
// e4m3 values spread over their whole range, scales of magnitude a/448 (so W ~ U(±a)), different per
// block. Correctness shapes are raw bytes built here; perf shapes are filled on the device.
void push_fp8_expert(CaseData& d, const char* name, int weight_slot, int scale_slot, int64_t E, int64_t rows,
                     int64_t cols, int64_t br, int64_t bc, float a, std::mt19937& rng) {
    CaseTensor w = make_tensor(name, src(weight_slot), Access::input, false, DType::f8_e4m3, {E, rows, cols});
    if (w.numel() > kMaxHostValues) {
        w.bulk_random = 448.f;
    } else {
        w.raw.resize(size_t(w.numel()));
        for (uint8_t& b : w.raw) b = random_e4m3(rng);
    }
    d.tensors.push_back(std::move(w));
    const int64_t scale_rows = (rows + br - 1) / br, scale_cols = (cols + bc - 1) / bc;
    d.tensors.push_back(fixed_input(std::string(name) + "_scale", src(scale_slot), DType::f32, {E, scale_rows, scale_cols},
                                    rng, 0.5f * a / 448.f, 1.5f * a / 448.f));
}

OpCase moe_experts_fp8_case(int64_t T, int64_t H, int64_t I, int64_t E, int64_t top_k, int64_t br, int64_t bc,
                            uint32_t seed) {
    return make_case(XINFER_OP_MOE_EXPERTS,
                     fmt::format("moe_experts(T={}, H={}, I={}, E={}, top_k={}, w=f8_e4m3, blocks={}x{})", T, H, I, E,
                                 top_k, br, bc),
                     kMoeExperts, [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_MOE_EXPERTS);
                         d.op.params.matmul.block_rows = int32_t(br);
                         d.op.params.matmul.block_cols = int32_t(bc);
                         d.tensors.push_back(act_input("x", src(0), {T, H}, rng));
                         push_routing(d, T, E, top_k, rng);
                         const float a_gate = std::sqrt(3.f / float(H)) * 2.f, a_down = std::sqrt(3.f / float(I));
                         push_fp8_expert(d, "gate_up", 3, 5, E, 2 * I, H, br, bc, a_gate, rng);
                         push_fp8_expert(d, "down", 4, 6, E, H, I, br, bc, a_down, rng);
                         d.tensors.push_back(act_output("out", dst(0), {T, H}));
                         return d;
                     });
}

// The router and the experts as one op (MOE_ROUTE_EXPERTS): router logits and bias as a MoE layer's
// router gives them (sigmoid + bias as MiMo routes, or softmax), then bf16 or fp8 (128x128 blocks) experts.
struct RouteExpertsSpec {
    int64_t T, H, I, E, top_k;
    bool fp8, sigmoid;
    uint32_t seed;
};

OpCase moe_route_experts_case(const RouteExpertsSpec& s) {
    return make_case(XINFER_OP_MOE_ROUTE_EXPERTS,
                     fmt::format("moe_route_experts(T={}, H={}, I={}, E={}, top_k={}, w={}, {})", s.T, s.H, s.I, s.E,
                                 s.top_k, s.fp8 ? "f8_e4m3, blocks=128x128" : "bf16",
                                 s.sigmoid ? "sigmoid+bias, norm" : "softmax"),
                     kMoeExperts, [s] {
                         std::mt19937 rng(s.seed);
                         CaseData d = start(XINFER_OP_MOE_ROUTE_EXPERTS);
                         auto& p = d.op.params.route_experts;
                         p.route.scoring = s.sigmoid ? 1 : 0;
                         p.route.top_k = int32_t(s.top_k);
                         p.route.n_group = p.route.topk_group = 1;
                         p.route.norm_topk_prob = s.sigmoid ? 1 : 0;
                         p.route.routed_scaling_factor = 1.f;
                         p.block_rows = p.block_cols = 128;
                         d.tensors.push_back(act_input("x", src(0), {s.T, s.H}, rng));
                         d.tensors.push_back(fixed_input("logits", src(1), DType::f32, {s.T, s.E}, rng, -4.f, 4.f));
                         if (s.sigmoid) d.tensors.push_back(fixed_input("bias", src(2), DType::f32, {s.E}, rng, -0.3f, 0.3f));
                         const float a_gate = std::sqrt(3.f / float(s.H)) * 2.f, a_down = std::sqrt(3.f / float(s.I));
                         if (s.fp8) {
                             push_fp8_expert(d, "gate_up", 3, 5, s.E, 2 * s.I, s.H, 128, 128, a_gate, rng);
                             push_fp8_expert(d, "down", 4, 6, s.E, s.H, s.I, 128, 128, a_down, rng);
                         } else {
                             d.tensors.push_back(fixed_input("gate_up", src(3), DType::bf16, {s.E, 2 * s.I, s.H}, rng,
                                                             -a_gate, a_gate));
                             d.tensors.push_back(fixed_input("down", src(4), DType::bf16, {s.E, s.H, s.I}, rng, -a_down, a_down));
                         }
                         d.tensors.push_back(act_output("out", dst(0), {s.T, s.H}));
                         return d;
                     });
}

// ---- dense few-token matmuls (plugins/cuda/gemm.cu stream_gemv_kernel) ------------------------------

// A dense f8_e4m3 weight [N, K] in src slot `weight_slot`, with f32 block scales [shards ·
// ceil(N / shards / br), ceil(K / bc)] in `scale_slot` (a grid that restarts every N / shards rows,
// as tensor-parallel exports write it). The device gets the e4m3 bytes and scales; the reference
// (no fp8 MATMUL) gets the same weights dequantized to f32. `perf`: bytes filled on the device, no
// reference tensor.
void push_fp8_matrix(CaseData& d, int weight_slot, int scale_slot, int64_t N, int64_t K, int64_t br, int64_t bc,
                     int64_t shards, bool perf, uint32_t seed, std::mt19937& rng) {
    const int64_t shard_rows = N / shards, per_shard = (shard_rows + br - 1) / br;
    const int64_t scale_cols = (K + bc - 1) / bc;
    const float a = std::sqrt(3.f / float(K));
    CaseTensor scale = fixed_input("w_scale", src(scale_slot), DType::f32, {shards * per_shard, scale_cols}, rng,
                                   0.5f * a / 448.f, 1.5f * a / 448.f);
    scale.side = CaseTensor::Side::device;
    CaseTensor w = make_tensor("w", src(weight_slot), Access::input, false, DType::f8_e4m3, {N, K});
    w.side = CaseTensor::Side::device;
    if (perf) {
        w.bulk_random = 448.f;
    } else {
        // Every finite e4m3 code equally likely (a cheap hash: shapes reach 134M bytes).
        w.raw.resize(size_t(N * K));
        uint64_t h = seed * 0x9E3779B97F4A7C15ull + 1;
        for (uint8_t& b : w.raw) {
            h ^= h << 13;
            h ^= h >> 7;
            h ^= h << 17;
            const int code = int((h >> 24) % 254);
            b = uint8_t(code >= 0x7f ? code + 1 : code);
        }
        std::vector<float> dequantized(size_t(N * K));
        for (int64_t r = 0; r < N; ++r) {
            const float* srow = scale.values.data() + ((r / shard_rows) * per_shard + (r % shard_rows) / br) * scale_cols;
            for (int64_t k = 0; k < K; ++k)
                dequantized[size_t(r * K + k)] = cpu::e4m3_to_f32(w.raw[size_t(r * K + k)]) * srow[k / bc];
        }
        CaseTensor ref = fixed_values("w", src(weight_slot), DType::f32, {N, K}, std::move(dequantized));
        ref.side = CaseTensor::Side::reference;
        d.tensors.push_back(std::move(ref));
    }
    d.tensors.push_back(std::move(w));
    d.tensors.push_back(std::move(scale));
}

// Dense MATMUL with f8_e4m3 weights (push_fp8_matrix). `perf`: weights filled on the device, no
// reference tensor.
OpCase matmul_fp8_case(int64_t T, int64_t N, int64_t K, int64_t br, int64_t bc, int64_t shards, bool perf,
                       uint32_t seed) {
    std::string blocks = fmt::format("blocks={}x{}", br, bc);
    if (shards > 1) blocks += fmt::format(", shards={}", shards);
    return make_case(XINFER_OP_MATMUL, fmt::format("matmul(T={}, N={}, K={}, w=f8_e4m3, {})", T, N, K, blocks), kMatmul,
                     [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_MATMUL);
                         d.op.params.matmul.block_rows = int32_t(br);
                         d.op.params.matmul.block_cols = int32_t(bc);
                         d.tensors.push_back(act_input("x", src(0), {T, K}, rng));
                         push_fp8_matrix(d, 1, 2, N, K, br, bc, shards, perf, seed, rng);
                         d.tensors.push_back(act_output("y", dst(0), {T, N}));
                         return d;
                     });
}

// The norm before a projection (ADD_RMSNORM_MATMUL; without x, RMSNORM then MATMUL) against the
// CPU's two ops: y, normed, and the residual (updated in place with x, unchanged without). One
// tolerance per case, the matmul's, which is also the norms'. Norm weights are f32, as the models
// keep them; f32 projection weights are a router's, whose logits are f32 whatever the activations;
// f8_e4m3 weights take 128×128 block scales (push_fp8_matrix).
OpCase add_rmsnorm_matmul_case(int64_t rows, int64_t K, int64_t N, DType w_dtype, bool with_x, uint32_t seed) {
    const bool fp8 = w_dtype == DType::f8_e4m3, router = w_dtype == DType::f32;
    return make_case(XINFER_OP_ADD_RMSNORM_MATMUL,
                     fmt::format("add_rmsnorm_matmul(rows={}, K={}, N={}, w={}{}, {})", rows, K, N, dtype_name(w_dtype),
                                 fp8 ? ", blocks=128x128" : router ? ", y=f32" : "", with_x ? "x" : "no x"),
                     kMatmul, [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_ADD_RMSNORM_MATMUL);
                         d.op.params.norm_matmul.eps = 1e-6f;
                         d.tensors.push_back(act_inout("residual", src(0), {rows, K}, rng, -3.f, 3.f));
                         if (with_x) d.tensors.push_back(act_input("x", src(1), {rows, K}, rng));
                         d.tensors.push_back(fixed_input("norm_weight", src(2), DType::f32, {K}, rng, 0.5f, 1.5f));
                         if (fp8) {
                             d.op.params.norm_matmul.block_rows = d.op.params.norm_matmul.block_cols = 128;
                             push_fp8_matrix(d, 3, 4, N, K, 128, 128, 1, false, seed, rng);
                         } else {
                             const float a = std::sqrt(3.f / float(K));  // unit-variance outputs
                             d.tensors.push_back(fixed_input("w", src(3), w_dtype, {N, K}, rng, -a, a));
                         }
                         d.tensors.push_back(router ? fixed_output("y", dst(0), DType::f32, {rows, N}, Compare::nmse)
                                                    : act_output("y", dst(0), {rows, N}));
                         d.tensors.push_back(act_output("normed", dst(1), {rows, K}));
                         return d;
                     });
}

// MiMo-V2-Flash decode matmuls [N, K]: q, k (SWA / GA), v (SWA / GA), o, dense gate_up, down, and
// a sliding layer's fused q|k|v.
constexpr std::pair<int64_t, int64_t> kDecodeMatmuls[] = {{12288, 4096}, {1536, 4096},  {768, 4096},
                                                          {1024, 4096},  {512, 4096},   {4096, 8192},
                                                          {32768, 4096}, {4096, 16384}, {14848, 4096}};

// Correctness (XINFER_OPS_TEST_DECODE_MATMULS=1): those shapes at T = 1, 3, 8 in bf16 and fp8 (128×128 blocks; k 768 also as the GA
// layer's grid restarting every 192-row head shard), partial blocks, 48- and 100-column blocks,
// lm_head at T = 1, f32-weight routers E × 4096.
void add_decode_matmul_cases(std::vector<OpCase>& cases, uint32_t& seed) {
    for (int T : {1, 3, 8}) {
        for (auto [N, K] : kDecodeMatmuls) {
            cases.push_back(matmul_case(T, N, K, DType::bf16, ++seed));
            cases.push_back(matmul_fp8_case(T, N, K, 128, 128, 1, false, ++seed));
        }
        cases.push_back(matmul_fp8_case(T, 768, 4096, 128, 128, 4, false, ++seed));
        for (int64_t E : {8, 32, 256}) cases.push_back(matmul_case(T, E, 4096, DType::f32, ++seed));
    }
    cases.push_back(matmul_fp8_case(3, 1000, 4160, 128, 128, 1, false, ++seed));  // partial row and column blocks
    cases.push_back(matmul_fp8_case(5, 1000, 4160, 128, 128, 5, false, ++seed));  // 200-row shards, partial blocks
    cases.push_back(matmul_fp8_case(3, 512, 4096, 128, 48, 1, false, ++seed));
    cases.push_back(matmul_fp8_case(2, 300, 4000, 128, 100, 1, false, ++seed));   // a chunk straddles two scales
    // FP8 GEMVs with enough rows for the tensor-core path on cuda (gemm.cu mma_gemv_kernel:
    // ≥ 64 rows per SM): a partial last tile and 64-column chunk, 64-column blocks, 1 to 8 tokens,
    // and a scale grid restarting every 2,176-row shard.
    for (int T : {1, 5, 8}) cases.push_back(matmul_fp8_case(T, 8464, 1104, 128, 128, 1, false, ++seed));
    cases.push_back(matmul_fp8_case(1, 8464, 1104, 128, 64, 1, false, ++seed));
    cases.push_back(matmul_fp8_case(2, 8704, 1040, 128, 128, 4, false, ++seed));
    // One token, rows that end inside a 16-row tile, whole 256-byte rounds of K.
    cases.push_back(matmul_fp8_case(1, 8456, 1024, 128, 128, 1, false, ++seed));
    cases.push_back(matmul_case(1, 152576, 4096, DType::bf16, ++seed));          // lm_head
    // Prefill-sized FP8 (≥ 512 rows: the weight widened to bf16, then cuBLASLt on cuda): a
    // head-sharded scale grid with partial blocks, and 48-column blocks.
    cases.push_back(matmul_fp8_case(600, 1000, 4160, 128, 128, 5, false, ++seed));
    cases.push_back(matmul_fp8_case(520, 512, 4096, 128, 48, 1, false, ++seed));
    // The norm fused with an FP8 projection: a sliding layer's q|k|v at one token (64·192 + 8·192 +
    // 8·128 rows), and partial row and column blocks at three.
    cases.push_back(add_rmsnorm_matmul_case(1, 4096, 14848, DType::f8_e4m3, true, ++seed));
    cases.push_back(add_rmsnorm_matmul_case(3, 4160, 1000, DType::f8_e4m3, true, ++seed));
    // One FP8 row with enough rows for cuda's tensor-core GEMV (≥ 64 a SM), a partial last tile and
    // 64-column chunk, with and without x (layer 0): the norm inside mma_gemv_kernel.
    for (bool with_x : {true, false})
        cases.push_back(add_rmsnorm_matmul_case(1, 1104, 8464, DType::f8_e4m3, with_x, ++seed));
}

// Perf: the same shapes at T = 1, 3, 8 (bf16, fp8), lm_head at T = 1 and 8, routers; serving batches.
void add_decode_matmul_perf_cases(std::vector<OpCase>& cases, uint32_t& seed) {
    for (int T : {1, 3, 8}) {
        for (auto [N, K] : kDecodeMatmuls) {
            cases.push_back(matmul_case(T, N, K, DType::bf16, ++seed));
            cases.push_back(matmul_fp8_case(T, N, K, 128, 128, 1, true, ++seed));
        }
        for (int64_t E : {8, 32, 256}) cases.push_back(matmul_case(T, E, 4096, DType::f32, ++seed));
    }
    // Serving decode batches (concurrency 16-64): bf16 projections.
    for (int T : {16, 64}) {
        for (auto [N, K] : kDecodeMatmuls) cases.push_back(matmul_case(T, N, K, DType::bf16, ++seed));
        cases.push_back(matmul_case(T, 32, 4096, DType::f32, ++seed));  // the e32 bench model's router
    }
    for (int T : {1, 8}) {
        cases.push_back(matmul_case(T, 152576, 4096, DType::bf16, ++seed));
        cases.push_back(matmul_fp8_case(T, 152576, 4096, 128, 128, 1, true, ++seed));
    }
}

// ---- sampling ------------------------------------------------------------------------------------------

OpCase argmax_case(int64_t rows, int64_t vocab, bool ties, uint32_t seed) {
    return make_case(XINFER_OP_ARGMAX, fmt::format("argmax(rows={}, V={}{})", rows, vocab, ties ? ", ties" : ""),
                     kExact, [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_ARGMAX);
                         CaseTensor logits = act_input("logits", src(0), {rows, vocab}, rng, -8.f, 8.f);
                         if (ties)  // few distinct values: the maximum repeats within every row
                             for (float& v : logits.values) v = std::round(v / 4.f);
                         d.tensors.push_back(logits);
                         d.tensors.push_back(i32_output("ids", dst(0), {rows}));
                         return d;
                     });
}

OpCase sample_case(int64_t rows, int64_t vocab, uint32_t seed) {
    return make_case(XINFER_OP_SAMPLE, fmt::format("sample(rows={}, V={}, temperature/top-k/top-p mix)", rows, vocab),
                     kExact, [=] {
                         std::mt19937 rng(seed);
                         CaseData d = start(XINFER_OP_SAMPLE);
                         d.tensors.push_back(act_input("logits", src(0), {rows, vocab}, rng, -6.f, 6.f));
                         // Row r uses setting r % 7: greedy, plain, top-k, top-p, both, top-k 1, low temperature.
                         const float temperatures[7] = {0.f, 1.f, 0.8f, 1.2f, 0.7f, 1.f, 0.3f};
                         const float top_ps[7] = {1.f, 1.f, 1.f, 0.9f, 0.8f, 1.f, 0.95f};
                         const int32_t top_ks[7] = {0, 0, 50, 0, 20, 1, 0};
                         std::vector<float> temperature, top_p, draws = uniform(rows, rng, 0.f, 0.999f);
                         std::vector<int32_t> top_k;
                         for (int64_t r = 0; r < rows; ++r) {
                             temperature.push_back(temperatures[r % 7]);
                             top_p.push_back(top_ps[r % 7]);
                             top_k.push_back(top_ks[r % 7]);
                         }
                         d.tensors.push_back(fixed_values("temperature", src(1), DType::f32, {rows}, temperature));
                         d.tensors.push_back(fixed_values("top_p", src(2), DType::f32, {rows}, top_p));
                         d.tensors.push_back(i32_input("top_k", src(3), {rows}, top_k));
                         d.tensors.push_back(fixed_values("uniform", src(4), DType::f32, {rows}, draws));
                         d.tensors.push_back(i32_output("ids", dst(0), {rows}));
                         return d;
                     });
}

// ---- running -------------------------------------------------------------------------------------------

float round_to(DType dtype, float v) {
    if (dtype == DType::bf16) return bf16_to_f32(f32_to_bf16(v));
    if (dtype == DType::f16) return f16_to_f32(f32_to_f16(v));
    return v;
}

bool is_float(DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16; }

// dtype of tensor t on one side: activations are `activation` on the device, f32 on the reference.
DType side_dtype(const CaseTensor& t, DType activation, bool reference_side) {
    if (!t.activation) return t.dtype;
    return reference_side ? DType::f32 : activation;
}

// dtype the tensor's values are rounded to before either side sees them.
DType value_dtype(const CaseTensor& t, DType activation) { return t.activation ? activation : t.dtype; }

xinfer_tensor* slot_in(xinfer_op& op, const Slot& slot) {
    switch (slot.kind) {
        case Slot::src: return &op.src[slot.index];
        case Slot::dst: return &op.dst[slot.index];
        case Slot::cu_q_lens: return &op.batch.cu_q_lens;
        case Slot::kv_lens: return &op.batch.kv_lens;
        case Slot::positions: return &op.batch.positions;
        case Slot::page_table: return &op.batch.page_table;
        case Slot::slot_mapping: return &op.batch.slot_mapping;
        case Slot::none: return nullptr;
    }
    return nullptr;
}

bool on_side(const CaseTensor& t, bool reference_side) {
    return t.side == CaseTensor::Side::both || (t.side == CaseTensor::Side::reference) == reference_side;
}

xinfer_op build_op(const CaseData& data, DType activation, bool reference_side, const std::vector<void*>& pointers) {
    xinfer_op op = data.op;
    for (size_t i = 0; i < data.tensors.size(); ++i) {
        const CaseTensor& t = data.tensors[i];
        xinfer_tensor* out = slot_in(op, t.slot);
        if (!out || !on_side(t, reference_side)) continue;
        *out = xinfer_tensor{};
        out->data = pointers.empty() ? nullptr : pointers[i];
        out->dtype = int32_t(side_dtype(t, activation, reference_side));
        out->rank = int32_t(t.shape.size());
        for (size_t k = 0; k < t.shape.size(); ++k) out->shape[k] = t.shape[k];
    }
    return op;
}

const CaseTensor* find_slot(const CaseData& data, Slot::Kind kind, int index = 0) {
    for (const CaseTensor& t : data.tensors)
        if (t.slot.kind == kind && t.slot.index == index) return &t;
    return nullptr;
}

}  // namespace

int64_t CaseTensor::numel() const { return product(shape); }
size_t CaseTensor::bytes(DType dtype) const { return raw.empty() ? size_t(numel()) * dtype_size(dtype) : raw.size(); }

double Tolerance::for_class(DType precision) const {
    switch (precision) {
        case DType::bf16: return bf16;
        case DType::f16: return f16;
        default: return f32;
    }
}

// ---- the grids ----------------------------------------------------------------------------------------------

std::vector<OpCase> correctness_cases() {
    std::vector<OpCase> cases;
    uint32_t seed = 1000;
    const DType f32 = DType::f32, bf16 = DType::bf16, f16 = DType::f16;

    for (auto [V, H, T, dtype] : {std::tuple{997, 259, 7, f32}, std::tuple{997, 259, 33, bf16},
                                  std::tuple{50, 4096, 1, bf16}, std::tuple{300, 128, 5, f16}})
        cases.push_back(embedding_case(V, H, T, dtype, ++seed));

    for (auto [rows, n, dtype] : {std::tuple{1, 4096, bf16}, std::tuple{7, 259, f32}, std::tuple{33, 1000, bf16},
                                  std::tuple{512, 64, f32}, std::tuple{5, 4095, f16}, std::tuple{3, 5000, bf16}})
        cases.push_back(rmsnorm_case(rows, n, dtype, 1e-6f, ++seed));
    // (rows wider than 4096 take more than one pass of a block's threads on cuda)
    for (auto [rows, n, dtype] : {std::tuple{1, 4096, bf16}, std::tuple{7, 259, f32}, std::tuple{33, 1000, bf16},
                                  std::tuple{2, 8200, bf16}})
        cases.push_back(add_rmsnorm_case(rows, n, dtype, ++seed));

    // RoPE: full and partial rotary, MiMo's theta and head dims, positions up to 256K.
    cases.push_back(rope_case(7, 4, 24, 24, 1e4f, 100, ++seed));
    cases.push_back(rope_case(5, 3, 192, 64, 5e6f, 262143, ++seed));
    cases.push_back(rope_case(33, 8, 128, 128, 1e6f, 200000, ++seed));
    cases.push_back(rope_case(1, 64, 192, 64, 5e6f, 200001, ++seed));
    cases.push_back(rope_case(19, 2, 16, 8, 1e4f, 5000, ++seed));

    for (auto [T, I] : {std::pair{1, 2048}, std::pair{7, 259}, std::pair{33, 1000}}) cases.push_back(swiglu_case(T, I, ++seed));
    cases.push_back(scale_case(7, 259, 0.7f, ++seed));
    cases.push_back(scale_case(1, 4096, 1.5f, ++seed));
    cases.push_back(add_case(7, 259, ++seed));
    cases.push_back(add_case(33, 1000, ++seed));
    for (auto [from, to] : {std::pair{f32, bf16}, std::pair{bf16, f32}, std::pair{f32, f16}, std::pair{f16, f32},
                            std::pair{bf16, f16}, std::pair{f16, bf16}})
        cases.push_back(convert_case(from, to, 7, 259, ++seed));

    // Matmul: decode (GEMV), verify, prefill; odd N and K; f32 and bf16 weights (plus f16).
    for (int T : {1, 7, 33, 512})
        for (auto [N, K] : {std::pair{129, 255}, std::pair{1000, 1024}})
            for (DType w : {bf16, f32}) cases.push_back(matmul_case(T, N, K, w, ++seed));
    cases.push_back(matmul_case(1, 2049, 4096, bf16, ++seed));
    cases.push_back(matmul_case(17, 256, 512, f16, ++seed));
    // Few-row batches (verification, drafter blocks, small serving batches) of 2 to 16 rows, with
    // N and K off the usual tile multiples.
    cases.push_back(matmul_case(2, 300, 776, bf16, ++seed));
    cases.push_back(matmul_case(12, 1000, 1032, bf16, ++seed));
    cases.push_back(matmul_case(16, 40, 4096, bf16, ++seed));
    // Serving decode batches: 64 rows with an N tail, 2 rows, a sliding layer's k projection at 40 rows.
    cases.push_back(matmul_case(64, 200, 512, bf16, ++seed));
    cases.push_back(matmul_case(2, 384, 4096, bf16, ++seed));
    cases.push_back(matmul_case(40, 1536, 4096, bf16, ++seed));
    // f32-weight routers of serving batches (cuda: 8-row groups of the streaming GEMV, a partial last one).
    for (int T : {20, 64}) cases.push_back(matmul_case(T, 32, 4096, f32, ++seed));

    // Router: MiMo (sigmoid + bias, 256 experts, top 8), DeepSeek groups, softmax, ties.
    cases.push_back(moe_route_case({7, 256, true, true, 1, 1, 8, true, 2.5f, false, ++seed}));
    cases.push_back(moe_route_case({1, 256, true, true, 8, 4, 8, true, 2.5f, false, ++seed}));
    cases.push_back(moe_route_case({33, 64, true, true, 8, 3, 6, true, 1.f, false, ++seed}));
    cases.push_back(moe_route_case({100, 8, false, false, 1, 1, 2, false, 1.f, false, ++seed}));
    cases.push_back(moe_route_case({9, 160, false, false, 10, 4, 6, true, 1.f, false, ++seed}));
    cases.push_back(moe_route_case({20, 64, true, true, 1, 1, 8, true, 1.f, true, ++seed}));
    // Top-k over chunks of 32 experts (cuda route_token): a partial last chunk, top_k past 32, ties across chunks.
    cases.push_back(moe_route_case({3, 300, false, false, 1, 1, 40, true, 1.f, false, ++seed}));
    cases.push_back(moe_route_case({6, 256, true, true, 1, 1, 8, true, 2.5f, true, ++seed}));
    cases.push_back(moe_route_case({2, 1000, false, true, 1, 1, 64, false, 1.f, true, ++seed}));

    // Experts: decode and prefill-sized pair counts, odd widths, f32 experts.
    cases.push_back(moe_experts_case(1, 256, 128, 16, 4, bf16, ++seed));
    cases.push_back(moe_experts_case(7, 129, 67, 8, 2, bf16, ++seed));
    cases.push_back(moe_experts_case(33, 512, 256, 64, 8, bf16, ++seed));
    cases.push_back(moe_experts_case(100, 256, 128, 16, 4, bf16, ++seed));
    cases.push_back(moe_experts_case(20, 128, 64, 8, 2, f32, ++seed));

    // Rows from 8,192 entries on are reduced in slices on cuda (ties across slices: the lowest index).
    for (auto [rows, V, ties] : {std::tuple{7, 1000, false}, std::tuple{1, 152576, false}, std::tuple{7, 1000, true},
                                 std::tuple{3, 4097, false}, std::tuple{5, 20000, true}})
        cases.push_back(argmax_case(rows, V, ties, ++seed));
    cases.push_back(sample_case(14, 1000, ++seed));
    cases.push_back(sample_case(4, 152576, ++seed));

    cases.push_back(kv_store_case({7, {.n_pages = 8, .page_size = 16, .n_kv = 2, .dk = 192, .dv = 128}, ++seed}));
    cases.push_back(kv_store_case({33, {.n_pages = 5, .page_size = 16, .n_kv = 4, .dk = 24, .dv = 16}, ++seed}));
    cases.push_back(kv_store_case(
        {5, {.n_pages = 6, .page_size = 16, .n_kv = 8, .dk = 192, .dv = 128, .pool_layers = 3, .layer = 1, .pad = 8}, ++seed}));
    cases.push_back(
        kv_store_case({9, {.n_pages = 4, .page_size = 16, .n_kv = 1, .dk = 128, .dv = 128, .dtype = bf16}, ++seed}));
    // FP8 caches (e4m3 + one f32 scale per row): the stored bytes, scales included, must match exactly.
    const DType f8 = DType::f8_e4m3;
    cases.push_back(
        kv_store_case({7, {.n_pages = 8, .page_size = 16, .n_kv = 2, .dk = 192, .dv = 128, .dtype = f8}, ++seed}));
    cases.push_back(kv_store_case({5, {.n_pages = 6, .page_size = 16, .n_kv = 8, .dk = 192, .dv = 128, .pool_layers = 3,
                                       .layer = 1, .pad = 8, .dtype = f8}, ++seed}));
    cases.push_back(
        kv_store_case({33, {.n_pages = 6, .page_size = 7, .n_kv = 4, .dk = 24, .dv = 16, .dtype = f8}, ++seed}));
    // The fused attention prologue: MiMo's partial rotary (64 of 192) with a value scale at one
    // token and at 33; Qwen3's full rotary; an f32 cache; a pooled cache with an odd page size and
    // head counts.
    cases.push_back(rope_kv_store_case(
        {1, 64, 64, 5e6f, 0.707f, {.n_pages = 8, .page_size = 16, .n_kv = 8, .dk = 192, .dv = 128}, ++seed}));
    cases.push_back(rope_kv_store_case(
        {33, 16, 64, 1e4f, 0.707f, {.n_pages = 8, .page_size = 16, .n_kv = 4, .dk = 192, .dv = 128}, ++seed}));
    cases.push_back(rope_kv_store_case(
        {7, 8, 128, 1e6f, 1.f, {.n_pages = 4, .page_size = 16, .n_kv = 2, .dk = 128, .dv = 128, .dtype = bf16}, ++seed}));
    cases.push_back(rope_kv_store_case(
        {6, 4, 16, 1e4f, 2.f, {.n_pages = 5, .page_size = 16, .n_kv = 2, .dk = 24, .dv = 16, .dtype = DType::f32}, ++seed}));
    cases.push_back(rope_kv_store_case({9, 12, 32, 1e4f, 0.5f, {.n_pages = 6, .page_size = 7, .n_kv = 3, .dk = 40, .dv = 24,
                                                                .pool_layers = 3, .layer = 2, .pad = 8}, ++seed}));

    // Attention: every variant the models use. Page size 16 with shuffled tables throughout.
    auto attention = [&](AttentionSpec s) {
        s.seed = ++seed;
        cases.push_back(attention_case(s));
    };
    attention({.label = "decode", .q_lens = {1, 1, 1, 1}, .kv_lens = {1, 37, 300, 129}, .n_q = 16, .n_kv = 2, .dk = 192, .dv = 128});
    attention({.label = "chunks vs cache", .q_lens = {7, 32, 1, 13}, .kv_lens = {7, 95, 64, 300}, .n_q = 16, .n_kv = 1,
               .dk = 192, .dv = 128, .sinks = true});
    attention({.label = "prefill", .q_lens = {130}, .kv_lens = {130}, .n_q = 16, .n_kv = 2, .dk = 192, .dv = 128});
    attention({.label = "sliding", .q_lens = {1, 5, 32, 3}, .kv_lens = {200, 150, 161, 33}, .n_q = 16, .n_kv = 2,
               .dk = 192, .dv = 128, .window = 32, .sinks = true});
    attention({.label = "sliding small", .q_lens = {1, 9, 4}, .kv_lens = {80, 70, 16}, .n_q = 4, .n_kv = 4, .dk = 24,
               .dv = 16, .window = 16});
    attention({.label = "MiMo SWA verify", .q_lens = {32, 32}, .kv_lens = {600, 140}, .n_q = 16, .n_kv = 2, .dk = 192,
               .dv = 128, .window = 128, .sinks = true});
    attention({.label = "DFlash block", .q_lens = {16, 16}, .kv_lens = {100, 40}, .n_q = 16, .n_kv = 2, .dk = 128,
               .dv = 128, .window = 8, .causal = false});
    attention({.label = "non-causal", .q_lens = {16, 5}, .kv_lens = {60, 21}, .n_q = 16, .n_kv = 1, .dk = 192, .dv = 128,
               .causal = false, .sinks = true});
    attention({.label = "pool", .q_lens = {3, 1, 17}, .kv_lens = {50, 200, 17}, .n_q = 16, .n_kv = 2, .dk = 192,
               .dv = 128, .sinks = true, .pool_layers = 3, .layer = 1, .pad = 8});
    attention({.label = "pool sliding", .q_lens = {1, 8}, .kv_lens = {150, 90}, .n_q = 16, .n_kv = 1, .dk = 192,
               .dv = 128, .window = 32, .sinks = true, .pool_layers = 3, .layer = 2, .pad = 5});
    attention({.label = "small dims", .q_lens = {2, 7}, .kv_lens = {40, 7}, .n_q = 16, .n_kv = 1, .dk = 24, .dv = 16,
               .sinks = true});
    attention({.label = "bf16 cache", .q_lens = {5, 1}, .kv_lens = {70, 33}, .n_q = 16, .n_kv = 2, .dk = 192, .dv = 128,
               .sinks = true, .cache_dtype = bf16});
    attention({.label = "odd page", .q_lens = {3, 1}, .kv_lens = {60, 45}, .n_q = 8, .n_kv = 1, .dk = 192, .dv = 128,
               .window = 20, .sinks = true, .page_size = 7});
    attention({.label = "long decode", .q_lens = {1, 1}, .kv_lens = {2048, 1500}, .n_q = 16, .n_kv = 1, .dk = 192, .dv = 128});
    // Decode-shaped batches (cuda: per-warp key streams, attention_stream.cu): a pooled cache with
    // padded pages, sinks and a two-token row tile; a sliding window with sinks at GQA 16; Qwen3's
    // 128/128 heads at GQA 4 over several splits.
    attention({.label = "decode pool", .q_lens = {1, 1, 2}, .kv_lens = {700, 1, 333}, .n_q = 16, .n_kv = 2, .dk = 192,
               .dv = 128, .sinks = true, .pool_layers = 3, .layer = 1, .pad = 8});
    attention({.label = "decode sliding", .q_lens = {1, 1}, .kv_lens = {500, 90}, .n_q = 32, .n_kv = 2, .dk = 192,
               .dv = 128, .window = 128, .sinks = true});
    attention({.label = "decode qwen", .q_lens = {1, 1, 1}, .kv_lens = {1000, 17, 260}, .n_q = 16, .n_kv = 4, .dk = 128,
               .dv = 128});
    // Prefill chunks over cached prefixes (several 128-row tiles per sequence, GQA 16 and 1).
    attention({.label = "prefill chunks", .q_lens = {200, 77}, .kv_lens = {456, 77}, .n_q = 32, .n_kv = 2, .dk = 192,
               .dv = 128, .window = 128, .sinks = true});
    attention({.label = "prefill MHA", .q_lens = {150, 300}, .kv_lens = {150, 420}, .n_q = 2, .n_kv = 2, .dk = 128,
               .dv = 128});
    // FP8 caches: decode, prefill, chunks, sliding window with sinks, GQA 8/16, MHA, odd pages,
    // split-KV decode, non-causal, pooled like the runner's pages.
    attention({.label = "fp8 decode", .q_lens = {1, 1, 1, 1}, .kv_lens = {1, 37, 300, 129}, .n_q = 16, .n_kv = 2,
               .dk = 192, .dv = 128, .pool_layers = 2, .layer = 1, .cache_dtype = f8});
    attention({.label = "fp8 prefill", .q_lens = {130}, .kv_lens = {130}, .n_q = 16, .n_kv = 2, .dk = 192, .dv = 128,
               .cache_dtype = f8});
    attention({.label = "fp8 chunks vs cache", .q_lens = {7, 32, 1, 13}, .kv_lens = {7, 95, 64, 300}, .n_q = 16,
               .n_kv = 1, .dk = 192, .dv = 128, .cache_dtype = f8});
    attention({.label = "fp8 pool SWA", .q_lens = {1, 5, 32, 3}, .kv_lens = {200, 150, 161, 33}, .n_q = 16,
               .n_kv = 2, .dk = 192, .dv = 128, .window = 32, .sinks = true, .pool_layers = 3, .layer = 2, .pad = 8,
               .cache_dtype = f8});
    attention({.label = "fp8 small dims odd page", .q_lens = {2, 7, 1}, .kv_lens = {40, 7, 90}, .n_q = 4, .n_kv = 4,
               .dk = 24, .dv = 16, .window = 16, .sinks = true, .page_size = 7, .cache_dtype = f8});
    attention({.label = "fp8 long decode", .q_lens = {1, 1}, .kv_lens = {2048, 1500}, .n_q = 16, .n_kv = 1, .dk = 192,
               .dv = 128, .cache_dtype = f8});
    attention({.label = "fp8 non-causal", .q_lens = {16, 5}, .kv_lens = {60, 21}, .n_q = 16, .n_kv = 2, .dk = 128,
               .dv = 128, .window = 8, .causal = false, .cache_dtype = f8});
    attention({.label = "many seqs MHA", .q_lens = {1, 2, 3, 4, 5, 6}, .kv_lens = {6, 50, 33, 17, 90, 6}, .n_q = 4,
               .n_kv = 4, .dk = 128, .dv = 128});

    // Split-KV decode kernel (plugins/cuda/attention_decode.cu): 1/4/8/32 query tokens per
    // sequence over caches of many pages, GQA 8 and 16, sliding window + sinks, non-causal
    // blocks, small and odd dims, odd pages, f32 caches and unaligned pool strides (element path).
    attention({.label = "split decode GQA 8", .q_lens = {1, 1, 1}, .kv_lens = {700, 1900, 17}, .n_q = 64, .n_kv = 8,
               .dk = 192, .dv = 128});
    attention({.label = "split decode GQA 16", .q_lens = {1, 1}, .kv_lens = {3000, 1}, .n_q = 32, .n_kv = 2,
               .dk = 192, .dv = 128, .sinks = true});
    attention({.label = "split verify 4/8/32", .q_lens = {4, 8, 32}, .kv_lens = {500, 1200, 900}, .n_q = 16,
               .n_kv = 1, .dk = 192, .dv = 128, .sinks = true});
    attention({.label = "split sliding verify", .q_lens = {1, 32, 8}, .kv_lens = {2000, 700, 300}, .n_q = 16,
               .n_kv = 2, .dk = 192, .dv = 128, .window = 128, .sinks = true});
    attention({.label = "split non-causal block", .q_lens = {16, 16}, .kv_lens = {1000, 300}, .n_q = 32, .n_kv = 4,
               .dk = 128, .dv = 128, .causal = false});
    attention({.label = "split small dims odd page", .q_lens = {1, 3}, .kv_lens = {900, 400}, .n_q = 8, .n_kv = 1,
               .dk = 24, .dv = 16, .sinks = true, .page_size = 7});
    attention({.label = "split f32 cache", .q_lens = {1, 2}, .kv_lens = {600, 333}, .n_q = 16, .n_kv = 2, .dk = 192,
               .dv = 128, .window = 100, .sinks = true, .cache_dtype = DType::f32});
    attention({.label = "split pool odd stride", .q_lens = {1, 8}, .kv_lens = {800, 260}, .n_q = 16, .n_kv = 1,
               .dk = 192, .dv = 128, .sinks = true, .pool_layers = 3, .layer = 1, .pad = 5});
    // Few-pair bf16 experts (moe.cu's fused weight-stream kernels): 1-8 tokens, 8 and 32 experts,
    // top-8 and an odd top-k, widths that are no multiple of the 2048-element load step.
    cases.push_back(moe_experts_case(1, 512, 256, 8, 8, bf16, ++seed));
    cases.push_back(moe_experts_case(4, 256, 128, 32, 8, bf16, ++seed));
    cases.push_back(moe_experts_case(8, 520, 136, 32, 8, bf16, ++seed));
    cases.push_back(moe_experts_case(8, 256, 64, 8, 8, bf16, ++seed));
    cases.push_back(moe_experts_case(3, 264, 72, 8, 3, bf16, ++seed));
    // One token's down projection per (row, slot) warp (cuda moe_down_slots_kernel): top-3 (two
    // rows per block, 6 of 8 warps busy), top-1 (8 rows per block), I past one 2048-element round.
    cases.push_back(moe_experts_case(1, 264, 2056, 8, 3, bf16, ++seed));
    cases.push_back(moe_experts_case(1, 136, 64, 4, 1, bf16, ++seed));
    // Experts grouped by expert (moe.cu's grouped tensor-core streams): tokens sharing experts
    // (1-8 tokens over 8 experts, 8-64 over 32, top-8), widths no multiple of the 32/64-column
    // chunk, and FP8 block-scaled weights (128x128 blocks with partial edge blocks: I = 208, H = 272;
    // 64x64; and 48-column blocks, which take the GEMV / tiled paths).
    cases.push_back(moe_experts_case(2, 264, 136, 8, 8, bf16, ++seed));
    cases.push_back(moe_experts_case(16, 256, 200, 32, 8, bf16, ++seed));
    // More experts than a block's warps, each split over ranges of I (cuda grouped down kernel).
    cases.push_back(moe_experts_case(8, 256, 1000, 32, 8, bf16, ++seed));
    cases.push_back(moe_experts_case(64, 136, 72, 32, 8, bf16, ++seed));
    // Shared-memory staged experts (plugins/cuda/moe_staged.cu): every expert with exactly one
    // full 64-pair pass; two passes per expert (~83 pairs each); skewed routing (busy and idle experts).
    cases.push_back(moe_experts_case(64, 256, 192, 8, 8, bf16, ++seed));
    cases.push_back(moe_experts_case(100, 384, 128, 6, 5, bf16, ++seed));
    cases.push_back(moe_experts_case(48, 256, 128, 32, 8, bf16, ++seed, 2.5));
    for (auto [T, E] : {std::pair{1, 8}, std::pair{2, 8}, std::pair{4, 8}, std::pair{8, 8}, std::pair{8, 32},
                        std::pair{32, 32}, std::pair{64, 32}})
        cases.push_back(moe_experts_fp8_case(T, 272, 208, E, 8, 128, 128, ++seed));
    cases.push_back(moe_experts_fp8_case(5, 192, 320, 16, 3, 64, 64, ++seed));
    cases.push_back(moe_experts_fp8_case(3, 256, 96, 8, 8, 128, 48, ++seed));
    cases.push_back(moe_experts_fp8_case(20, 256, 96, 8, 8, 128, 48, ++seed));
    // Streams of many more rounds than the kernels keep in flight (moe.cu's shared-memory rings
    // refill their slots; the register paths alternate two sets).
    cases.push_back(moe_experts_fp8_case(2, 1152, 640, 8, 4, 128, 128, ++seed));
    cases.push_back(moe_experts_case(2, 1032, 520, 8, 4, bf16, ++seed));
    cases.push_back(moe_experts_fp8_case(24, 1152, 640, 8, 4, 128, 128, ++seed));  // 4 token tiles
    // One fp8 token takes the per-pair streams (moe.cu moe_fp8_stream_enabled): rows longer than a
    // lane's loads in flight (gate_up rows of 4,112 columns, down rows of 2,064: two passes each),
    // and 64-column blocks.
    cases.push_back(moe_experts_fp8_case(1, 4112, 1024, 1, 1, 128, 128, ++seed));
    cases.push_back(moe_experts_fp8_case(1, 256, 2064, 4, 2, 128, 128, ++seed));
    cases.push_back(moe_experts_fp8_case(1, 192, 320, 16, 3, 64, 64, ++seed));
    cases.push_back(moe_experts_case(24, 1032, 520, 8, 4, bf16, ++seed));
    // One fp8 token split by I (cuda moe_split_i.cu, XINFER_CUDA_MOE_SPLIT_I): H and I in whole
    // 64-column chunks; gate_up rounds cut by H's end (1,088 = 8.5 rounds of 128), more down row
    // tiles than the ring's slots (68 tiles over 8 warps), a scale block cut by the matrix's end;
    // more than 32 down rounds a warp (4,160 rows: the scales past the lanes' 32).
    cases.push_back(moe_experts_fp8_case(1, 1088, 640, 8, 8, 128, 128, ++seed));
    cases.push_back(moe_experts_fp8_case(1, 2048, 192, 8, 6, 128, 128, ++seed));
    cases.push_back(moe_experts_fp8_case(1, 4160, 64, 2, 2, 128, 128, ++seed));
    // The router and the experts as one op: one fp8 token (on cuda the expert kernels route it
    // themselves: 8 of 8 experts as the bench model, 8 of 256 and 40 of 300 with a partial chunk of
    // 32, softmax scoring; narrow experts where there are many, so the weights stay host-built),
    // and shapes the cuda plugin leaves to the two ops (three tokens, bf16).
    for (auto [E, top_k, sigmoid] : {std::tuple{8, 8, true}, std::tuple{256, 8, true}, std::tuple{300, 40, false}})
        cases.push_back(moe_route_experts_case({1, E > 8 ? 256 : 272, E > 8 ? 64 : 208, E, top_k, true, sigmoid, ++seed}));
    cases.push_back(moe_route_experts_case({3, 272, 208, 16, 4, true, true, ++seed}));
    cases.push_back(moe_route_experts_case({1, 264, 136, 8, 3, false, false, ++seed}));
    // Prefill-sized batches (≥ 2,048 pairs: one cuBLASLt GEMM per expert on cuda, FP8 experts
    // widened to bf16 first).
    cases.push_back(moe_experts_case(300, 264, 136, 8, 8, bf16, ++seed));
    cases.push_back(moe_experts_fp8_case(260, 272, 208, 8, 8, 128, 128, ++seed));
    // The norm before a projection: MiMo's hidden size and an odd K (tails of every tile), one
    // token and three (verification), with x (every layer's norms but the first) and without
    // (layer 0's attention norm); bf16 projections and f32 routers of 8 experts.
    for (auto [rows, K] : {std::pair{1, 4096}, std::pair{3, 1032}}) {
        for (bool with_x : {true, false}) cases.push_back(add_rmsnorm_matmul_case(rows, K, 1280, bf16, with_x, ++seed));
        cases.push_back(add_rmsnorm_matmul_case(rows, K, 8, f32, true, ++seed));
    }
    // One row of bf16 weights with more row groups of 8 than one wave of blocks holds (on cuda
    // norm_stream_gemv_kernel's blocks loop over them), a partial last group and partial rounds.
    for (bool with_x : {true, false}) cases.push_back(add_rmsnorm_matmul_case(1, 1032, 8191, bf16, with_x, ++seed));

    // Routers of 256 experts (the real model's; on cuda one block per expert, each normalising the
    // row, the last to arrive storing the residual) and a plain RMSNORM in front of one.
    cases.push_back(add_rmsnorm_matmul_case(1, 4096, 256, f32, true, ++seed));
    cases.push_back(add_rmsnorm_matmul_case(2, 1032, 40, f32, false, ++seed));
    for (int rows : {5, 12}) cases.push_back(add_rmsnorm_matmul_case(rows, 256, 8, f32, true, ++seed));  // 8-row instance; 9+ rows unfused
    // The real decode shapes (up to 134M-weight matrices, fp8 dense weights the CPU does not take)
    // only when asked: XINFER_OPS_TEST_DECODE_MATMULS=1 (scripts/gpu-gemv.sh sets it).
    if (const char* v = std::getenv("XINFER_OPS_TEST_DECODE_MATMULS"); v && std::strcmp(v, "1") == 0)
        add_decode_matmul_cases(cases, seed);
    return cases;
}

std::vector<OpCase> perf_cases() {
    // MiMo-V2-Flash: hidden 4096, 64 query heads (q 12288 = 64 × 192), full-attention layers 4 KV
    // heads, sliding (window 128, sinks) 8 KV heads, head dims 192/128, 256 experts × 2048, top 8,
    // vocab 152576, RoPE theta 5e6 on 64 of 192 dims.
    std::vector<OpCase> cases;
    uint32_t seed = 5000;
    const DType bf16 = DType::bf16;
    const int hidden = 4096, vocab = 152576;
    for (int T : {1, 4096}) {
        cases.push_back(embedding_case(vocab, hidden, T, bf16, ++seed));
        cases.push_back(rmsnorm_case(T, hidden, bf16, 1e-6f, ++seed));
        cases.push_back(add_rmsnorm_case(T, hidden, bf16, ++seed));
        cases.push_back(matmul_case(T, 12288, hidden, bf16, ++seed));        // q_proj
        cases.push_back(matmul_case(T, 4 * (192 + 128), hidden, bf16, ++seed));  // k+v of a full layer
        cases.push_back(matmul_case(T, hidden, 64 * 128, bf16, ++seed));     // o_proj
        cases.push_back(rope_case(T, 64, 192, 64, 5e6f, 200000, ++seed));
        cases.push_back(swiglu_case(T, 2048, ++seed));
        cases.push_back(moe_route_case({T, 256, true, true, 1, 1, 8, true, 2.5f, false, ++seed}));
        cases.push_back(moe_experts_case(T, hidden, 2048, 256, 8, bf16, ++seed));
    }
    cases.push_back(matmul_case(32, 12288, hidden, bf16, ++seed));
    cases.push_back(moe_experts_case(32, hidden, 2048, 256, 8, bf16, ++seed));
    cases.push_back(matmul_case(1, vocab, hidden, bf16, ++seed));  // lm_head
    cases.push_back(argmax_case(32, vocab, false, ++seed));
    cases.push_back(sample_case(32, vocab, ++seed));
    cases.push_back(kv_store_case({32, {.n_pages = 4096, .page_size = 16, .n_kv = 4, .dk = 192, .dv = 128}, ++seed}));
    cases.push_back(kv_store_case({4096, {.n_pages = 4096, .page_size = 16, .n_kv = 8, .dk = 192, .dv = 128}, ++seed}));
    for (int64_t T : {1, 64})  // the decode and serving attention prologue of a sliding layer
        cases.push_back(rope_kv_store_case(
            {T, 64, 64, 1e4f, 0.707f, {.n_pages = 4096, .page_size = 16, .n_kv = 8, .dk = 192, .dv = 128}, ++seed}));

    auto attention = [&](AttentionSpec s) {
        s.seed = ++seed;
        cases.push_back(attention_case(s));
    };
    const std::vector<int> one(32, 1), long_kv(32, 8192);
    attention({.label = "GA decode", .q_lens = one, .kv_lens = long_kv, .n_q = 64, .n_kv = 4, .dk = 192, .dv = 128});
    attention({.label = "GA decode long", .q_lens = {1}, .kv_lens = {32768}, .n_q = 64, .n_kv = 4, .dk = 192, .dv = 128});
    attention({.label = "SWA decode", .q_lens = one, .kv_lens = long_kv, .n_q = 64, .n_kv = 8, .dk = 192, .dv = 128,
               .window = 128, .sinks = true});
    attention({.label = "GA verify", .q_lens = std::vector<int>(8, 32), .kv_lens = std::vector<int>(8, 4096), .n_q = 64,
               .n_kv = 4, .dk = 192, .dv = 128});
    attention({.label = "GA prefill", .q_lens = {4096}, .kv_lens = {4096}, .n_q = 64, .n_kv = 4, .dk = 192, .dv = 128});
    attention({.label = "SWA prefill", .q_lens = {4096}, .kv_lens = {4096}, .n_q = 64, .n_kv = 8, .dk = 192, .dv = 128,
               .window = 128, .sinks = true});
    attention({.label = "DFlash block", .q_lens = std::vector<int>(8, 16), .kv_lens = std::vector<int>(8, 4096),
               .n_q = 32, .n_kv = 4, .dk = 128, .dv = 128, .causal = false});

    // Batch-1 decode and verification at the bench's 4K context (plugins/cuda/attention_decode.cu),
    // and the experts of the mimo_v2_flash_e8 bench model (8 experts, top-8) and of batched
    // serving (32 experts, top-8: few-pair stream path up to 8 tokens, tiled path beyond).
    attention({.label = "GA decode 4K", .q_lens = {1}, .kv_lens = {4096}, .n_q = 64, .n_kv = 4, .dk = 192, .dv = 128});
    attention({.label = "SWA decode 4K", .q_lens = {1}, .kv_lens = {4096}, .n_q = 64, .n_kv = 8, .dk = 192, .dv = 128,
               .window = 128, .sinks = true});
    attention({.label = "GA verify 8 over 4K", .q_lens = {8}, .kv_lens = {4096}, .n_q = 64, .n_kv = 4, .dk = 192,
               .dv = 128});
    attention({.label = "SWA verify 8 over 4K", .q_lens = {8}, .kv_lens = {4096}, .n_q = 64, .n_kv = 8, .dk = 192,
               .dv = 128, .window = 128, .sinks = true});
    // Serving decode steps at concurrency 8, 32, 64 (512-token prompts, ~640 keys each).
    for (int n : {8, 32, 64}) {
        const std::vector<int> ones(n, 1), serving_kv(n, 640);
        attention({.label = "GA decode serving", .q_lens = ones, .kv_lens = serving_kv, .n_q = 64, .n_kv = 4,
                   .dk = 192, .dv = 128});
        attention({.label = "SWA decode serving", .q_lens = ones, .kv_lens = serving_kv, .n_q = 64, .n_kv = 8,
                   .dk = 192, .dv = 128, .window = 128, .sinks = true});
    }
    attention({.label = "GA verify 32 over 4K", .q_lens = {32}, .kv_lens = {4096}, .n_q = 64, .n_kv = 4, .dk = 192,
               .dv = 128});
    // The norm before its projection at batch 1: a sliding layer's fused q|k|v (64·192 + 8·192 +
    // 8·128 rows) and a MoE layer's router.
    cases.push_back(add_rmsnorm_matmul_case(1, hidden, 64 * 192 + 8 * 192 + 8 * 128, bf16, true, ++seed));
    cases.push_back(add_rmsnorm_matmul_case(1, hidden, 256, DType::f32, true, ++seed));
    for (int T : {1, 4, 8}) cases.push_back(moe_experts_case(T, hidden, 2048, 8, 8, bf16, ++seed));
    for (int T : {8, 16, 64}) cases.push_back(moe_experts_case(T, hidden, 2048, 32, 8, bf16, ++seed));
    // ... and routed as the dummy-weight serving bench routes (a few experts picked by every token).
    for (int T : {32, 64}) cases.push_back(moe_experts_case(T, hidden, 2048, 32, 8, bf16, ++seed, 2.5));
    // Experts grouped by expert: the speculative verify of 2-8 tokens at batch 1 (8 experts,
    // top-8), serving concurrency 8-64 (32 experts), bf16 and the checkpoint's FP8 128x128-block
    // experts (1 byte per weight read), and a 256-expert FP8 decode step.
    cases.push_back(moe_experts_case(2, hidden, 2048, 8, 8, bf16, ++seed));
    cases.push_back(moe_experts_case(32, hidden, 2048, 32, 8, bf16, ++seed));
    for (int T : {1, 2, 4, 8}) cases.push_back(moe_experts_fp8_case(T, hidden, 2048, 8, 8, 128, 128, ++seed));
    // ... and one FP8 token routed inside the op, over the bench model's 8 experts and MiMo's 256.
    for (int E : {8, 256}) cases.push_back(moe_route_experts_case({1, hidden, 2048, E, 8, true, true, ++seed}));
    for (int T : {8, 16, 32, 64}) cases.push_back(moe_experts_fp8_case(T, hidden, 2048, 32, 8, 128, 128, ++seed));
    cases.push_back(moe_experts_fp8_case(1, hidden, 2048, 256, 8, 128, 128, ++seed));
    // A 4,096-token prefill chunk of the bench models' experts (plugins/cuda/moe.cu: one cuBLASLt
    // GEMM per expert from 2,048 pairs on), bf16 and FP8.
    cases.push_back(moe_experts_case(4096, hidden, 2048, 8, 8, bf16, ++seed));
    cases.push_back(moe_experts_fp8_case(4096, hidden, 2048, 8, 8, 128, 128, ++seed));
    cases.push_back(matmul_fp8_case(4096, 12288, 4096, 128, 128, 1, true, ++seed));  // a prefill q_proj, FP8
    // The FP8 checkpoint's fused sliding-window q | k | v projection at decode and 8-token verify.
    for (int T : {1, 8}) cases.push_back(matmul_fp8_case(T, 14848, 4096, 128, 128, 1, true, ++seed));
    add_decode_matmul_perf_cases(cases, seed);
    return cases;
}

// ---- running ------------------------------------------------------------------------------------------------

xinfer_op resolve_op(const CaseData& data, DType activation, bool reference_side) {
    return build_op(data, activation, reference_side, {});
}

DType precision_class(const CaseData& data, DType activation) {
    DType lowest = DType::f32;
    for (const CaseTensor& t : data.tensors) {
        const DType d = side_dtype(t, activation, false);
        if (d == DType::bf16) lowest = DType::bf16;
        else if (d == DType::f16 && lowest == DType::f32) lowest = DType::f16;
    }
    return lowest;
}

uint64_t case_bytes(const CaseData& data, DType activation) {
    uint64_t bytes = 0;
    for (const CaseTensor& t : data.tensors)
        if (t.view_of < 0 && on_side(t, false)) bytes += uint64_t(t.bytes(side_dtype(t, activation, false)));
    return bytes;
}

std::vector<DType> activation_candidates(const Backend& device) {
    if (device.props().host_memory) return {DType::f32};
    return {DType::bf16, DType::f32};
}

std::optional<DType> pick_activation(const CaseData& data, Backend& device) {
    for (DType candidate : activation_candidates(device))
        if (device.supports(resolve_op(data, candidate, false))) return candidate;
    return std::nullopt;
}

PreparedCase::PreparedCase(const CaseData& data, Backend& backend, DType activation, bool reference_side)
    : data_(data), backend_(backend), activation_(activation), reference_side_(reference_side) {
    const size_t n = data.tensors.size();
    dtypes_.resize(n);
    buffers_.resize(n);
    pointers_.assign(n, nullptr);
    for (size_t i = 0; i < n; ++i) {
        const CaseTensor& t = data.tensors[i];
        dtypes_[i] = side_dtype(t, activation, reference_side);
        if (t.view_of >= 0 || !on_side(t, reference_side)) continue;
        const size_t bytes = t.bytes(dtypes_[i]);
        buffers_[i] = backend.alloc(bytes);
        pointers_[i] = buffers_[i].data();
        allocated_ += bytes;
    }
    for (size_t i = 0; i < n; ++i) {
        const CaseTensor& t = data.tensors[i];
        if (t.view_of < 0) continue;
        XINFER_CHECK(data.tensors[size_t(t.view_of)].view_of < 0 && dtypes_[size_t(t.view_of)] == dtypes_[i],
                     "view {} must view a plain tensor of its dtype", t.name);
        pointers_[i] = static_cast<char*>(pointers_[size_t(t.view_of)]) + size_t(t.view_offset) * dtype_size(dtypes_[i]);
    }
    op_ = build_op(data, activation, reference_side, pointers_);
}

void PreparedCase::reset() {
    // Host bytes for the uploads below (read before each upload returns).
    std::vector<std::vector<char>> staging;
    for (size_t i = 0; i < data_.tensors.size(); ++i) {
        const CaseTensor& t = data_.tensors[i];
        if (t.view_of >= 0 || !on_side(t, reference_side_)) continue;
        const DType dtype = dtypes_[i];
        const Tensor device_tensor(pointers_[i], DType::u8, {int64_t(t.bytes(dtype))});
        if (!t.raw.empty()) {
            backend_.upload(device_tensor, t.raw.data());  // the case's bytes outlive the synchronize below
        } else if (t.access == Access::output) {
            staging.emplace_back(device_tensor.nbytes(), char(0xff));  // NaN in f32/bf16/f16, -1 in i32
            backend_.upload(device_tensor, staging.back().data());
        } else if (t.bulk_random > 0) {
            // Random values of this dtype in a chunk, copied on the device over the whole tensor.
            const int64_t chunk = std::min<int64_t>(t.numel(), int64_t(1) << 22);
            std::mt19937 rng(uint32_t(i) * 7919u + 17u);
            std::vector<float> values = uniform(chunk, rng, -t.bulk_random, t.bulk_random);
            for (float& v : values) v = round_to(value_dtype(t, activation_), v);  // same numbers on both sides
            staging.emplace_back(size_t(chunk) * dtype_size(dtype));
            if (dtype == DType::i32) {
                std::fill(staging.back().begin(), staging.back().end(), 0);
            } else if (dtype == DType::f8_e4m3) {  // every finite e4m3 code, equally likely
                for (int64_t k = 0; k < chunk; ++k) staging.back()[size_t(k)] = char(random_e4m3(rng));
            } else {
                convert_from_f32(values.data(), dtype, staging.back().data(), chunk);
            }
            const int64_t chunk_bytes = int64_t(staging.back().size()), total = device_tensor.numel();
            backend_.upload(Tensor(pointers_[i], DType::u8, {chunk_bytes}), staging.back().data());
            for (int64_t offset = chunk_bytes; offset < total; offset += chunk_bytes) {
                const int64_t n = std::min(chunk_bytes, total - offset);
                backend_.copy(Tensor(static_cast<char*>(pointers_[i]) + offset, DType::u8, {n}),
                              Tensor(pointers_[i], DType::u8, {n}));
            }
        } else if (dtype == DType::i32) {
            XINFER_CHECK(int64_t(t.ints.size()) == t.numel(), "{}: {} ints for {} elements", t.name, t.ints.size(),
                         t.numel());
            staging.emplace_back(reinterpret_cast<const char*>(t.ints.data()),
                                 reinterpret_cast<const char*>(t.ints.data() + t.ints.size()));
            backend_.upload(device_tensor, staging.back().data());
        } else {
            XINFER_CHECK(int64_t(t.values.size()) == t.numel(), "{}: {} values for {} elements", t.name,
                         t.values.size(), t.numel());
            const DType rounding = value_dtype(t, activation_);
            std::vector<float> rounded(t.values.size());
            for (size_t k = 0; k < rounded.size(); ++k) rounded[k] = round_to(rounding, t.values[k]);
            staging.emplace_back(device_tensor.nbytes());
            convert_from_f32(rounded.data(), dtype, staging.back().data(), int64_t(rounded.size()));
            backend_.upload(device_tensor, staging.back().data());
        }
    }
    backend_.synchronize();
}

std::vector<float> PreparedCase::download(size_t i) {
    const CaseTensor& t = data_.tensors[i];
    const DType dtype = dtypes_[i];
    std::vector<char> raw(t.bytes(dtype));
    backend_.download(Tensor(pointers_[i], DType::u8, {int64_t(raw.size())}), raw.data());
    if (!t.raw.empty()) {  // byte by byte, exactly (fp8 caches: values and scales alike)
        std::vector<float> bytes(raw.size());
        for (size_t k = 0; k < raw.size(); ++k) bytes[k] = float(uint8_t(raw[k]));
        return bytes;
    }
    std::vector<float> values(size_t(t.numel()));
    if (dtype == DType::i32) {
        const int32_t* ints = reinterpret_cast<const int32_t*>(raw.data());
        for (size_t k = 0; k < values.size(); ++k) values[k] = float(ints[k]);  // ids < 2^24: exact
    } else {
        convert_to_f32(dtype, raw.data(), values.data(), t.numel());
    }
    return values;
}

namespace {

TensorCheck compare_tensor(const CaseTensor& t, const std::vector<float>& reference, const std::vector<float>& device,
                           DType device_dtype, double threshold) {
    TensorCheck check;
    check.name = t.name;
    check.compare = t.compare;
    check.threshold = t.compare == Compare::exact ? 0 : threshold;
    check.count = int64_t(reference.size());
    double diff2 = 0, ref2 = 0;
    for (size_t i = 0; i < reference.size(); ++i) {
        const float want = is_float(device_dtype) ? round_to(device_dtype, reference[i]) : reference[i];
        const float got = device[i];
        if (!std::isfinite(want) || !std::isfinite(got)) {
            ++check.non_finite;
            ++check.mismatches;
            continue;
        }
        if (want != got) ++check.mismatches;
        diff2 += double(got - want) * double(got - want);
        ref2 += double(want) * double(want);
    }
    check.nmse = ref2 > 0 ? diff2 / ref2 : diff2;
    check.pass = check.non_finite == 0 &&
                 (t.compare == Compare::exact ? check.mismatches == 0 : check.nmse <= check.threshold);
    return check;
}

}  // namespace

CaseResult check_case(const OpCase& c, const CaseData& data, Backend& reference, Backend& device) {
    CaseResult result;
    try {
        const std::optional<DType> activation = pick_activation(data, device);
        if (!activation) {
            result.status = CaseResult::unsupported;
            return result;
        }
        result.activation = *activation;
        if (!reference.supports(resolve_op(data, *activation, true))) {
            result.message = fmt::format("the reference backend {} refuses this case", reference.name());
            return result;
        }
        PreparedCase want(data, reference, *activation, true);
        PreparedCase got(data, device, *activation, false);
        want.reset();
        got.reset();
        reference.run(want.op());
        reference.synchronize();
        try {
            device.run(got.op());
            device.synchronize();
        } catch (const std::exception& e) {
            result.message = fmt::format("supports_op accepted the op, then: {}", e.what());
            return result;
        }
        const double threshold = c.tolerance.for_class(precision_class(data, *activation));
        bool pass = true;
        for (size_t i = 0; i < data.tensors.size(); ++i) {
            const CaseTensor& t = data.tensors[i];
            if (t.compare == Compare::none) continue;
            result.checks.push_back(compare_tensor(t, want.download(i), got.download(i), got.dtype_of(i), threshold));
            pass = pass && result.checks.back().pass;
        }
        result.status = pass ? CaseResult::pass : CaseResult::fail;
    } catch (const std::exception& e) {
        result.status = CaseResult::fail;
        result.message = e.what();
    }
    return result;
}

std::string format_checks(const CaseResult& result) {
    std::string text;
    for (const TensorCheck& c : result.checks) {
        if (!text.empty()) text += "; ";
        if (result.checks.size() > 1) text += c.name + ": ";
        if (c.compare == Compare::exact) {
            text += fmt::format("exact: {} of {} differ", c.mismatches, c.count);
        } else {
            text += fmt::format("nmse={:.2e} (threshold {:.0e})", c.nmse, c.threshold);
        }
        if (c.non_finite) text += fmt::format(", {} NaN/inf", c.non_finite);
    }
    if (!result.message.empty()) text += (text.empty() ? "" : "; ") + result.message;
    return text;
}

OpCost op_cost(const CaseData& data, const xinfer_op& op) {
    auto bytes = [](const xinfer_tensor& t) { return t.rank > 0 ? double(from_abi(t).nbytes()) : 0.0; };
    auto esize = [](const xinfer_tensor& t) { return double(dtype_size(DType(t.dtype))); };
    // fp8 caches read/write one f32 scale per (token, kv head) row besides the values.
    auto scale_bytes = [](const xinfer_tensor& t) { return t.dtype == XINFER_DTYPE_F8_E4M3 ? double(cpu::kFp8ScaleBytes) : 0.0; };
    OpCost cost;
    switch (op.type) {
        case XINFER_OP_EMBEDDING: {
            const double rows = double(op.src[1].shape[0]), hidden = double(op.src[0].shape[1]);
            cost.bytes = rows * hidden * (esize(op.src[0]) + esize(op.dst[0])) + bytes(op.src[1]);
            break;
        }
        case XINFER_OP_ADD_RMSNORM: cost.bytes = 2 * bytes(op.src[0]) + bytes(op.src[1]) + bytes(op.src[2]) + bytes(op.dst[0]); break;
        case XINFER_OP_MATMUL: {
            const xinfer_tensor& w = op.src[1];
            cost.bytes = bytes(op.src[0]) + bytes(w) + bytes(op.dst[0]);
            cost.flops = 2.0 * double(from_abi(op.src[0]).rows()) * double(w.shape[0]) * double(w.shape[1]);
            break;
        }
        case XINFER_OP_ADD_RMSNORM_MATMUL: {
            // The norm's traffic (the residual read, and written back when x is added) and the matmul's
            // weights and output; normed is written once (a fused kernel need not read it back).
            const xinfer_tensor& w = op.src[3];
            const bool add = op.src[1].rank > 0;
            cost.bytes = (add ? 2 : 1) * bytes(op.src[0]) + bytes(op.src[1]) + bytes(op.src[2]) + bytes(op.dst[1]) +
                         bytes(w) + bytes(op.src[4]) + bytes(op.dst[0]);
            cost.flops = 2.0 * double(from_abi(op.src[0]).rows()) * double(w.shape[0]) * double(w.shape[1]);
            break;
        }
        case XINFER_OP_ROPE: {
            const xinfer_tensor& x = op.src[0];
            cost.bytes = 2.0 * double(x.shape[0] * x.shape[1] * op.params.rope.rotary_dim) * esize(x) + bytes(op.src[1]);
            break;
        }
        case XINFER_OP_ROPE_KV_STORE: {
            // q and k rotated in place, v scaled in place, k and v rows written to the cache.
            const CaseTensor* slots = find_slot(data, Slot::slot_mapping);
            const double stored = slots ? double(std::count_if(slots->ints.begin(), slots->ints.end(), [](int32_t s) { return s >= 0; })) : 0;
            const xinfer_tensor &k = op.src[0], &v = op.src[1], &q = op.src[4];
            const double rotated = 2.0 * double(q.shape[0] * (q.shape[1] + k.shape[1]) * op.params.rope_kv_store.rotary_dim);
            cost.bytes = rotated * esize(q) + 2 * bytes(v) + bytes(k) + bytes(op.src[5]) + bytes(op.batch.slot_mapping) +
                         stored * double(k.shape[1]) * (double(k.shape[2]) * esize(op.src[2]) + double(v.shape[2]) * esize(op.src[3]));
            break;
        }
        case XINFER_OP_SCALE: cost.bytes = 2 * bytes(op.src[0]); break;
        case XINFER_OP_ADD: cost.bytes = 2 * bytes(op.src[0]) + bytes(op.src[1]); break;
        case XINFER_OP_KV_STORE: {
            const CaseTensor* slots = find_slot(data, Slot::slot_mapping);
            const double stored = slots ? double(std::count_if(slots->ints.begin(), slots->ints.end(), [](int32_t s) { return s >= 0; })) : 0;
            const xinfer_tensor &k = op.src[0], &v = op.src[1];
            cost.bytes = bytes(k) + bytes(v) + bytes(op.batch.slot_mapping) +
                         stored * double(k.shape[1]) * (double(k.shape[2]) * esize(op.src[2]) + double(v.shape[2]) * esize(op.src[3]) +
                                                        scale_bytes(op.src[2]) + scale_bytes(op.src[3]));
            break;
        }
        case XINFER_OP_ATTENTION: {
            const xinfer_attention_params& p = op.params.attention;
            cost.bytes = bytes(op.src[0]) + bytes(op.src[3]) + bytes(op.dst[0]) + bytes(op.batch.cu_q_lens) +
                         bytes(op.batch.kv_lens) + bytes(op.batch.positions) + bytes(op.batch.page_table);
            const CaseTensor* cu = find_slot(data, Slot::cu_q_lens);
            const CaseTensor* kv_lens = find_slot(data, Slot::kv_lens);
            const CaseTensor* positions = find_slot(data, Slot::positions);
            if (!cu || !kv_lens || !positions) break;
            const double key_bytes = double(p.n_kv_heads) * (double(p.head_dim_k) * esize(op.src[1]) +
                                                             double(p.head_dim_v) * esize(op.src[2]) +
                                                             scale_bytes(op.src[1]) + scale_bytes(op.src[2]));
            for (size_t s = 0; s + 1 < cu->ints.size(); ++s) {
                int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
                for (int32_t t = cu->ints[s]; t < cu->ints[s + 1]; ++t) {
                    const auto [a, b] = visible_keys(positions->ints[size_t(t)], kv_lens->ints[s], p.window, p.causal != 0);
                    if (b < a) continue;
                    cost.flops += double(b - a + 1) * p.n_q_heads * 2.0 * (p.head_dim_k + p.head_dim_v);
                    lo = std::min(lo, a);
                    hi = std::max(hi, b);
                }
                if (hi >= lo) cost.bytes += double(hi - lo + 1) * key_bytes;  // each visible key read once
            }
            break;
        }
        case XINFER_OP_MOE_ROUTE_EXPERTS: {
            // The experts the router picks (routed here on the host, as the reference does), their
            // weights read once; the logits and bias read, ids and weights never written.
            const xinfer_tensor &x = op.src[0], &logits = op.src[1], &gate_up = op.src[3], &down = op.src[4];
            const CaseTensor* logit_values = find_slot(data, Slot::src, 1);
            const CaseTensor* bias_values = find_slot(data, Slot::src, 2);
            const xinfer_route_params& rp = op.params.route_experts.route;
            const int64_t T = logits.shape[0], E = logits.shape[1];
            std::vector<char> touched(size_t(E), 0);
            if (logit_values) {
                std::vector<float> lv = logit_values->values, bv = bias_values ? bias_values->values : std::vector<float>{};
                std::vector<int32_t> ids(size_t(T * rp.top_k));
                std::vector<float> weights(ids.size());
                cpu::moe_route(Tensor(lv.data(), DType::f32, {T, E}), bv.empty() ? Tensor() : Tensor(bv.data(), DType::f32, {E}),
                               router_params(rp), Tensor(ids.data(), DType::i32, {T, rp.top_k}),
                               Tensor(weights.data(), DType::f32, {T, rp.top_k}));
                for (int32_t e : ids)
                    if (e >= 0 && e < E) touched[size_t(e)] = 1;
            }
            const double experts = double(std::count(touched.begin(), touched.end(), 1));
            cost.bytes = bytes(x) + bytes(logits) + bytes(op.src[2]) + bytes(op.dst[0]) +
                         experts * (bytes(gate_up) + bytes(down) + bytes(op.src[5]) + bytes(op.src[6])) /
                             double(gate_up.shape[0]);
            const double H = double(x.shape[1]), I = double(gate_up.shape[1]) / 2;
            cost.flops = 2.0 * double(T * rp.top_k) * (2 * I * H + H * I);
            break;
        }
        case XINFER_OP_MOE_EXPERTS: {
            const xinfer_tensor &x = op.src[0], &ids = op.src[1], &gate_up = op.src[3], &down = op.src[4];
            const CaseTensor* id_values = find_slot(data, Slot::src, 1);
            std::vector<char> touched(size_t(gate_up.shape[0]), 0);
            if (id_values)
                for (int32_t e : id_values->ints)
                    if (e >= 0 && e < gate_up.shape[0]) touched[size_t(e)] = 1;
            const double experts = double(std::count(touched.begin(), touched.end(), 1));
            cost.bytes = bytes(x) + bytes(ids) + bytes(op.src[2]) + bytes(op.dst[0]) +
                         experts * (bytes(gate_up) + bytes(down) + bytes(op.src[5]) + bytes(op.src[6])) /
                             double(gate_up.shape[0]);  // fp8: with the touched experts' block scales
            const double H = double(x.shape[1]), I = double(gate_up.shape[1]) / 2;
            cost.flops = 2.0 * double(ids.shape[0] * ids.shape[1]) * (2 * I * H + H * I);
            break;
        }
        default:
            for (const xinfer_tensor& t : op.src) cost.bytes += bytes(t);
            for (const xinfer_tensor& t : op.dst) cost.bytes += bytes(t);
            break;
    }
    return cost;
}

}  // namespace xinfer::op_cases
