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
//     staged kernel would issue).
// H200 (2026-11-30): memcpy 3.94 TB/s; stream rows 3.96 TB/s; grouped 3.51 TB/s without the hint
// and 3.97 TB/s with it; row-contiguous 3.91 TB/s.
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

// ---- bulk copies (TMA, cp.async.bulk) into per-warp shared-memory rings ------------------------
// What the FP8 weight streams would issue with the copy engine of each SM instead of 16-byte
// cp.async per lane: a warp owns 16 rows (as a grouped kernel's tile) and streams them through
// kStages stages of 16 rows × 256 bytes, as 4 KB / kSeg copies of kSeg = 256 or 128 bytes (one a
// lane), or, with kSeg = 0, one contiguous 4 KB copy a stage (lane 0). The warp then reads its stage from shared
// memory (16 bytes a lane a step, as the mma fragments would) and reissues it.
__device__ __forceinline__ unsigned smem_u32(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void bar_expect(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* bar, unsigned parity) {
    unsigned done = 0;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(smem_u32(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}

constexpr int kBulkStageBytes = 4096;

template <int kSeg, int kStages>
__global__ void __launch_bounds__(256, 2) bulk_rows(const char* w) {
    extern __shared__ __align__(1024) unsigned char ring_smem[];
    __shared__ uint64_t bars[8][kStages];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    constexpr int64_t kRowBytes = kCols * 2;
    // Warp tile: 16 rows of one expert (tiles laid out as the grouped kernels': 256 blocks of 8 warps).
    const int64_t tile = int64_t(blockIdx.x) * 8 + warp;
    const char* rows = w + tile * 16 * kRowBytes;
    unsigned char* ring = ring_smem + warp * kStages * kBulkStageBytes;
    if (lane == 0)
        for (int s = 0; s < kStages; ++s) bar_init(&bars[warp][s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    constexpr int kSegBytes = kSeg == 0 ? kBulkStageBytes : kSeg;
    constexpr int kRounds = int(16 * kRowBytes / kBulkStageBytes);
    const auto issue = [&](int round) {
        const int s = round % kStages;
        if (lane == 0) bar_expect(&bars[warp][s], kBulkStageBytes);
        __syncwarp();
        if constexpr (kSeg == 0) {
            if (lane == 0) bulk_copy(ring + s * kBulkStageBytes, rows + int64_t(round) * kBulkStageBytes, kSegBytes, &bars[warp][s]);
        } else {
            // kCopies copies: lane i takes row i % 16, part i / 16 of the row's 256-byte segment.
            constexpr int kCopies = kBulkStageBytes / kSeg;
            if (lane < kCopies) {
                const int row = lane % 16, part = lane / 16;
                bulk_copy(ring + s * kBulkStageBytes + row * 256 + part * kSeg,
                          rows + row * kRowBytes + round * 256 + part * kSeg, kSeg, &bars[warp][s]);
            }
        }
    };
    for (int r = 0; r < kStages && r < kRounds; ++r) issue(r);
    uint32_t acc = 0;
    for (int r = 0; r < kRounds; ++r) {
        const int s = r % kStages;
        bar_wait(&bars[warp][s], unsigned(r / kStages) & 1);
        const uint4* stage = reinterpret_cast<const uint4*>(ring + s * kBulkStageBytes);
#pragma unroll
        for (int i = 0; i < kBulkStageBytes / 16 / 32; ++i) {
            const uint4 v = stage[i * 32 + lane];
            acc ^= v.x ^ v.w;
        }
        __syncwarp();
        if (r + kStages < kRounds) issue(r + kStages);
    }
    if (acc == 0x9e3779b9u) g_sink = acc;
}

// The same ring through a 2-D tensor map (the matrix as [rows][4096] bytes, boxes of 16 rows ×
// 128 bytes, 128-byte swizzle as the mma fragments would want it): a stage is two boxes, both
// issued by lane 0.
__global__ void __launch_bounds__(256, 2) tensor_rows(const __grid_constant__ CUtensorMap map, int64_t row0) {
    extern __shared__ __align__(1024) unsigned char ring_smem[];
    constexpr int kStages = 3;
    __shared__ uint64_t bars[8][kStages];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    constexpr int64_t kRowBytes = kCols * 2;
    const int row = int(row0 + (int64_t(blockIdx.x) * 8 + warp) * 16);
    unsigned char* ring = ring_smem + warp * kStages * kBulkStageBytes;
    if (lane == 0)
        for (int s = 0; s < kStages; ++s) bar_init(&bars[warp][s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    constexpr int kRounds = int(16 * kRowBytes / kBulkStageBytes);
    const auto issue = [&](int round) {
        const int s = round % kStages;
        if (lane == 0) {
            bar_expect(&bars[warp][s], kBulkStageBytes);
#pragma unroll
            for (int b = 0; b < 2; ++b)
                asm volatile(
                    "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
                    "%3}], [%4];" ::"r"(smem_u32(ring + s * kBulkStageBytes + b * 2048)),
                    "l"(reinterpret_cast<uint64_t>(&map)), "r"(round * 256 + b * 128), "r"(row),
                    "r"(smem_u32(&bars[warp][s]))
                    : "memory");
        }
    };
    for (int r = 0; r < kStages; ++r) issue(r);
    uint32_t acc = 0;
    for (int r = 0; r < kRounds; ++r) {
        const int s = r % kStages;
        bar_wait(&bars[warp][s], unsigned(r / kStages) & 1);
        const uint4* stage = reinterpret_cast<const uint4*>(ring + s * kBulkStageBytes);
#pragma unroll
        for (int i = 0; i < kBulkStageBytes / 16 / 32; ++i) {
            const uint4 v = stage[i * 32 + lane];
            acc ^= v.x ^ v.w;
        }
        __syncwarp();
        if (r + kStages < kRounds) issue(r + kStages);
    }
    if (acc == 0x9e3779b9u) g_sink = acc;
}

// The same per-warp ring filled by 16-byte cp.async per lane (the plugin's FP8 streams today):
// a stage is 16 rows × 256 bytes, lane (r, q) = (lane / 2, lane % 2) copies 8 chunks of row r.
template <int kStages>
__global__ void __launch_bounds__(256, 2) cp_async_rows(const char* w) {
    extern __shared__ __align__(1024) unsigned char ring_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    constexpr int64_t kRowBytes = kCols * 2;
    const int64_t tile = int64_t(blockIdx.x) * 8 + warp;
    const char* rows = w + tile * 16 * kRowBytes;
    unsigned char* ring = ring_smem + warp * kStages * kBulkStageBytes;
    constexpr int kRounds = int(16 * kRowBytes / kBulkStageBytes);
    const int row = lane / 2, half = lane % 2;
    const auto issue = [&](int round) {
        const int s = round % kStages;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int chunk = half * 8 + i;  // 16-byte chunk of the row's 256-byte segment
            xcuda::cp_async16_stream(reinterpret_cast<uint4*>(ring + s * kBulkStageBytes + row * 256 + chunk * 16),
                                     rows + row * kRowBytes + int64_t(round) * 256 + chunk * 16);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    for (int r = 0; r < kStages; ++r) issue(r);
    uint32_t acc = 0;
    for (int r = 0; r < kRounds; ++r) {
        const int s = r % kStages;
        asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1) : "memory");
        __syncwarp();
        const uint4* stage = reinterpret_cast<const uint4*>(ring + s * kBulkStageBytes);
#pragma unroll
        for (int i = 0; i < kBulkStageBytes / 16 / 32; ++i) {
            const uint4 v = stage[i * 32 + lane];
            acc ^= v.x ^ v.w;
        }
        __syncwarp();
        if (r + kStages < kRounds) issue(r + kStages);
        else asm volatile("cp.async.commit_group;" ::: "memory");  // keep the group count
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
    // Per-warp rings in shared memory: 3 stages of 4 KB a warp, two 8-warp blocks a SM (96 KB each).
    const unsigned bulk_blocks = unsigned(kExperts * kRows / 16 / 8);
    const auto ring_run = [&](const char* name, auto kernel, int stages) {
        const int smem = 8 * stages * kBulkStageBytes;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        report(name, best_us([&](int i) { kernel<<<bulk_blocks, 256, smem>>>(copy(i)); }));
    };
    ring_run("cp.async ring (16 B a lane, 3 x 4 KB)", cp_async_rows<3>, 3);
    ring_run("bulk ring, 16 rows x 256 B (3 x 4 KB)", bulk_rows<256, 3>, 3);
    ring_run("bulk ring, 16 rows x 256 B (2 x 4 KB)", bulk_rows<256, 2>, 2);
    ring_run("bulk ring, contiguous 4 KB (3 x 4 KB)", bulk_rows<0, 3>, 3);
    ring_run("bulk ring, 32 copies of 128 B (3 x 4 KB)", bulk_rows<128, 3>, 3);
    ring_run("bulk ring, 16 rows x 256 B (5 x 4 KB)", bulk_rows<256, 5>, 5);
    {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
        CUtensorMap map{};
        const int64_t rows_total = int64_t(kCopies) * kExperts * kRows;
        const cuuint64_t dims[2] = {cuuint64_t(kCols * 2), cuuint64_t(rows_total)};
        const cuuint64_t strides[1] = {cuuint64_t(kCols * 2)};
        const cuuint32_t box[2] = {128, 16}, element_strides[2] = {1, 1};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) ==
                cudaSuccess &&
            found == cudaDriverEntryPointSuccess &&
            reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)(
                &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, copies, dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS) {
            const int smem = 8 * 3 * kBulkStageBytes;
            cudaFuncSetAttribute(tensor_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
            report("tensor-map ring, 2 boxes 16 x 128 B (3 x 4 KB)", best_us([&](int i) {
                       tensor_rows<<<bulk_blocks, 256, smem>>>(map, int64_t(i % kCopies) * kExperts * kRows);
                   }));
        } else {
            std::printf("tensor-map ring: cannot encode the tensor map\n");
        }
    }
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
        std::fprintf(stderr, "cuda-stream-patterns: %s\n", cudaGetErrorString(err));
        return 1;
    }
    return 0;
}
