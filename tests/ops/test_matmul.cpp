// matmul y = x · wᵀ against a float64 reference, over shapes that hit both the GEMV path
// (T < 32: partial token blocks, partial row groups, K tails shorter than a vector pair) and the
// blocked GEMM path (T ≥ 32: partial token panels, partial row tiles, K crossing the 512-wide
// depth blocks, 512-token chunks), for f32, bf16 and f16 weights; and the norm fused with a
// matmul (ADD_RMSNORM_MATMUL) against the two ops.
#include "op_test_util.h"

namespace xinfer::test {
namespace {

std::vector<double> reference_matmul(const std::vector<float>& x, const std::vector<float>& w, int64_t T, int64_t K,
                                     int64_t N) {
    std::vector<double> y(size_t(T * N), 0.0);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t n = 0; n < N; ++n) {
            double sum = 0.0;
            for (int64_t k = 0; k < K; ++k) sum += double(x[size_t(t * K + k)]) * double(w[size_t(n * K + k)]);
            y[size_t(t * N + n)] = sum;
        }
    return y;
}

struct MatmulShape {
    int64_t T, K, N;
};

// Weights are rounded to their dtype before the reference sees them, so every dtype is held to
// the f32-accumulation bound: 1e-5 relative to the largest output (K ≤ 2000 here).
constexpr double kMatmulTolerance = 1e-5;

TEST(Matmul, MatchesFloat64ReferenceForAllWeightDtypes) {
    const std::vector<MatmulShape> shapes = {
        {1, 1, 1},
        {1, 7, 5},
        {1, 64, 33},
        {1, 333, 37},
        {2, 100, 9},
        {3, 17, 4},
        {4, 130, 13},
        {5, 31, 7},
        {11, 200, 19},
        {13, 65, 9},
        {16, 16, 16},
        {17, 333, 37},
        {31, 96, 21},
        {32, 64, 8},
        {33, 1, 17},
        {47, 129, 23},
        {48, 96, 40},
        {49, 50, 3},
        {64, 1100, 70},
        {100, 513, 29},
        {130, 257, 100},
        {35, 2000, 11},
        // Prompts longer than one GEMM chunk (512 tokens), with a GEMV-sized and a GEMM-sized
        // remainder; rows spanning several passes per thread with partial sums across depth blocks.
        {530, 600, 40},
        {600, 70, 9},
        {40, 1030, 2100},
    };
    uint32_t seed = 1;
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
        for (const MatmulShape& s : shapes) {
            const auto x = random_vector(size_t(s.T * s.K), seed++);
            const auto w = rounded(random_vector(size_t(s.N * s.K), seed++), dtype);
            DeviceTensor dx = device_from(x, DType::f32, {s.T, s.K});
            DeviceTensor dw = device_from(w, dtype, {s.N, s.K});
            DeviceTensor dy = device_poisoned({s.T, s.N});
            cpu_backend().matmul(dx, dw, dy);
            EXPECT_CLOSE(to_host(dy), reference_matmul(x, w, s.T, s.K, s.N), kMatmulTolerance,
                         "T=" << s.T << " K=" << s.K << " N=" << s.N << " w " << dtype_name(dtype));
        }
    }
}

TEST(Matmul, AcceptsBatchedActivations) {
    // x [2, 3, K] is 6 rows of K.
    const int64_t K = 20, N = 6;
    const auto x = random_vector(size_t(6 * K), 7);
    const auto w = random_vector(size_t(N * K), 8);
    DeviceTensor dx = device_from(x, DType::f32, {2, 3, K});
    DeviceTensor dw = device_from(w, DType::f32, {N, K});
    DeviceTensor dy = device_poisoned({2, 3, N});
    cpu_backend().matmul(dx, dw, dy);
    EXPECT_CLOSE(to_host(dy), reference_matmul(x, w, 6, K, N), kMatmulTolerance, "batched");
}

TEST(Matmul, RejectsMismatchedShapes) {
    DeviceTensor x = device_poisoned({4, 10});
    DeviceTensor w = device_poisoned({6, 11});
    DeviceTensor y = device_poisoned({4, 6});
    expect_error([&] { cpu_backend().matmul(x, w, y); }, {"matmul", "[4, 10]", "[6, 11]"});
    DeviceTensor w_ok = device_poisoned({6, 10});
    DeviceTensor y_bad = device_poisoned({4, 5});
    expect_error([&] { cpu_backend().matmul(x, w_ok, y_bad); }, {"matmul", "[4, 5]", "[4, 6]"});
    DeviceTensor w_i32 = device_from_i32(std::vector<int32_t>(60), {6, 10});
    expect_error([&] { cpu_backend().matmul(x, w_i32, y); }, {"matmul", "i32"});
}

// add_rmsnorm (rmsnorm without x, as at layer 0) then matmul one by one; the fused op; and the
// fallback of a backend without it (unfused_cpu_api): bit-identical y, normed and residual (f32
// activations, as the CPU runs them), with and without x, for bf16 projections at one token and
// three (K = 264 and 1032: tails past the vector widths) and an f32-weight router.
TEST(AddRmsNormMatmul, FusedOpAndFallbackEqualTheTwoOps) {
    Backend unfused(unfused_cpu_api(), 0, "cpu-unfused");
    Backend& cpu = cpu_backend();
    const float eps = 1e-6f;
    struct Shape {
        int64_t rows, K, N;
        DType w_dtype;
    };
    uint32_t seed = 40;
    const Shape shapes[] = {{1, 264, 40, DType::bf16}, {3, 1032, 130, DType::bf16}, {3, 256, 8, DType::f32}};
    for (const Shape& s : shapes) {
        const auto residual_old = random_vector(size_t(s.rows * s.K), seed++, -3.f, 3.f);
        DeviceTensor x = device_from(random_vector(size_t(s.rows * s.K), seed++), DType::f32, {s.rows, s.K});
        DeviceTensor norm_weight = device_from(random_vector(size_t(s.K), seed++, 0.5f, 1.5f), DType::f32, {s.K});
        DeviceTensor w = device_from(random_vector(size_t(s.N * s.K), seed++), s.w_dtype, {s.N, s.K});
        for (const bool with_x : {true, false}) {
            struct Run {
                DeviceTensor residual, normed, y;  // [rows, K] in/out, [rows, K], [rows, N]
            };
            auto prepare = [&] {
                return Run{device_from(residual_old, DType::f32, {s.rows, s.K}), device_poisoned({s.rows, s.K}),
                           device_poisoned({s.rows, s.N})};
            };
            Run want = prepare(), fused = prepare(), fallback = prepare();
            if (with_x) {
                cpu.add_rmsnorm(want.residual, x, norm_weight, eps, want.normed);
            } else {
                cpu.rmsnorm(want.residual, norm_weight, eps, want.normed);
            }
            cpu.matmul(want.normed, w, want.y);
            const Tensor x_or_none = with_x ? x.tensor : Tensor();
            cpu.add_rmsnorm_matmul(fused.residual, x_or_none, norm_weight, eps, fused.normed, w, fused.y);
            unfused.add_rmsnorm_matmul(fallback.residual, x_or_none, norm_weight, eps, fallback.normed, w, fallback.y);
            SCOPED_TRACE(testing::Message() << "rows=" << s.rows << " K=" << s.K << " N=" << s.N << " w="
                                            << dtype_name(s.w_dtype) << (with_x ? " x" : " no x"));
            for (const Run* got : {&fused, &fallback}) {
                const char* which = got == &fused ? "fused" : "fallback";
                EXPECT_EQ(to_host(got->y), to_host(want.y)) << which;
                EXPECT_EQ(to_host(got->normed), to_host(want.normed)) << which;
                EXPECT_EQ(to_host(got->residual), to_host(want.residual)) << which;
            }
            // x is added in place; without it the residual is only read.
            EXPECT_EQ(to_host(want.residual) != residual_old, with_x);
        }
    }
}

}  // namespace
}  // namespace xinfer::test
