// matmul y = x · wᵀ against a float64 reference, over shapes that hit both the GEMV path
// (T < 32: partial token blocks, partial row groups, K tails shorter than a vector pair) and the
// blocked GEMM path (T ≥ 32: partial token panels, partial row tiles, K crossing the 512-wide
// depth blocks, 512-token chunks), for f32, bf16 and f16 weights.
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

}  // namespace
}  // namespace xinfer::test
