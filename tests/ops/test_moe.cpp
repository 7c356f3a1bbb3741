// moe_route and moe_experts against straightforward references.
#include "op_test_util.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace xinfer::test {
namespace {

// Routing weights: f32 scores renormalised in f32 vs float64.
constexpr double kRouterWeightTolerance = 1e-6;
// Expert FFN: two chained f32-accumulated matmuls vs float64 on the same rounded weights.
constexpr double kExpertsTolerance = 1e-5;

struct RouteReference {
    std::vector<int32_t> ids;
    std::vector<double> weights;
};

// Scores and selection scores use the kernel's f32 formulas, so both sides see bit-identical
// values and the chosen ids can be compared exactly; selection itself is a plain full sort.
RouteReference reference_route(const std::vector<float>& logits, const std::vector<float>& bias, const RouterParams& p,
                               int64_t T, int64_t E) {
    RouteReference r;
    const int64_t group_size = E / p.n_group;
    for (int64_t t = 0; t < T; ++t) {
        const float* row = logits.data() + t * E;
        std::vector<float> scores(static_cast<size_t>(E)), selection(static_cast<size_t>(E));
        if (p.scoring == RouterParams::Scoring::softmax) {
            const float m = *std::max_element(row, row + E);
            float sum = 0.f;
            for (int64_t e = 0; e < E; ++e) sum += scores[size_t(e)] = std::exp(row[e] - m);
            for (float& s : scores) s /= sum;
        } else {
            for (int64_t e = 0; e < E; ++e) scores[size_t(e)] = 1.f / (1.f + std::exp(-row[e]));
        }
        for (int64_t e = 0; e < E; ++e)
            selection[size_t(e)] = scores[size_t(e)] + (bias.empty() ? 0.f : bias[size_t(e)]);

        auto by_selection_desc = [](const std::vector<float>& v) {
            std::vector<int32_t> order(v.size());
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(),
                             [&](int32_t a, int32_t b) { return v[size_t(a)] > v[size_t(b)]; });
            return order;
        };
        std::vector<bool> allowed(static_cast<size_t>(E), true);
        if (p.topk_group < p.n_group) {
            std::vector<float> group_scores;
            for (int64_t g = 0; g < p.n_group; ++g) {
                std::vector<float> members(selection.begin() + g * group_size,
                                           selection.begin() + (g + 1) * group_size);
                std::sort(members.begin(), members.end(), std::greater<float>());
                group_scores.push_back(members[0] + (members.size() > 1 ? members[1] : 0.f));
            }
            const auto group_order = by_selection_desc(group_scores);
            std::vector<bool> keep(static_cast<size_t>(p.n_group), false);
            for (int i = 0; i < p.topk_group; ++i) keep[size_t(group_order[size_t(i)])] = true;
            for (int64_t e = 0; e < E; ++e) allowed[size_t(e)] = keep[size_t(e / group_size)];
        }
        for (int64_t e = 0; e < E; ++e)
            if (!allowed[size_t(e)]) selection[size_t(e)] = -INFINITY;
        const auto order = by_selection_desc(selection);
        double sum = 0.0;
        for (int i = 0; i < p.top_k; ++i) sum += scores[size_t(order[size_t(i)])];
        for (int i = 0; i < p.top_k; ++i) {
            r.ids.push_back(order[size_t(i)]);
            const double w = scores[size_t(order[size_t(i)])];
            r.weights.push_back((p.norm_topk_prob ? w / (sum + 1e-20) : w) * p.routed_scaling_factor);
        }
    }
    return r;
}

void check_route(const std::string& name, const std::vector<float>& logits, const std::vector<float>& bias,
                 const RouterParams& p, int64_t T, int64_t E) {
    DeviceTensor dlogits = device_from(logits, DType::f32, {T, E});
    DeviceTensor dbias = bias.empty() ? DeviceTensor{} : device_from(bias, DType::f32, {E});
    DeviceTensor ids = device_from_i32(std::vector<int32_t>(size_t(T * p.top_k), -7), {T, p.top_k});
    DeviceTensor weights = device_poisoned({T, p.top_k});
    cpu_backend().moe_route(dlogits, dbias.tensor, p, ids, weights);
    const RouteReference want = reference_route(logits, bias, p, T, E);
    EXPECT_EQ(to_host_i32(ids), want.ids) << name;
    EXPECT_CLOSE(to_host(weights), want.weights, kRouterWeightTolerance, name);
}

RouterParams router(RouterParams::Scoring scoring, int top_k, int n_group, int topk_group, bool norm, float factor) {
    RouterParams p;
    p.scoring = scoring;
    p.top_k = top_k;
    p.n_group = n_group;
    p.topk_group = topk_group;
    p.norm_topk_prob = norm;
    p.routed_scaling_factor = factor;
    return p;
}

TEST(MoeRoute, SigmoidWithBiasAndGroupLimitedSelection) {
    const auto sigmoid = RouterParams::Scoring::sigmoid;
    // DeepSeek-V3-like grouping; a small grouped case; MiMo-V2-Flash (256 experts, one group, top 8).
    check_route("E=64 groups 8/4 top 6", random_vector(9 * 64, 1, -4.f, 4.f), random_vector(64, 2, -0.5f, 0.5f),
                router(sigmoid, 6, 8, 4, true, 2.5f), 9, 64);
    check_route("E=16 groups 4/2 top 4", random_vector(7 * 16, 3, -4.f, 4.f), random_vector(16, 4, -0.5f, 0.5f),
                router(sigmoid, 4, 4, 2, true, 1.f), 7, 16);
    check_route("MiMo E=256 top 8", random_vector(5 * 256, 5, -4.f, 4.f), random_vector(256, 6, -0.2f, 0.2f),
                router(sigmoid, 8, 1, 1, true, 1.f), 5, 256);
    check_route("groups of one expert", random_vector(3 * 8, 7, -4.f, 4.f), {}, router(sigmoid, 2, 8, 3, false, 1.f), 3,
                8);
}

TEST(MoeRoute, SoftmaxWithoutBias) {
    const auto softmax = RouterParams::Scoring::softmax;
    check_route("E=10 top 3 unnormalised", random_vector(6 * 10, 8, -3.f, 3.f), {},
                router(softmax, 3, 1, 1, false, 1.f), 6, 10);
    check_route("E=60 top 4 normalised x2", random_vector(4 * 60, 9, -3.f, 3.f), {},
                router(softmax, 4, 1, 1, true, 2.f), 4, 60);
}

TEST(MoeRoute, TiesGoToTheLowerExpertIndex) {
    DeviceTensor logits = device_from(std::vector<float>(8, 0.f), DType::f32, {1, 8});
    DeviceTensor ids = device_from_i32(std::vector<int32_t>(3, -1), {1, 3});
    DeviceTensor weights = device_poisoned({1, 3});
    cpu_backend().moe_route(logits, Tensor(), router(RouterParams::Scoring::sigmoid, 3, 1, 1, true, 1.f), ids, weights);
    EXPECT_EQ(to_host_i32(ids), (std::vector<int32_t>{0, 1, 2}));
    EXPECT_CLOSE(to_host(weights), (std::vector<double>{1.0 / 3, 1.0 / 3, 1.0 / 3}), kRouterWeightTolerance, "ties");
}

TEST(MoeRoute, RejectsInconsistentGrouping) {
    DeviceTensor logits = device_poisoned({2, 10});
    DeviceTensor ids = device_from_i32(std::vector<int32_t>(4), {2, 2});
    DeviceTensor weights = device_poisoned({2, 2});
    expect_error(
        [&] {
            cpu_backend().moe_route(logits, Tensor(), router(RouterParams::Scoring::sigmoid, 2, 3, 1, true, 1.f), ids,
                                    weights);
        },
        {"moe_route", "n_group 3", "10 experts"});
}

std::vector<double> reference_experts(const std::vector<float>& x, const std::vector<int32_t>& ids,
                                      const std::vector<float>& weights, const std::vector<float>& gate_up,
                                      const std::vector<float>& down, int64_t T, int64_t H, int64_t I, int64_t k) {
    std::vector<double> out(size_t(T * H), 0.0);
    std::vector<double> hidden(static_cast<size_t>(I));
    for (int64_t t = 0; t < T; ++t)
        for (int64_t slot = 0; slot < k; ++slot) {
            const int64_t e = ids[size_t(t * k + slot)];
            const float* gu = gate_up.data() + e * 2 * I * H;
            const float* dn = down.data() + e * H * I;
            for (int64_t i = 0; i < I; ++i) {
                double g = 0.0, u = 0.0;
                for (int64_t h = 0; h < H; ++h) {
                    g += double(gu[i * H + h]) * x[size_t(t * H + h)];
                    u += double(gu[(I + i) * H + h]) * x[size_t(t * H + h)];
                }
                hidden[size_t(i)] = g / (1.0 + std::exp(-g)) * u;
            }
            for (int64_t h = 0; h < H; ++h) {
                double y = 0.0;
                for (int64_t i = 0; i < I; ++i) y += double(dn[h * I + i]) * hidden[size_t(i)];
                out[size_t(t * H + h)] += weights[size_t(t * k + slot)] * y;
            }
        }
    return out;
}

TEST(MoeExperts, MatchesReferenceForWeightDtypes) {
    struct Shape {
        int64_t T, H, I, E, k;
    };
    // Decode; a prefill whose experts get ~40 tokens each (the GEMM path, ≥ 32); odd sizes; many
    // experts with a few tokens each.
    const std::vector<Shape> shapes = {{1, 40, 24, 6, 2}, {80, 64, 48, 4, 2}, {5, 33, 17, 8, 3}, {60, 48, 40, 16, 8}};
    uint32_t seed = 300;
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
        for (const Shape& s : shapes) {
            const auto x = random_vector(size_t(s.T * s.H), seed++);
            const auto gate_up = rounded(random_vector(size_t(s.E * 2 * s.I * s.H), seed++, -0.3f, 0.3f), dtype);
            const auto down = rounded(random_vector(size_t(s.E * s.H * s.I), seed++, -0.3f, 0.3f), dtype);
            const auto weights = random_vector(size_t(s.T * s.k), seed++, 0.f, 1.f);
            std::vector<int32_t> ids;
            std::mt19937 rng(seed++);
            for (int64_t t = 0; t < s.T; ++t) {
                std::vector<int32_t> experts(static_cast<size_t>(s.E));
                std::iota(experts.begin(), experts.end(), 0);
                std::shuffle(experts.begin(), experts.end(), rng);
                ids.insert(ids.end(), experts.begin(), experts.begin() + s.k);
            }
            DeviceTensor dx = device_from(x, DType::f32, {s.T, s.H});
            DeviceTensor dids = device_from_i32(ids, {s.T, s.k});
            DeviceTensor dweights = device_from(weights, DType::f32, {s.T, s.k});
            DeviceTensor dgate_up = device_from(gate_up, dtype, {s.E, 2 * s.I, s.H});
            DeviceTensor ddown = device_from(down, dtype, {s.E, s.H, s.I});
            DeviceTensor out = device_poisoned({s.T, s.H});
            cpu_backend().moe_experts(dx, dids, dweights, dgate_up, ddown, out);
            EXPECT_CLOSE(to_host(out), reference_experts(x, ids, weights, gate_up, down, s.T, s.H, s.I, s.k),
                         kExpertsTolerance,
                         "T=" << s.T << " H=" << s.H << " I=" << s.I << " E=" << s.E << " k=" << s.k << " "
                              << dtype_name(dtype));
        }
    }
}

TEST(MoeExperts, RejectsOutOfRangeExpertIds) {
    DeviceTensor x = device_from(random_vector(8, 1), DType::f32, {2, 4});
    DeviceTensor ids = device_from_i32({0, 1, 3, 0}, {2, 2});
    DeviceTensor weights = device_from({1.f, 1.f, 1.f, 1.f}, DType::f32, {2, 2});
    DeviceTensor gate_up = device_from(random_vector(3 * 6 * 4, 2), DType::f32, {3, 6, 4});
    DeviceTensor down = device_from(random_vector(3 * 4 * 3, 3), DType::f32, {3, 4, 3});
    DeviceTensor out = device_poisoned({2, 4});
    expect_error([&] { cpu_backend().moe_experts(x, ids, weights, gate_up, down, out); },
                 {"moe_experts", "expert id 3", "token 1"});
}

}  // namespace
}  // namespace xinfer::test
