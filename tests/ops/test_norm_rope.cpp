// embedding, rmsnorm, add_rmsnorm, rope, swiglu, scale and add against float64 references.
#include "backend/cpu/simd.h"
#include "op_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>

namespace xinfer::test {
namespace {

// Row-wise f32 ops: a few ulps of f32 per element, relative to the largest output.
constexpr double kElementwiseTolerance = 1e-6;
// RoPE: f32 products of cos/sin computed in float64 and rounded once.
constexpr double kRopeTolerance = 1e-6;

TEST(Embedding, GathersAndWidensRowsForEveryTableDtype) {
    const int64_t vocab = 37, hidden = 19;
    const std::vector<int32_t> ids = {0, 36, 5, 5, 17, 1, 30};
    const int64_t T = int64_t(ids.size());
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
        const auto table = rounded(random_vector(size_t(vocab * hidden), 11), dtype);
        DeviceTensor dtable = device_from(table, dtype, {vocab, hidden});
        DeviceTensor dids = device_from_i32(ids, {T});
        DeviceTensor out = device_poisoned({T, hidden});
        cpu_backend().embedding(dtable, dids, out);
        std::vector<double> want;
        for (int32_t id : ids)
            for (int64_t i = 0; i < hidden; ++i) want.push_back(table[size_t(id * hidden + i)]);
        EXPECT_CLOSE(to_host(out), want, 0.0, "table " << dtype_name(dtype));
    }
}

TEST(Embedding, RejectsOutOfRangeIds) {
    DeviceTensor table = device_from(random_vector(40, 1), DType::f32, {10, 4});
    DeviceTensor out = device_poisoned({2, 4});
    DeviceTensor too_big = device_from_i32({3, 10}, {2});
    expect_error([&] { cpu_backend().embedding(table, too_big, out); }, {"embedding", "10", "vocabulary of size 10"});
    DeviceTensor negative = device_from_i32({-4, 0}, {2});
    expect_error([&] { cpu_backend().embedding(table, negative, out); }, {"-4", "10"});
}

std::vector<double> reference_rmsnorm(const std::vector<float>& x, const std::vector<float>& w, int64_t rows, int64_t n,
                                      double eps) {
    std::vector<double> out(x.size());
    for (int64_t r = 0; r < rows; ++r) {
        double sum = 0.0;
        for (int64_t i = 0; i < n; ++i) sum += double(x[size_t(r * n + i)]) * x[size_t(r * n + i)];
        const double inv = 1.0 / std::sqrt(sum / double(n) + eps);
        for (int64_t i = 0; i < n; ++i) out[size_t(r * n + i)] = x[size_t(r * n + i)] * inv * w[size_t(i)];
    }
    return out;
}

TEST(RmsNorm, MatchesReferenceForWeightDtypesAndOddSizes) {
    uint32_t seed = 100;
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
        for (auto [rows, n] : {std::pair<int64_t, int64_t>{1, 1}, {3, 7}, {17, 129}, {5, 4096}, {64, 333}}) {
            const auto x = random_vector(size_t(rows * n), seed++, -3.f, 3.f);
            const auto w = rounded(random_vector(size_t(n), seed++, 0.5f, 1.5f), dtype);
            DeviceTensor dx = device_from(x, DType::f32, {rows, n});
            DeviceTensor dw = device_from(w, dtype, {n});
            DeviceTensor out = device_poisoned({rows, n});
            cpu_backend().rmsnorm(dx, dw, 1e-5f, out);
            EXPECT_CLOSE(to_host(out), reference_rmsnorm(x, w, rows, n, 1e-5), kElementwiseTolerance,
                         rows << "x" << n << " weight " << dtype_name(dtype));
        }
    }
}

TEST(RmsNorm, AddRmsNormUpdatesResidualThenNormalises) {
    const int64_t rows = 9, n = 130;
    const auto residual = random_vector(size_t(rows * n), 1);
    const auto x = random_vector(size_t(rows * n), 2);
    const auto w = rounded(random_vector(size_t(n), 3), DType::bf16);
    DeviceTensor dres = device_from(residual, DType::f32, {rows, n});
    DeviceTensor dx = device_from(x, DType::f32, {rows, n});
    DeviceTensor dw = device_from(w, DType::bf16, {n});
    DeviceTensor out = device_poisoned({rows, n});
    cpu_backend().add_rmsnorm(dres, dx, dw, 1e-6f, out);
    std::vector<float> sum(residual.size());
    std::vector<double> sum_ref(residual.size());
    for (size_t i = 0; i < sum.size(); ++i) {
        sum[i] = residual[i] + x[i];
        sum_ref[i] = sum[i];
    }
    EXPECT_CLOSE(to_host(dres), sum_ref, 0.0, "residual");
    EXPECT_CLOSE(to_host(out), reference_rmsnorm(sum, w, rows, n, 1e-6), kElementwiseTolerance, "out");
}

TEST(RmsNorm, RejectsMismatchedWeight) {
    DeviceTensor x = device_poisoned({2, 8});
    DeviceTensor w = device_poisoned({7});
    DeviceTensor out = device_poisoned({2, 8});
    expect_error([&] { cpu_backend().rmsnorm(x, w, 1e-5f, out); }, {"rmsnorm", "[7]", "[2, 8]"});
}

std::vector<double> reference_rope(const std::vector<float>& x, const std::vector<int32_t>& positions, int64_t heads,
                                   int64_t head_dim, int rotary_dim, double theta) {
    std::vector<double> out(x.begin(), x.end());
    const int half = rotary_dim / 2;
    for (size_t t = 0; t < positions.size(); ++t)
        for (int64_t h = 0; h < heads; ++h) {
            const size_t base = (t * size_t(heads) + size_t(h)) * size_t(head_dim);
            for (int j = 0; j < half; ++j) {
                const double angle = positions[t] * std::pow(theta, -2.0 * j / rotary_dim);
                const double lo = x[base + size_t(j)], hi = x[base + size_t(j + half)];
                out[base + size_t(j)] = lo * std::cos(angle) - hi * std::sin(angle);
                out[base + size_t(j + half)] = hi * std::cos(angle) + lo * std::sin(angle);
            }
        }
    return out;
}

TEST(Rope, RotatesTheFirstRotaryDimsNeoxStyle) {
    struct Case {
        int64_t heads, head_dim;
        int rotary_dim;
        float theta;
    };
    // MiMo's partial rotary (64 of 192, both thetas), a small partial head, a fully rotated one.
    const std::vector<Case> cases = {{3, 192, 64, 5e6f}, {2, 192, 64, 1e4f}, {5, 24, 8, 1e4f}, {1, 10, 10, 1e4f}};
    const std::vector<int32_t> positions = {0, 1, 2, 17, 127, 128, 1000, 4095, 4096, 3};
    const int64_t T = int64_t(positions.size());
    uint32_t seed = 50;
    for (const Case& c : cases) {
        const auto x = random_vector(size_t(T * c.heads * c.head_dim), seed++);
        DeviceTensor dx = device_from(x, DType::f32, {T, c.heads, c.head_dim});
        DeviceTensor dpos = device_from_i32(positions, {T});
        cpu_backend().rope(dx, dpos, RopeParams{c.rotary_dim, c.theta});
        EXPECT_CLOSE(to_host(dx), reference_rope(x, positions, c.heads, c.head_dim, c.rotary_dim, c.theta),
                     kRopeTolerance, "head_dim " << c.head_dim << " rotary " << c.rotary_dim << " theta " << c.theta);
    }
}

TEST(Rope, RejectsBadRotaryDim) {
    DeviceTensor x = device_poisoned({1, 1, 8});
    DeviceTensor pos = device_from_i32({0}, {1});
    expect_error([&] { cpu_backend().rope(x, pos, RopeParams{10, 1e4f}); }, {"rope", "rotary_dim 10"});
    expect_error([&] { cpu_backend().rope(x, pos, RopeParams{3, 1e4f}); }, {"rope", "rotary_dim 3"});
}

TEST(Swiglu, IsSiluOfGateTimesUp) {
    for (auto [T, I] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {40, 1000}}) {
        const auto gate_up = random_vector(size_t(T * 2 * I), uint32_t(T * I), -8.f, 8.f);
        DeviceTensor dgu = device_from(gate_up, DType::f32, {T, 2 * I});
        DeviceTensor out = device_poisoned({T, I});
        cpu_backend().swiglu(dgu, out);
        std::vector<double> want;
        for (int64_t t = 0; t < T; ++t)
            for (int64_t i = 0; i < I; ++i) {
                const double g = gate_up[size_t(t * 2 * I + i)], u = gate_up[size_t(t * 2 * I + I + i)];
                want.push_back(g / (1.0 + std::exp(-g)) * u);
            }
        EXPECT_CLOSE(to_host(out), want, kElementwiseTolerance, T << "x" << I);
    }
}

// The CPU kernels' vector exp (simd::exp_lanes; swiglu, attention softmax): within 2 ulp of the correctly
// rounded e^x wherever that is a normal float, within FLT_MIN below it; NaN, ±inf, overflow and
// underflow as std::exp.
TEST(SimdExp, IsWithinTwoUlpAndKeepsSpecialValues) {
    std::vector<float> xs;
    for (float x = -110.f; x <= 100.f; x += 0.0137f) xs.push_back(x);
    for (float x : {0.f, -0.f, 1e-30f, -1e-30f, 88.72f, 88.73f, -87.33f, -103.9f, 89.f, -104.5f, 1e30f, -1e30f})
        xs.push_back(x);
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    xs.insert(xs.end(), {inf, -inf, nan});
    while (xs.size() % cpu::simd::kLanes) xs.push_back(0.5f);
    std::vector<float> got(xs.size());
    for (size_t i = 0; i < xs.size(); i += cpu::simd::kLanes)
        cpu::simd::store(&got[i], cpu::simd::exp_lanes(cpu::simd::load(&xs[i])));
    const auto ulp_distance = [](float a, float b) {
        int32_t ia, ib;
        std::memcpy(&ia, &a, 4);
        std::memcpy(&ib, &b, 4);
        return std::abs(int64_t(ia) - int64_t(ib));
    };
    int64_t worst = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
        const float want = float(std::exp(double(xs[i])));
        if (std::isnan(xs[i])) {
            EXPECT_TRUE(std::isnan(got[i])) << "exp(NaN) = " << got[i];
        } else if (std::isinf(want) || want == 0.f) {
            EXPECT_TRUE(got[i] == want || (want == 0.f && got[i] < std::numeric_limits<float>::min()))
                << "exp(" << xs[i] << ") = " << got[i] << ", want " << want;
        } else if (want < std::numeric_limits<float>::min()) {
            EXPECT_LE(std::abs(got[i] - want), std::numeric_limits<float>::min()) << "exp(" << xs[i] << ")";
        } else {
            const int64_t d = ulp_distance(got[i], want);
            worst = std::max(worst, d);
            EXPECT_LE(d, 2) << "exp(" << xs[i] << ") = " << got[i] << ", want " << want;
        }
    }
    EXPECT_EQ(got[std::find(xs.begin(), xs.end(), 0.f) - xs.begin()], 1.f);
    std::cout << "cpu::simd::exp_lanes: worst " << worst << " ulp over " << xs.size() << " values\n";
}

TEST(Elementwise, ScaleAndAddInPlace) {
    const auto a = random_vector(70007, 1), b = random_vector(70007, 2);
    DeviceTensor x = device_from(a, DType::f32, {7, 10001});
    DeviceTensor y = device_from(b, DType::f32, {7, 10001});
    cpu_backend().scale(x, 0.707f);
    std::vector<double> want(a.size());
    for (size_t i = 0; i < a.size(); ++i) want[i] = double(a[i]) * 0.707f;
    EXPECT_CLOSE(to_host(x), want, kElementwiseTolerance, "scale");
    cpu_backend().add(x, y);
    for (size_t i = 0; i < a.size(); ++i) want[i] = double(a[i]) * 0.707f + b[i];
    EXPECT_CLOSE(to_host(x), want, kElementwiseTolerance, "add");
    DeviceTensor wrong = device_poisoned({7, 10000});
    expect_error([&] { cpu_backend().add(x, wrong); }, {"add", "[7, 10001]", "[7, 10000]"});
}

}  // namespace
}  // namespace xinfer::test
