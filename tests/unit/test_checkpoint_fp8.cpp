// Block-scaled FP8 dequantization: partial edge blocks, the per-shard restarting row grid of
// TP-exported checkpoints (research/mimo_v2_flash.md §6.4), stacked experts, and its errors.
// References are computed here from the formula with the block index written out by hand, not
// through Fp8ScaleGrid, so a bug in the grid logic cannot hide in both.
#include "loader/checkpoint.h"
#include "loader/fp8_block.h"
#include "safetensors_test_writer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

namespace xinfer {
namespace {

using test::error_message;
using test::TempDir;

// Random finite E4M3 codes (0x7f and 0xff are NaN).
std::vector<uint8_t> random_fp8(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t> codes(n);
    for (uint8_t& code : codes) {
        code = uint8_t(rng());
        if ((code & 0x7f) == 0x7f) code ^= 1;  // NaN → the largest finite code, ±448
    }
    return codes;
}

// Distinct, easily told apart scales: a wrong block index shows up as a wrong value.
std::vector<float> distinct_scales(size_t n) {
    std::vector<float> scales(n);
    for (size_t i = 0; i < n; ++i) scales[i] = 0.5f + 0.25f * float(i);
    return scales;
}

void write_fp8_checkpoint(const TempDir& dir, const std::vector<int64_t>& weight_shape,
                          const std::vector<uint8_t>& codes, const std::vector<int64_t>& scale_shape,
                          const std::vector<float>& scales, std::vector<int64_t> block = {128, 128}) {
    test::write_config(dir.path(), {{"quantization_config", {{"quant_method", "fp8"}, {"weight_block_size", block}}}});
    write_safetensors(dir / "model.safetensors",
                      {{"model.w.weight", DType::f8_e4m3, weight_shape, codes.data()},
                       {"model.w.weight_scale_inv", DType::f32, scale_shape, scales.data()}});
}

// The expected [rows, cols] matrix given a hand-written map from (row, col) to scale index.
std::vector<float> reference(const std::vector<uint8_t>& codes, const std::vector<float>& scales, int64_t rows,
                             int64_t cols, const std::function<size_t(int64_t, int64_t)>& scale_index) {
    std::vector<float> expected(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
            expected[size_t(r * cols + c)] = f8_e4m3_to_f32(codes[size_t(r * cols + c)]) * scales[scale_index(r, c)];
        }
    }
    return expected;
}

std::vector<float> read_f32(Checkpoint& checkpoint, std::initializer_list<int64_t> shape, size_t numel) {
    std::vector<float> got(numel);
    checkpoint.read("model.w.weight", shape, DType::f32, got.data());
    return got;
}

// [200, 300] with 128×128 blocks: scales [2, 3]; the last block row has 72 rows and the last
// block column 44 columns.
TEST(CheckpointFp8, DequantizesWithPartialEdgeBlocks) {
    TempDir dir;
    const int64_t rows = 200, cols = 300;
    const std::vector<uint8_t> codes = random_fp8(size_t(rows * cols), 1);
    const std::vector<float> scales = distinct_scales(6);
    write_fp8_checkpoint(dir, {rows, cols}, codes, {2, 3}, scales);
    const std::vector<float> expected =
        reference(codes, scales, rows, cols, [](int64_t r, int64_t c) { return size_t((r / 128) * 3 + c / 128); });

    auto checkpoint = Checkpoint::open(dir.path());
    EXPECT_EQ(read_f32(*checkpoint, {rows, cols}, expected.size()), expected);
    // The scale was consumed together with its weight.
    EXPECT_NO_THROW(checkpoint->finish());

    // bf16 output is the f32 result rounded once.
    std::vector<uint16_t> got_bf16(expected.size());
    checkpoint->read("model.w.weight", {rows, cols}, DType::bf16, got_bf16.data());
    for (size_t i = 0; i < expected.size(); ++i) ASSERT_EQ(got_bf16[i], f32_to_bf16(expected[i])) << "element " << i;
}

// [192, 256] quantized as 4 TP shards of 48 rows: each shard is one (partial) 128-row block, so
// the scale is [4, 2], where a contiguous grid would be [2, 2].
TEST(CheckpointFp8, HonoursPerShardRestartingRowGrid) {
    TempDir dir;
    const int64_t rows = 192, cols = 256;
    const std::vector<uint8_t> codes = random_fp8(size_t(rows * cols), 2);
    const std::vector<float> scales = distinct_scales(8);
    write_fp8_checkpoint(dir, {rows, cols}, codes, {4, 2}, scales);
    const std::vector<float> expected =
        reference(codes, scales, rows, cols, [](int64_t r, int64_t c) { return size_t((r / 48) * 2 + c / 128); });
    auto checkpoint = Checkpoint::open(dir.path());
    EXPECT_EQ(read_f32(*checkpoint, {rows, cols}, expected.size()), expected);
}

// MiMo-V2-Flash's GA k_proj geometry in miniature: 768 rows as 4 shards of 192 rows, each
// shard 2 block rows (128 + 64), so the scale has 8 rows instead of the contiguous 6.
TEST(CheckpointFp8, HonoursMimoKProjGrid) {
    TempDir dir;
    const int64_t rows = 768, cols = 256;
    const std::vector<uint8_t> codes = random_fp8(size_t(rows * cols), 3);
    const std::vector<float> scales = distinct_scales(16);
    write_fp8_checkpoint(dir, {rows, cols}, codes, {8, 2}, scales);
    const std::vector<float> expected = reference(codes, scales, rows, cols, [](int64_t r, int64_t c) {
        const int64_t shard = r / 192, row_in_shard = r % 192;
        return size_t((shard * 2 + row_in_shard / 128) * 2 + c / 128);
    });
    auto checkpoint = Checkpoint::open(dir.path());
    EXPECT_EQ(read_f32(*checkpoint, {rows, cols}, expected.size()), expected);
}

// Stacked experts [E, rows, cols] with scales [E, scale_rows, scale_cols]: the 2-D rule per expert.
TEST(CheckpointFp8, DequantizesStackedExperts) {
    TempDir dir;
    const int64_t experts = 3, rows = 200, cols = 130;
    const std::vector<uint8_t> codes = random_fp8(size_t(experts * rows * cols), 4);
    const std::vector<float> scales = distinct_scales(size_t(experts * 2 * 2));
    write_fp8_checkpoint(dir, {experts, rows, cols}, codes, {experts, 2, 2}, scales);
    // Treat the stack as one [E·rows, cols] matrix whose scale index also steps by expert.
    const std::vector<float> expected = reference(codes, scales, experts * rows, cols, [&](int64_t r, int64_t c) {
        const int64_t expert = r / rows, row = r % rows;
        return size_t(expert * 4 + (row / 128) * 2 + c / 128);
    });
    auto checkpoint = Checkpoint::open(dir.path());
    std::vector<float> got(expected.size());
    checkpoint->read("model.w.weight", {experts, rows, cols}, DType::f32, got.data());
    EXPECT_EQ(got, expected);
}

// The block size comes from config.json's weight_block_size.
TEST(CheckpointFp8, UsesBlockSizeFromConfig) {
    TempDir dir;
    const int64_t rows = 100, cols = 70;
    const std::vector<uint8_t> codes = random_fp8(size_t(rows * cols), 5);
    const std::vector<float> scales = distinct_scales(6);
    write_fp8_checkpoint(dir, {rows, cols}, codes, {2, 3}, scales, {64, 32});
    const std::vector<float> expected =
        reference(codes, scales, rows, cols, [](int64_t r, int64_t c) { return size_t((r / 64) * 3 + c / 32); });
    auto checkpoint = Checkpoint::open(dir.path());
    EXPECT_EQ(read_f32(*checkpoint, {rows, cols}, expected.size()), expected);
}

TEST(Fp8ScaleGrid, PrefersContiguousThenTheSmallestShardCount) {
    EXPECT_EQ(fit_fp8_scale_grid(768, 4096, 128, 128, 6, 32)->shard_count, 1);
    // 8 shards of 96 rows would also give 8 block rows; the smallest count (TP=4) is taken.
    EXPECT_EQ(fit_fp8_scale_grid(768, 4096, 128, 128, 8, 32)->shard_count, 4);
    EXPECT_EQ(fit_fp8_scale_grid(192, 256, 128, 128, 4, 2)->shard_count, 4);
    // 600 rows, 6 scale rows: 2 × ceil(300/128) = 3 × ceil(200/128) = 6; 2 shards win.
    EXPECT_EQ(fit_fp8_scale_grid(600, 128, 128, 128, 6, 1)->shard_count, 2);
    EXPECT_FALSE(fit_fp8_scale_grid(100, 128, 128, 128, 3, 1).has_value());
    EXPECT_FALSE(fit_fp8_scale_grid(128, 300, 128, 128, 1, 2).has_value());  // columns must be contiguous
}

TEST(CheckpointFp8Errors, MissingScaleInv) {
    TempDir dir;
    const std::vector<uint8_t> codes = random_fp8(16, 6);
    test::write_config(dir.path());
    write_safetensors(dir / "model.safetensors", {{"model.w.weight", DType::f8_e4m3, {4, 4}, codes.data()}});
    auto checkpoint = Checkpoint::open(dir.path());
    std::vector<float> got(16);
    const std::string message = error_message([&] {
        checkpoint->read("model.w.weight", {4, 4}, DType::f32, got.data());
    });
    EXPECT_CONTAINS(message, "model.safetensors: fp8 tensor model.w.weight has no model.w.weight_scale_inv");

    // The raw codes can still be read as they are stored.
    std::vector<uint8_t> raw(16);
    checkpoint->read("model.w.weight", {4, 4}, DType::f8_e4m3, raw.data());
    EXPECT_EQ(raw, codes);
}

TEST(CheckpointFp8Errors, ScaleShapeFitsNoGrid) {
    TempDir dir;
    const std::vector<uint8_t> codes = random_fp8(100 * 128, 7);
    const std::vector<float> scales = distinct_scales(3);
    write_fp8_checkpoint(dir, {100, 128}, codes, {3, 1}, scales);
    auto checkpoint = Checkpoint::open(dir.path());
    std::vector<float> got(codes.size());
    const std::string message = error_message([&] { read_f32(*checkpoint, {100, 128}, codes.size()); });
    EXPECT_CONTAINS(message, "model.safetensors: fp8 tensor model.w.weight has 100 rows, 128 cols");
    EXPECT_CONTAINS(message, "model.w.weight_scale_inv has shape [3, 1]");
    EXPECT_CONTAINS(message, "with 128x128 blocks expected [1, 1]");
}

TEST(CheckpointFp8Errors, ScaleColumnsMustBeContiguous) {
    TempDir dir;
    const std::vector<uint8_t> codes = random_fp8(128 * 300, 8);
    const std::vector<float> scales = distinct_scales(2);
    write_fp8_checkpoint(dir, {128, 300}, codes, {1, 2}, scales);
    auto checkpoint = Checkpoint::open(dir.path());
    const std::string message = error_message([&] { read_f32(*checkpoint, {128, 300}, codes.size()); });
    EXPECT_CONTAINS(message, "model.w.weight_scale_inv has shape [1, 2]");
    EXPECT_CONTAINS(message, "expected [1, 3]");
}

TEST(CheckpointFp8Errors, ScaleMustBeF32) {
    TempDir dir;
    const std::vector<uint8_t> codes = random_fp8(16, 9);
    const std::vector<uint16_t> scales(1, 0x3f80);  // 1.0 in bf16
    test::write_config(dir.path());
    write_safetensors(dir / "model.safetensors", {{"model.w.weight", DType::f8_e4m3, {4, 4}, codes.data()},
                                                  {"model.w.weight_scale_inv", DType::bf16, {1, 1}, scales.data()}});
    auto checkpoint = Checkpoint::open(dir.path());
    const std::string message = error_message([&] { read_f32(*checkpoint, {4, 4}, 16); });
    EXPECT_CONTAINS(message, "model.safetensors: tensor model.w.weight_scale_inv: expected dtype F32");
    EXPECT_CONTAINS(message, "found bf16");
}

TEST(CheckpointFp8Errors, StackedScaleMustMatchExpertCount) {
    TempDir dir;
    const std::vector<uint8_t> codes = random_fp8(2 * 4 * 4, 10);
    const std::vector<float> scales = distinct_scales(3);
    write_fp8_checkpoint(dir, {2, 4, 4}, codes, {3, 1, 1}, scales);
    auto checkpoint = Checkpoint::open(dir.path());
    std::vector<float> got(codes.size());
    const std::string message = error_message([&] {
        checkpoint->read("model.w.weight", {2, 4, 4}, DType::f32, got.data());
    });
    EXPECT_CONTAINS(message, "fp8 tensor model.w.weight [2, 4, 4] with scale model.w.weight_scale_inv [3, 1, 1]");
}

}  // namespace
}  // namespace xinfer
