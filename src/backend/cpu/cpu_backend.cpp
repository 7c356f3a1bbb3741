// CPU backend support: host memory and the copy-bandwidth probe (the plugin table that exposes
// them and the kernels is cpu_abi.cpp).
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/simd.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace xinfer::cpu {

std::string dtype_list(std::initializer_list<DType> dtypes) {
    std::string s;
    for (DType d : dtypes) s += (s.empty() ? "" : " or ") + std::string(dtype_name(d));
    return s;
}

void widen_to_f32(DType dtype, const void* src, float* dst, int64_t n) {
    switch (dtype) {
        case DType::f32: std::memcpy(dst, src, size_t(n) * sizeof(float)); return;
        case DType::bf16: simd::widen_row<simd::WeightBf16>(static_cast<const uint16_t*>(src), dst, n); return;
        case DType::f16: simd::widen_row<simd::WeightF16>(static_cast<const uint16_t*>(src), dst, n); return;
        default: convert_to_f32(dtype, src, dst, n); return;
    }
}

namespace {

// Cache-line alignment: every SIMD row starts on a line when row sizes allow. (Transparent huge
// pages were tried for weights: no measurable GEMV gain here, and first-touch compaction stalls
// of seconds.)
constexpr size_t kAlignment = 64;

void* aligned_host_alloc(size_t bytes) {
    const size_t rounded = (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (!p) fail("cpu: cannot allocate {} bytes of host memory", bytes);
    return p;
}

}  // namespace

void* host_alloc(size_t bytes) { return aligned_host_alloc(bytes); }

double measure_copy_bandwidth_gbps() {
    // Source and destination are each ≥ 512 MiB and ≥ 2× the last-level cache, so together
    // they are ≥ 4× it and the copy streams DRAM. (Larger only adds first-touch time: ~1 s
    // per GiB in the reference VM, for the same figure.)
    const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
    const size_t bytes = std::max<size_t>(size_t(512) << 20, llc > 0 ? 2 * size_t(llc) : 0);
    char* src = static_cast<char*>(aligned_host_alloc(bytes));
    char* dst = static_cast<char*>(aligned_host_alloc(bytes));
    auto parallel_copy = [&](bool first_touch) {
#pragma omp parallel
        {
            const size_t n = size_t(omp_get_num_threads()), i = size_t(omp_get_thread_num());
            const size_t begin = bytes * i / n, end = bytes * (i + 1) / n;
            if (first_touch) {
                // Touch pages from the threads that will copy them (first-touch placement).
                std::memset(src + begin, 1, end - begin);
                std::memset(dst + begin, 0, end - begin);
            }
            std::memcpy(dst + begin, src + begin, end - begin);
        }
    };
    parallel_copy(true);
    double best = 0.0;
    for (int rep = 0; rep < 4; ++rep) {
        const auto start = std::chrono::steady_clock::now();
        parallel_copy(false);
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        best = std::max(best, 2.0 * double(bytes) / seconds / 1e9);
    }
    std::free(src);
    std::free(dst);
    return best;
}

}  // namespace xinfer::cpu

