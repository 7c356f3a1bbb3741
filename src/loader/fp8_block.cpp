#include "loader/fp8_block.h"

#include "core/status.h"

#include <algorithm>
#include <array>
#include <vector>

namespace xinfer {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// All 256 E4M3 codes decoded once: a table lookup beats decoding bit fields per element.
const std::array<float, 256>& fp8_e4m3_table() {
    static const std::array<float, 256> table = [] {
        std::array<float, 256> values{};
        for (int code = 0; code < 256; ++code) values[size_t(code)] = f8_e4m3_to_f32(uint8_t(code));
        return values;
    }();
    return table;
}

}  // namespace

std::optional<Fp8ScaleGrid> fit_fp8_scale_grid(int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                                               int64_t scale_rows, int64_t scale_cols) {
    XINFER_CHECK(block_rows > 0 && block_cols > 0, "fp8 block size {}x{}", block_rows, block_cols);
    if (scale_cols != ceil_div(cols, block_cols)) return std::nullopt;
    Fp8ScaleGrid grid{rows, cols, block_rows, block_cols, scale_rows, scale_cols, 1};
    if (scale_rows == ceil_div(rows, block_rows)) return grid;
    // Every shard contributes at least one block row, so no more than scale_rows shards can fit.
    for (int64_t shards = 2; shards <= std::min(rows, scale_rows); ++shards) {
        if (rows % shards == 0 && shards * ceil_div(rows / shards, block_rows) == scale_rows) {
            grid.shard_count = shards;
            return grid;
        }
    }
    return std::nullopt;
}

void dequantize_fp8_blocks(const uint8_t* weight, const float* scales, int64_t matrices, const Fp8ScaleGrid& grid,
                           DType dst_dtype, void* dst) {
    XINFER_CHECK(dst_dtype == DType::f32 || dst_dtype == DType::bf16 || dst_dtype == DType::f16,
                 "fp8 dequantization into {}", dtype_name(dst_dtype));
    const std::array<float, 256>& table = fp8_e4m3_table();
    const int64_t rows = grid.rows, cols = grid.cols;
    const int64_t total_rows = matrices * rows;
    const size_t out_size = dtype_size(dst_dtype);
    auto* out_bytes = static_cast<uint8_t*>(dst);

#pragma omp parallel
    {
        // Rows are dequantized into f32 and then narrowed, unless f32 is the destination.
        std::vector<float> row_buffer(dst_dtype == DType::f32 ? 0 : size_t(cols));
#pragma omp for schedule(static)
        for (int64_t global_row = 0; global_row < total_rows; ++global_row) {
            const int64_t matrix = global_row / rows;
            const int64_t row = global_row % rows;
            const uint8_t* in = weight + global_row * cols;
            const float* scale_row = scales + (matrix * grid.scale_rows + grid.scale_row_of(row)) * grid.scale_cols;
            uint8_t* out_row = out_bytes + size_t(global_row * cols) * out_size;
            float* values = dst_dtype == DType::f32 ? reinterpret_cast<float*>(out_row) : row_buffer.data();
            for (int64_t block = 0; block < grid.scale_cols; ++block) {
                const float scale = scale_row[block];
                const int64_t end = std::min(cols, (block + 1) * grid.block_cols);
                for (int64_t c = block * grid.block_cols; c < end; ++c) values[c] = table[in[c]] * scale;
            }
            if (dst_dtype != DType::f32) convert_from_f32(values, dst_dtype, out_row, cols);
        }
    }
}

}  // namespace xinfer
