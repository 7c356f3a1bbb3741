// CPU matmul benchmark: decode GEMV bandwidth against the measured copy bandwidth, and prefill
// GEMM GFLOP/s against the measured FMA peak (DESIGN.md: benchmarks print measured figures next
// to the physical limit).
//
//   cpu_matmul_bench [--quick] [decode | prefill]
//
// Every figure streams a set of weight matrices totalling ≥ 512 MiB round-robin, so no matrix
// is still cached (the reference VM reports a 260 MiB L3) when it is used again: decode reads
// weights from DRAM as it would in a real model, and prefill must hide that stream behind compute.
#include "backend/backend.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

using namespace xinfer;

namespace {

double now_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Peak f32 FMA throughput of all threads: independent FMA chains in inline assembly (compilers
// fold or spill such loops when written in C++).
double measure_fma_peak_gflops() {
#if defined(__AVX512F__)
    constexpr int kFlopsPerIteration = 12 * 16 * 2;
#define XINFER_FMA(i) "vfmadd231ps %%zmm14, %%zmm15, %%zmm" #i "\n"
#define XINFER_ZERO "vxorps %%xmm14, %%xmm14, %%xmm14\nvxorps %%xmm15, %%xmm15, %%xmm15\n"
#define XINFER_CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"
#elif defined(__AVX2__) && defined(__FMA__)
    constexpr int kFlopsPerIteration = 12 * 8 * 2;
#define XINFER_FMA(i) "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #i "\n"
#define XINFER_ZERO "vxorps %%xmm14, %%xmm14, %%xmm14\nvxorps %%xmm15, %%xmm15, %%xmm15\n"
#define XINFER_CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"
#endif
#ifdef XINFER_FMA
    const int64_t iterations = 50'000'000;
    double best = 0.0;
    for (int rep = 0; rep < 3; ++rep) {
        const double start = now_seconds();
#pragma omp parallel
        {
            int64_t n = iterations;
            asm volatile(XINFER_ZERO
                         "1:\n" XINFER_FMA(0) XINFER_FMA(1) XINFER_FMA(2) XINFER_FMA(3) XINFER_FMA(4) XINFER_FMA(5)
                             XINFER_FMA(6) XINFER_FMA(7) XINFER_FMA(8) XINFER_FMA(9) XINFER_FMA(10) XINFER_FMA(11)
                                 "dec %0\n"
                                 "jnz 1b\n"
                         : "+r"(n)
                         :
                         : XINFER_CLOBBER, "xmm14", "xmm15", "cc");
        }
        const double seconds = now_seconds() - start;
        best = std::max(best, double(kFlopsPerIteration) * double(iterations) * omp_get_max_threads() / seconds / 1e9);
    }
    return best;
#else
    return 0.0;
#endif
}

// Cheap deterministic fill in [-1, 1), parallel so that 1 GiB takes well under a second.
void fill(const Tensor& t, uint32_t seed) {
    const int64_t n = t.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
        uint32_t h = uint32_t(i) * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        const float value = float(h & 0xffffff) / float(1 << 23) - 1.f;
        if (t.dtype == DType::f32) {
            t.as<float>()[i] = value;
        } else if (t.dtype == DType::bf16) {
            t.as<uint16_t>()[i] = f32_to_bf16(value);
        } else {
            t.as<uint16_t>()[i] = f32_to_f16(value);
        }
    }
}

struct Matrix {
    Buffer buffer;
    Tensor tensor;
};

Matrix make_matrix(Backend& backend, DType dtype, int64_t rows, int64_t cols, uint32_t seed) {
    Matrix m;
    m.buffer = backend.alloc(dtype_row_bytes(dtype, rows * cols));
    m.tensor = Tensor(m.buffer.data(), dtype, {rows, cols});
    fill(m.tensor, seed);
    return m;
}

struct Limits {
    double copy_gbps, fma_gflops;
};

// y = x · wᵀ for each T, cycling through matrices of `total_bytes` in all; best of `rounds`.
void bench_matmul(Backend& backend, DType dtype, int64_t out, int64_t in, const std::vector<int64_t>& token_counts,
                  int64_t total_bytes, int rounds, const Limits& limits) {
    const int64_t matrix_bytes = int64_t(dtype_row_bytes(dtype, out * in));
    const int n_matrices = int(std::max<int64_t>(2, total_bytes / matrix_bytes));
    std::vector<Matrix> weights;
    for (int i = 0; i < n_matrices; ++i) weights.push_back(make_matrix(backend, dtype, out, in, uint32_t(i + 1)));
    for (int64_t T : token_counts) {
        Matrix x = make_matrix(backend, DType::f32, T, in, 99);
        Matrix y = make_matrix(backend, DType::f32, T, out, 98);
        for (const Matrix& w : weights) backend.matmul(x.tensor, w.tensor, y.tensor);  // warm-up pass
        double best = 1e30;
        for (int r = 0; r < rounds; ++r) {
            const double start = now_seconds();
            for (const Matrix& w : weights) backend.matmul(x.tensor, w.tensor, y.tensor);
            best = std::min(best, (now_seconds() - start) / n_matrices);
        }
        const double gbps = double(matrix_bytes) / best / 1e9;
        const double gflops = 2.0 * double(T * out * in) / best / 1e9;
        fmt::print(
            "  {:>4} T={:<3} [{}x{}] x{:<2}: {:8.3f} ms  weights {:5.1f} GB/s = {:3.0f}% of copy  |  {:6.1f} GFLOP/s = "
            "{:3.0f}% of FMA peak\n",
            dtype_name(dtype), T, out, in, n_matrices, best * 1e3, gbps, 100.0 * gbps / limits.copy_gbps, gflops,
            limits.fma_gflops > 0 ? 100.0 * gflops / limits.fma_gflops : 0.0);
    }
}

}  // namespace

// Read-only streaming bandwidth of all threads (GB/s, best of 3 over 1 GiB): what a decode GEMV
// could reach at most, next to the copy bandwidth its fraction is reported against. Each thread
// sums its contiguous part, 256 bytes at a time, prefetching 16 KiB ahead into L2 (the best of the
// variants tried on the reference VM, where a plain read reached ~25 and this ~28 GB/s against
// ~40 GB/s of copy).
double measure_read_bandwidth_gbps() {
    const size_t bytes = size_t(1) << 30, n = bytes / sizeof(float);
    std::vector<float> data(n);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i) data[i] = float(i & 7);  // first touch by the reading thread
    double best = 0, checksum = 0;
    for (int rep = 0; rep < 3; ++rep) {
        const double start = now_seconds();
        double sum = 0;
#pragma omp parallel reduction(+ : sum)
        {
            // 64 independent lanes (four 16-float vectors): the adds never wait on each other.
            alignas(64) float acc[64] = {};
#pragma omp for schedule(static)
            for (size_t block = 0; block < n / 64; ++block) {
                const float* p = data.data() + block * 64;
                for (int line = 0; line < 4; ++line) __builtin_prefetch(p + 4096 + 16 * line, 0, 2);
#pragma omp simd
                for (int i = 0; i < 64; ++i) acc[i] += p[i];
            }
            for (float a : acc) sum += a;
        }
        best = std::max(best, double(bytes) / (now_seconds() - start) / 1e9);
        checksum += sum;
    }
    if (checksum < 0) fmt::print("impossible checksum\n");  // keeps the sums live
    return best;
}

int main(int argc, char** argv) {
    bool quick = false, decode = true, prefill = true;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--quick") quick = true;
        if (arg == "decode") prefill = false;
        if (arg == "prefill") decode = false;
    }
    auto backend = make_backend("cpu");
    fmt::print("cpu backend, {} OpenMP threads\n", omp_get_max_threads());

    Limits limits{0.0, 0.0};
    const double start = now_seconds();
    limits.copy_gbps = backend->measure_copy_bandwidth_gbps();
    fmt::print("copy bandwidth: {:.1f} GB/s (read + write; the probe took {:.2f} s)\n", limits.copy_gbps,
               now_seconds() - start);
    fmt::print("read-only bandwidth: {:.1f} GB/s (the most a weight stream can reach here)\n",
               measure_read_bandwidth_gbps());
    limits.fma_gflops = measure_fma_peak_gflops();
    fmt::print("f32 FMA peak: {:.1f} GFLOP/s\n", limits.fma_gflops);

    const int rounds = quick ? 2 : 5;
    const int64_t gib = int64_t(1) << 30;
    // The reference VM shares DRAM with its neighbours and its clock drifts, so each limit is
    // measured again right before the figures that are compared with it.
    if (decode) fmt::print("decode GEMV, 1 GiB of weights per dtype:\n");
    const std::vector<int64_t> decode_tokens = quick ? std::vector<int64_t>{1} : std::vector<int64_t>{1, 2, 4, 8, 16};
    for (DType dtype : {DType::bf16, DType::f32, DType::f16}) {
        if (!decode || (quick && dtype == DType::f16)) continue;
        limits.copy_gbps = backend->measure_copy_bandwidth_gbps();
        fmt::print(" (copy bandwidth now {:.1f} GB/s)\n", limits.copy_gbps);
        bench_matmul(*backend, dtype, 16384, 4096, dtype == DType::f16 ? std::vector<int64_t>{1} : decode_tokens, gib,
                     rounds, limits);
    }

    if (!prefill) return 0;
    limits.fma_gflops = measure_fma_peak_gflops();
    fmt::print("prefill GEMM, 512 MiB of weights per shape (FMA peak now {:.1f} GFLOP/s):\n", limits.fma_gflops);
    const std::vector<int64_t> prefill_tokens =
        quick ? std::vector<int64_t>{64, 256} : std::vector<int64_t>{32, 64, 128, 256, 512};
    bench_matmul(*backend, DType::bf16, 4096, 4096, prefill_tokens, gib / 2, quick ? 1 : 3, limits);
    bench_matmul(*backend, DType::f32, 4096, 4096, prefill_tokens, gib / 2, quick ? 1 : 3, limits);
    if (!quick) bench_matmul(*backend, DType::bf16, 16384, 4096, {64, 256}, gib / 2, 2, limits);
    return 0;
}
