// Block-scaled FP8 (DeepSeek / MiMo "fp8" quantization_config): an F8_E4M3 weight [rows, cols]
// with an F32 companion "<name>_scale_inv" [scale_rows, scale_cols], one multiplier per
// block_rows × block_cols block: W[r, c] = fp8(W8[r, c]) · scale[row_block(r), c / block_cols].
//
// The row grid is normally contiguous (row_block(r) = r / block_rows), but a checkpoint exported
// from tensor-parallel shards quantizes each shard separately, so the grid restarts at every
// shard boundary and partial edge blocks appear inside the matrix (research/mimo_v2_flash.md
// §6.4: MiMo-V2-Flash's GA k_proj [768, 4096] has scales [8, 32] = 4 shards × ceil(192/128)).
// fit_fp8_scale_grid recognises that layout from the scale's row count alone.
#pragma once

#include "core/dtype.h"

#include <cstdint>
#include <optional>

namespace xinfer {

struct Fp8ScaleGrid {
    int64_t rows = 0, cols = 0;  // of one weight matrix
    int64_t block_rows = 128, block_cols = 128;
    int64_t scale_rows = 0, scale_cols = 0;  // of its scale matrix
    int64_t shard_count = 1;                 // equal row shards the grid restarts at; 1 = contiguous

    int64_t shard_rows() const { return shard_count > 0 && rows > 0 ? rows / shard_count : 1; }
    int64_t blocks_per_shard() const { return (shard_rows() + block_rows - 1) / block_rows; }
    // Which scale row covers weight row `row`.
    int64_t scale_row_of(int64_t row) const {
        const int64_t shard = row / shard_rows();
        return shard * blocks_per_shard() + (row % shard_rows()) / block_rows;
    }
};

// The grid a [scale_rows, scale_cols] scale describes for a [rows, cols] weight, or nullopt if it
// fits no layout. Columns must use the contiguous grid (scale_cols == ceil(cols / block_cols)).
// Rows use the contiguous grid when scale_rows == ceil(rows / block_rows); otherwise the smallest
// shard count S with rows % S == 0 and S · ceil((rows / S) / block_rows) == scale_rows.
// The shapes alone can be ambiguous (768 rows with 8 scale rows fit S = 4 and S = 8, which place
// the block boundaries differently); the smallest S matches the tensor-parallel degrees seen in
// practice, and is what §6.4 prescribes.
std::optional<Fp8ScaleGrid> fit_fp8_scale_grid(int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                                               int64_t scale_rows, int64_t scale_cols);

// Dequantizes `matrices` consecutive weight matrices of the grid's shape (a 3-D stacked-experts
// tensor is `matrices` = E of them), each followed in `scales` by its own scale matrix, into
// `dst` (f32, bf16 or f16; matrices × rows × cols elements). Multi-threaded with OpenMP.
void dequantize_fp8_blocks(const uint8_t* weight, const float* scales, int64_t matrices, const Fp8ScaleGrid& grid,
                           DType dst_dtype, void* dst);

}  // namespace xinfer
