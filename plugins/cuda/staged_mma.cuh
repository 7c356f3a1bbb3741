// A block-level tensor-core loop for weight streams with up to 64 activation rows (the serving-batch
// expert kernels of moe_staged.cu).
//
// A block of 8 warps multiplies a tile of 128 weight rows by up to 64 activation rows over its
// reduction range, 64 columns per stage. Weights [128 × 64] and activations [64 × 64] go through
// a kStages-deep cp.async ring in shared memory (24 KB a stage, so 48 KB of weights per block stay
// in flight); the 16-byte units are XOR-swizzled so that both the copies and ldmatrix are free of
// bank conflicts. Warp w owns weight rows 16w .. 16w+15 and every 8-row activation tile that holds
// at least one valid row: acc[t] is the mma m16n8 accumulator of activation tile t (row g / g+8 of
// the warp's 16, activation rows 8t + 2c, 8t + 2c + 1).
#pragma once

#include "moe_common.cuh"

#include <cstdint>

namespace xcuda {
namespace {

constexpr int kStages = 4;
constexpr int kBK = 64;                              // reduction columns per stage
constexpr int kUnits = kBK / 8;                      // 16-byte units per staged row
constexpr int kTileRows = 128;                       // weight rows per block
constexpr int kTileActs = 64;                        // activation rows per block
constexpr int kThreads = 256;                        // 8 warps × 16 weight rows
constexpr int kStageUnits = (kTileRows + kTileActs) * kUnits;
constexpr size_t kRingBytes = size_t(kStages) * kStageUnits * 16;

// 16-byte unit (row, u) of a staged [rows][kUnits] tile; u ^ (row % 8) puts the 8 rows that one
// ldmatrix matrix reads in 8 different bank groups.
__device__ __forceinline__ int unit(int row, int u) { return row * kUnits + (u ^ (row & 7)); }

// Copies 16 bytes global → shared, or writes zeros when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(uint4* dst, const void* src, bool valid) {
    const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Four 8×8 bf16 matrices; lane l gives the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint4* p) {
    const uint32_t a = uint32_t(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// acc = Σ over nk stages of W_tile · A_tileᵀ. load_weights(slot, k0) / load_acts(slot, k0) issue
// the thread's cp.async copies of the stage starting at column k0 into ring slot `slot`;
// between_prologues() runs after the first weight stages are requested and before any activation
// is (the place for pdl_begin when the activations come from the previous kernel).
template <typename LoadW, typename LoadA, typename Between>
__device__ __forceinline__ void staged_mma(uint4* ring /*[kStages][kStageUnits]*/, int nk, int n_tiles,
                                           const LoadW& load_weights, const LoadA& load_acts,
                                           const Between& between_prologues, float (&acc)[8][4]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[t][r] = 0.f;
    // Prologue: stages 0 .. kStages-2; each commit group closes with one stage's activations.
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s)
        if (s < nk) load_weights(s, int64_t(s) * kBK);
    between_prologues();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < nk) load_acts(s, int64_t(s) * kBK);
        cp_async_commit();
    }
    for (int ks = 0; ks < nk; ++ks) {
        cp_async_wait<kStages - 2>();  // stage ks has landed (this thread's copies)
        __syncthreads();               // ... and everyone's; the slot of stage ks-1 is free again
        const int next = ks + kStages - 1;
        if (next < nk) {
            load_weights(next % kStages, int64_t(next) * kBK);
            load_acts(next % kStages, int64_t(next) * kBK);
        }
        cp_async_commit();
        const uint4* stage = ring + (ks % kStages) * kStageUnits;
        const uint4* acts = stage + kTileRows * kUnits;
#pragma unroll
        for (int u = 0; u < kUnits; u += 2) {  // one k16 step: units u, u + 1
            uint32_t a[4];
            ldmatrix_x4(a, stage + unit(warp * 16 + lane % 16, u + lane / 16));
#pragma unroll
            for (int t2 = 0; t2 < 4; ++t2) {  // two 8-row activation tiles per ldmatrix
                if (2 * t2 >= n_tiles) break;  // block-uniform
                uint32_t b[4];
                ldmatrix_x4(b, acts + unit(t2 * 16 + (lane / 16) * 8 + lane % 8, u + (lane / 8) % 2));
                mma_16816(acc[2 * t2], a[0], a[1], a[2], a[3], b[0], b[1]);
                if (2 * t2 + 1 < n_tiles) mma_16816(acc[2 * t2 + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring may be reused by the caller
}

}  // namespace
}  // namespace xcuda
