// The custom tensor-core GEMM used where cuBLASLt does not fit: FP8 block-scaled weights
// (dequantized tile by tile into shared memory) and grouped expert GEMMs whose per-expert row
// counts exist only on the device. Defined in gemm.cu, used by gemm.cu and moe.cu.
#pragma once

#include "common.h"

#include <cuda_bf16.h>

namespace xcuda {

constexpr int kGemmTileM = 64;  // rows of C per block; grouped tile lists are built in units of this
constexpr int kGemmTileN = 64;

// C[row, n] = Σ_k A[a_row(row), k] · B[group][n, k], f32 accumulation, bf16 tensor cores.
//
// Rows come in tiles of ≤ kGemmTileM rows that share one weight group. Dense use (tiles ==
// nullptr): tile x covers rows [x·64, min(m, x·64+64)) of group 0. Grouped use: tiles[x] =
// (group, row_begin, row_end, 0) for x < *n_tiles, built on the device (moe.cu); blocks past
// *n_tiles exit at once, so the grid can be sized by an upper bound without a host read.
struct GroupedGemm {
    const __nv_bfloat16* a = nullptr;  // [*, lda] activations
    int64_t lda = 0;
    const int32_t* a_rows = nullptr;   // [rows]: A row of tile-space row i is a_rows[i] / a_row_div; null = i
    int a_row_div = 1;

    const void* b = nullptr;           // [groups][n, k] bf16 or f8_e4m3 weights, row-major
    int b_dtype = XINFER_DTYPE_BF16;
    int64_t n = 0, k = 0;
    int64_t b_group_stride = 0;        // elements between groups
    // f8 only: w[r, c] = fp8(B[r, c]) · scale[scale_row(r), c / block_cols]; scale_row restarts
    // every shard_rows rows (tensor-parallel exports), blocks_per_shard rows of scale per shard.
    const float* b_scale = nullptr;    // [groups][scale_rows, scale_cols]
    int64_t scale_cols = 0, scale_group_stride = 0;
    int64_t block_rows = 128, block_cols = 128, shard_rows = 0, blocks_per_shard = 0;

    void* c = nullptr;                 // [*, ldc] f32 / bf16 / f16
    int c_dtype = XINFER_DTYPE_F32;
    int64_t ldc = 0;
    const int32_t* c_rows = nullptr;   // [rows]: C row of tile-space row i; null = i

    const int4* tiles = nullptr;       // grouped: [max_tiles] (group, row_begin, row_end, 0)
    const int32_t* n_tiles = nullptr;  // grouped: device count of valid tiles
    int64_t m = 0;                     // dense: rows
};

// Launches ceil(m/64) (dense) or max_tiles (grouped) row tiles × ceil(n/64) column tiles.
int launch_grouped_gemm(Context* c, const GroupedGemm& g, int64_t max_tiles);

// The few-row path (decode, speculative verification, small MoE batches), where a GEMM is a
// weight stream: one warp per output column n reads W[group][n, :] once with 16-byte loads and
// dots it with up to kGemvMaxRows activation rows. Rows come in groups that share a weight group:
// dense = one group of T ≤ 8 rows per grid row, MoE = one (token, slot) pair per group, whose
// expert is group_of[pair]. Fields are as in GroupedGemm; the A row of row r is r / a_row_div
// and the C row is r. Needs gemv_fits().
constexpr int kGemvMaxRows = 8;
struct Gemv {
    GroupedGemm w;                     // a, lda, a_row_div, b..., c, c_dtype, ldc (rows/tiles unused)
    int64_t rows = 0;                  // total rows
    int rows_per_group = 1;            // ≤ kGemvMaxRows
    const int32_t* group_of = nullptr; // [rows / rows_per_group] weight group per row group; null = 0
    int n_groups = 1;                  // group ids outside [0, n_groups) give NaN rows
};
bool gemv_fits(const Gemv& g);

// Whether an FP8 tensor-core stream (mma_gemv_kernel, the grouped expert gate_up kernel) may
// run the f16 mma on e4m3 weights widened to f16, with its activations staged as power-of-two-
// scaled f16 in shared memory (weight_stream.cuh: stage_act_f16). XINFER_CUDA_FP8_F16_MMA: a mask
// of the kernels that do (default 3 = both; 0 = the bf16 mma everywhere).
enum F16MmaKernel { kF16MmaGemv = 1, kF16MmaGateUp = 2 };
bool fp8_f16_mma_enabled(int kernel);
int launch_gemv(Context* c, const Gemv& g);

// w[N, K] e4m3 with block scales (GroupedGemm's scale grid: restarting every shard_rows rows,
// blocks_per_shard scale rows per shard) → out[N, K] bf16, out = bf16(fp8 · scale) as the tiled
// kernel rounds it. Prefill-sized FP8 matmuls (dense and per expert) then run on cuBLASLt.
int launch_widen_fp8(Context* c, const void* w, const float* scale, int64_t N, int64_t K, int64_t scale_cols,
                     int64_t block_rows, int64_t block_cols, int64_t shard_rows, int64_t blocks_per_shard,
                     __nv_bfloat16* out);

// cuBLASLt: y[T, N] = x[T, K] · w[N, K]ᵀ, x and w of dtype ab (f32, bf16, f16), y of dtype d, f32
// accumulation; algorithms cached per shape. XINFER_UNSUPPORTED (no message) when cuBLASLt offers
// no algorithm.
int lt_matmul(Context* c, const void* x, const void* w, void* y, int64_t T, int64_t N, int64_t K, int ab, int d);

}  // namespace xcuda
