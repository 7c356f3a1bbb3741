// cuda-stream-patterns: how fast HBM streams a weight matrix under the load patterns the plugin's
// few-token kernels use. Each pattern reads 8 experts × [4096 × 2048] bf16 (134 MB, MiMo's down
// projections for one token), rotating over 8 copies (1 GB) so no copy is still in the 50 MB L2,
// and prints GB/s next to a device-to-device memcpy of the same bytes (read + write counted).
//
//   - stream rows: a warp reads 512 contiguous bytes of one row per load (moe.cu's per-pair
//     stream kernel, gemm.cu's stream GEMV);
//   - grouped: lane (g, c) reads 16 bytes of rows g and g + 8 at column chunk c, so one warp load
//     touches 64 bytes of each of 8 rows (the mma.sync A-fragment layout of moe.cu's grouped
//     kernels), with and without the .L2::128B prefetch-size hint on the load;
//   - row-contiguous: 16 rows per warp, one 512-byte row segment per load (what a shared-memory
//     staged kernel would issue);
//   - per-warp shared-memory rings filled by cp.async, bulk copies or tensor-map boxes (below).
// H200 (2026-11-30): memcpy 3.94 TB/s; stream rows 3.96 TB/s; grouped 3.51 TB/s without the hint
// and 3.97 TB/s with it; row-contiguous 3.91 TB/s.
#include "tma.cuh"
#include "weight_stream.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace {

constexpr int64_t kExperts = 8, kRows = 4096, kCols = 2048;  // bf16 elements
constexpr size_t kBytes = size_t(kExperts * kRows * kCols) * 2;
constexpr int kCopies = 8;

__device__ uint32_t g_sink;  // keeps the loads live

// The plugin's streaming load (weight_stream.cuh), with or without the .L2::128B hint.
template <bool kHint>
__device__ __forceinline__ uint4 load(const char* p) {
    return xcuda::load_stream16<kHint>(p);
}

// One warp per row, 8 loads of 16 bytes in flight per lane.
__global__ void __launch_bounds__(256) stream_rows(const char* w) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const char* row = w + (int64_t(blockIdx.x) * 8 + warp) * kCols * 2;
    uint32_t acc = 0;
    for (int64_t col = 0; col < kCols; col += 32 * 8 * 8) {
        uint4 a[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) a[u] = load<false>(row + (col + (u * 32 + lane) * 8) * 2);
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= a[u].x ^ a[u].w;
    }
    if (acc == 0x9e3779b9u) g_sink = acc;
}

// A block owns 16 rows of every expert (warp e: expert e), as moe_grouped_down_kernel does.
// kRowContiguous: each load is one row's 512-byte segment; else the mma fragment layout.
template <bool kRowContiguous, bool kHint>
__global__ void __launch_bounds__(256, 2) grouped(const char* w) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int64_t n0 = int64_t(blockIdx.x) * 16;
    const char* base = w + warp * kRows * kCols * 2;
    uint32_t acc = 0;
    if constexpr (kRowContiguous) {
        for (int64_t col = 0; col < kCols; col += 256) {
            uint4 a[16];
#pragma unroll
            for (int r = 0; r < 16; ++r) a[r] = load<kHint>(base + ((n0 + r) * kCols + col + lane * 8) * 2);
#pragma unroll
            for (int r = 0; r < 16; ++r) acc ^= a[r].x ^ a[r].w;
        }
    } else {
        const char* w0 = base + (n0 + g) * kCols * 2;
        const char* w1 = base + (n0 + g + 8) * kCols * 2;
        for (int64_t col = 0; col < kCols; col += 32 * 8) {
            uint4 a0[8], a1[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                a0[u] = load<kHint>(w0 + (col + u * 32 + c * 8) * 2);
                a1[u] = load<kHint>(w1 + (col + u * 32 + c * 8) * 2);
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) acc ^= a0[u].x ^ a1[u].w;
        }
    }
    if (acc == 0x9e3779b9u) g_sink = acc;
}

// ---- per-warp shared-memory rings: cp.async against the copy engine (TMA) ----------------------
// A warp owns 16 rows (a grouped kernel's tile) and streams them through kStages stages of 16 rows
// × 256 bytes (4 KB), reads each stage back from shared memory (16 bytes a lane a step, as the mma
// fragments would) and reissues it. The stage arrives as
//   - 16-byte cp.async, lane (g, c) copying chunk c of each 64-byte quarter of rows g and g + 8
//     (the plugin's FP8 rings, weight_stream.cuh LaneRounds);
//   - bulk copies (cp.async.bulk), 4 KB / kSeg of kSeg = 256 or 128 bytes (one a lane), or with
//     kSeg = 0 one contiguous 4 KB copy (lane 0);
//   - two 2-D tensor-map boxes of 16 rows × 128 bytes, 128-byte swizzle (lane 0).
// H100 (2026-12-07, session 36): memcpy 2,893 GB/s; grouped with the hint 2,778; bulk rows of
// 256 B 2,823-2,917, 128 B 2,612-2,638, contiguous 2,770-2,871; tensor-map boxes 2,869-2,931; the
// cp.async ring in the plugin's layout 2,857 (measured beside the 2,869). And the plugin's FP8
// kernels on tensor-map rounds were no faster than on their cp.async rings (q|k|v 22.5 -> 23.2 µs,
// experts 79.6 -> 80.1 µs; decode graph 7.116 -> 7.125 ms).
using xcuda::mbar_arrive_expect_tx;
using xcuda::mbar_init;
using xcuda::mbar_wait;
using xcuda::smem_addr;

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

constexpr int kStageBytes = 4096;
constexpr int64_t kRowBytes = kCols * 2;
constexpr int kRounds = int(16 * kRowBytes / kStageBytes);  // a warp's 16 rows, 256 bytes of each a round

// The warp's read-back of a stage, the same for every pattern.
__device__ __forceinline__ uint32_t read_stage(const unsigned char* stage, int lane) {
    uint32_t acc = 0;
#pragma unroll
    for (int i = 0; i < kStageBytes / 16 / 32; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(stage)[i * 32 + lane];
        acc ^= v.x ^ v.w;
    }
    return acc;
}

// kMode: 0 cp.async (fragment layout), 1 bulk copies of kSeg bytes (0: one 4 KB copy), 2 tensor map.
template <int kMode, int kSeg, int kStages>
__global__ void __launch_bounds__(256, 2) ring_rows(const char* w, const __grid_constant__ CUtensorMap map, int64_t row0) {
    extern __shared__ __align__(1024) unsigned char ring_smem[];
    __shared__ uint64_t bars[8][kStages];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int64_t tile = int64_t(blockIdx.x) * 8 + warp;
    const char* rows = w + tile * 16 * kRowBytes;
    unsigned char* ring = ring_smem + warp * kStages * kStageBytes;
    if (kMode != 0 && lane == 0) {
        for (int s = 0; s < kStages; ++s) mbar_init(&bars[warp][s], 1);
        xcuda::fence_mbarrier_init();
    }
    __syncwarp();
    const auto issue = [&](int round) {
        const int s = round % kStages;
        unsigned char* stage = ring + s * kStageBytes;
        if constexpr (kMode == 0) {
#pragma unroll
            for (int q = 0; q < 4; ++q)  // 64-byte quarters of the rows' 256 bytes
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = g + 8 * h, col = round * 256 + q * 64 + c * 16;
                    xcuda::cp_async16_stream(reinterpret_cast<uint4*>(stage + r * 256 + q * 64 + c * 16),
                                             rows + r * kRowBytes + col);
                }
            asm volatile("cp.async.commit_group;" ::: "memory");
            return;
        }
        if (lane == 0) mbar_arrive_expect_tx(&bars[warp][s], kStageBytes);
        __syncwarp();
        if constexpr (kMode == 2) {
            if (lane == 0)
                for (int b = 0; b < 2; ++b)
                    xcuda::tma_load_2d(stage + b * 2048, &map, round * 256 + b * 128, int(row0 + tile * 16), &bars[warp][s]);
        } else if constexpr (kSeg == 0) {
            if (lane == 0) bulk_copy(stage, rows + int64_t(round) * kStageBytes, kStageBytes, &bars[warp][s]);
        } else {
            constexpr int kCopies = kStageBytes / kSeg;  // lane i: row i % 16, part i / 16 of its 256 bytes
            if (lane < kCopies)
                bulk_copy(stage + (lane % 16) * 256 + (lane / 16) * kSeg,
                          rows + (lane % 16) * kRowBytes + round * 256 + (lane / 16) * kSeg, kSeg, &bars[warp][s]);
        }
    };
    for (int r = 0; r < kStages; ++r) issue(r);
    uint32_t acc = 0;
    for (int r = 0; r < kRounds; ++r) {
        const int s = r % kStages;
        if constexpr (kMode == 0) {
            asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1) : "memory");
            __syncwarp();
        } else {
            mbar_wait(&bars[warp][s], unsigned(r / kStages) & 1);
        }
        acc ^= read_stage(ring + s * kStageBytes, lane);
        __syncwarp();
        if (r + kStages < kRounds) issue(r + kStages);
        else if (kMode == 0) asm volatile("cp.async.commit_group;" ::: "memory");  // keeps the group count
    }
    if (acc == 0x9e3779b9u) g_sink = acc;
}

template <typename F>
float best_us(F launch) {
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    for (int i = 0; i < 3; ++i) launch(i);
    float best = 1e30f;
    for (int rep = 0; rep < 24; ++rep) {
        cudaEventRecord(start);
        launch(rep);
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float ms = 0.f;
        cudaEventElapsedTime(&ms, start, stop);
        best = ms < best ? ms : best;
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return best * 1e3f;
}

}  // namespace

int main() {
    char* copies = nullptr;
    char* dst = nullptr;
    if (cudaMalloc(&copies, kBytes * kCopies) != cudaSuccess || cudaMalloc(&dst, kBytes) != cudaSuccess) {
        std::fprintf(stderr, "cuda-stream-patterns: cannot allocate %zu bytes of device memory\n",
                     kBytes * (kCopies + 1));
        return 1;
    }
    cudaMemset(copies, 1, kBytes * kCopies);
    const auto copy = [&](int i) { return copies + size_t(i % kCopies) * kBytes; };
    const float memcpy_us = best_us([&](int i) { cudaMemcpyAsync(dst, copy(i), kBytes, cudaMemcpyDeviceToDevice); });
    std::printf("%-40s %8.1f us %7.0f GB/s (read + write)\n", "memcpy", memcpy_us, 2 * kBytes / memcpy_us / 1e3);
    const auto report = [&](const char* name, float us) {
        std::printf("%-40s %8.1f us %7.0f GB/s\n", name, us, kBytes / us / 1e3);
    };
    const unsigned tiles = unsigned(kRows / 16);
    report("stream rows (512 B of one row per load)",
           best_us([&](int i) { stream_rows<<<unsigned(kExperts * kRows / 8), 256>>>(copy(i)); }));
    report("grouped (64 B of 8 rows per load)", best_us([&](int i) { grouped<false, false><<<tiles, 256>>>(copy(i)); }));
    report("grouped, .L2::128B", best_us([&](int i) { grouped<false, true><<<tiles, 256>>>(copy(i)); }));
    report("row-contiguous (16 rows x 512 B)", best_us([&](int i) { grouped<true, false><<<tiles, 256>>>(copy(i)); }));
    // Per-warp rings in shared memory: 4 KB stages, two 8-warp blocks a SM (but 5 stages: one).
    CUtensorMap map{};
    const int64_t rows_total = int64_t(kCopies) * kExperts * kRows;
    const cuuint64_t dims[2] = {cuuint64_t(kRowBytes), cuuint64_t(rows_total)};
    const cuuint64_t strides[1] = {cuuint64_t(kRowBytes)};
    const cuuint32_t box[2] = {128, 16}, element_strides[2] = {1, 1};
    const PFN_cuTensorMapEncodeTiled_v12000 encode = xcuda::tensor_map_encoder();
    const bool have_map = encode && encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, copies, dims, strides, box,
                                           element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                           CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
    const unsigned ring_blocks = unsigned(kExperts * kRows / 16 / 8);
    const auto ring_run = [&](const char* name, auto kernel, int stages) {
        const int smem = 8 * stages * kStageBytes;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        report(name, best_us([&](int i) {
                   kernel<<<ring_blocks, 256, smem>>>(copy(i), map, int64_t(i % kCopies) * kExperts * kRows);
               }));
    };
    ring_run("cp.async ring, fragment layout (3 x 4 KB)", ring_rows<0, 0, 3>, 3);
    ring_run("bulk ring, 16 rows x 256 B (2 x 4 KB)", ring_rows<1, 256, 2>, 2);
    ring_run("bulk ring, 16 rows x 256 B (3 x 4 KB)", ring_rows<1, 256, 3>, 3);
    ring_run("bulk ring, 16 rows x 256 B (5 x 4 KB)", ring_rows<1, 256, 5>, 5);
    ring_run("bulk ring, 32 copies of 128 B (3 x 4 KB)", ring_rows<1, 128, 3>, 3);
    ring_run("bulk ring, contiguous 4 KB (3 x 4 KB)", ring_rows<1, 0, 3>, 3);
    if (have_map) ring_run("tensor-map ring, 2 boxes 16 x 128 B (3 x 4 KB)", ring_rows<2, 0, 3>, 3);
    else std::printf("tensor-map ring: the driver could not encode the tensor map\n");
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
        std::fprintf(stderr, "cuda-stream-patterns: %s\n", cudaGetErrorString(err));
        return 1;
    }
    return 0;
}
