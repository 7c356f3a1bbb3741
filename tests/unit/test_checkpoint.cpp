// Checkpoint loading: dtype conversions, sharded indexes, consumption bookkeeping, and one test
// per strict-loading failure, each checking that the message names the file and the tensor.
#include "loader/checkpoint.h"
#include "safetensors_test_writer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

namespace xinfer {
namespace {

using test::error_message;
using test::TempDir;

std::vector<float> random_values(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> values(n);
    for (float& v : values) v = normal(rng);
    return values;
}

// A checkpoint directory with config.json and a single model.safetensors of `entries`.
void write_single(const TempDir& dir, const std::vector<SafetensorsEntry>& entries) {
    test::write_config(dir.path());
    write_safetensors(dir / "model.safetensors", entries);
}

// --- Conversions --------------------------------------------------------------------------------

// Every stored float dtype into every destination float dtype. The expectation goes through the
// scalar reference conversions, so rounding must match them bit for bit. 300 × 700 elements span
// several conversion chunks, exercising the multi-threaded path.
TEST(Checkpoint, ConvertsEveryFloatDtypePair) {
    const std::vector<DType> dtypes = {DType::f32, DType::bf16, DType::f16};
    const int64_t rows = 300, cols = 700;
    const std::vector<float> values = random_values(size_t(rows * cols), 1);
    for (DType src : dtypes) {
        TempDir dir;
        const std::vector<uint8_t> stored = test::encode(values, src);
        write_single(dir, {{"w", src, {rows, cols}, stored.data()}});
        std::vector<float> stored_as_f32(values.size());
        convert_to_f32(src, stored.data(), stored_as_f32.data(), int64_t(values.size()));
        for (DType dst : dtypes) {
            auto checkpoint = Checkpoint::open(dir.path());
            std::vector<uint8_t> got(values.size() * dtype_size(dst));
            checkpoint->read("w", {rows, cols}, dst, got.data());
            const std::vector<uint8_t> expected = test::encode(stored_as_f32, dst);
            EXPECT_EQ(0, std::memcmp(got.data(), expected.data(), got.size()))
                << dtype_name(src) << " -> " << dtype_name(dst);
        }
    }
}

// bf16 → bf16 must be a byte copy: NaN payloads and signed zeros survive unchanged.
TEST(Checkpoint, Bf16ToBf16IsAnExactCopy) {
    TempDir dir;
    std::vector<uint16_t> bits(5000);
    std::mt19937 rng(2);
    for (uint16_t& b : bits) b = uint16_t(rng());
    bits[0] = 0x7fc1;  // NaN with a payload
    bits[1] = 0x8000;  // -0
    write_single(dir, {{"w", DType::bf16, {50, 100}, bits.data()}});
    auto checkpoint = Checkpoint::open(dir.path());
    std::vector<uint16_t> got(bits.size());
    checkpoint->read("w", {50, 100}, DType::bf16, got.data());
    EXPECT_EQ(bits, got);
}

TEST(Checkpoint, SameDtypeIntegersAreCopied) {
    TempDir dir;
    const std::vector<int32_t> ids = {3, -1, 7, 1 << 30};
    write_single(dir, {{"ids", DType::i32, {4}, ids.data()}});
    auto checkpoint = Checkpoint::open(dir.path());
    std::vector<int32_t> got(4);
    checkpoint->read("ids", {4}, DType::i32, got.data());
    EXPECT_EQ(ids, got);
}

// --- Bookkeeping ---------------------------------------------------------------------------------

TEST(Checkpoint, ReportsNamesInfoAndBytesByDtype) {
    TempDir dir;
    const std::vector<float> a(6, 1.0f);
    const std::vector<uint16_t> b(4, 0);
    const std::vector<uint8_t> c(3, 0);
    write_single(dir, {{"b.weight", DType::bf16, {2, 2}, b.data()},
                       {"a.weight", DType::f32, {2, 3}, a.data()},
                       {"c.packed", DType::u8, {3}, c.data()}});
    auto checkpoint = Checkpoint::open(dir.path());
    EXPECT_EQ(checkpoint->names(), (std::vector<std::string>{"a.weight", "b.weight", "c.packed"}));
    EXPECT_TRUE(checkpoint->has("a.weight"));
    EXPECT_FALSE(checkpoint->has("a"));
    const TensorInfo& info = checkpoint->info("a.weight");
    EXPECT_EQ(info.dtype, DType::f32);
    EXPECT_EQ(info.shape_string(), "[2, 3]");
    EXPECT_EQ(info.numel(), 6);
    EXPECT_EQ(info.nbytes, 24u);
    EXPECT_EQ(info.file.filename(), "model.safetensors");
    const std::map<DType, uint64_t> expected_bytes = {{DType::f32, 24}, {DType::bf16, 8}, {DType::u8, 3}};
    EXPECT_EQ(checkpoint->bytes_by_dtype(), expected_bytes);
}

TEST(Checkpoint, FinishPassesOnceEverythingIsReadOrSkipped) {
    TempDir dir;
    const std::vector<float> x(4, 0.5f);
    write_single(dir, {{"model.norm.weight", DType::f32, {4}, x.data()},
                       {"model.mtp.layers.0.enorm.weight", DType::f32, {4}, x.data()},
                       {"model.mtp.layers.1.enorm.weight", DType::f32, {4}, x.data()}});
    auto checkpoint = Checkpoint::open(dir.path());
    std::vector<float> got(4);
    checkpoint->read("model.norm.weight", {4}, DType::f32, got.data());
    EXPECT_EQ(got, x);
    EXPECT_EQ(checkpoint->skip_prefix("model.mtp."), 2u);
    EXPECT_NO_THROW(checkpoint->finish());
}

TEST(Checkpoint, ConfigOnlyOpenNeedsNoWeights) {
    TempDir dir;
    test::write_config(dir.path(), {{"hidden_size", 4096}});
    auto checkpoint = Checkpoint::open(dir.path(), /*load_weights=*/false);
    EXPECT_EQ(checkpoint->config()["hidden_size"], 4096);
    EXPECT_EQ(checkpoint->config_path(), dir / "config.json");
    EXPECT_FALSE(checkpoint->fp8().enabled);
    EXPECT_TRUE(checkpoint->names().empty());
}

TEST(Checkpoint, ParsesFp8QuantizationConfig) {
    TempDir dir;
    test::write_config(dir.path(), {{"quantization_config",
                                     {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {64, 32}}}}});
    auto checkpoint = Checkpoint::open(dir.path(), false);
    EXPECT_TRUE(checkpoint->fp8().enabled);
    EXPECT_EQ(checkpoint->fp8().block_rows, 64);
    EXPECT_EQ(checkpoint->fp8().block_cols, 32);
}

TEST(Checkpoint, RejectsBadFp8BlockSize) {
    TempDir dir;
    test::write_config(dir.path(), {{"quantization_config", {{"quant_method", "fp8"}, {"weight_block_size", {128}}}}});
    const std::string message = error_message([&] { Checkpoint::open(dir.path(), false); });
    EXPECT_CONTAINS(message, "config.json");
    EXPECT_CONTAINS(message, "quantization_config.weight_block_size");
    EXPECT_CONTAINS(message, "[128]");
}

// --- Sharded checkpoints -------------------------------------------------------------------------

struct ShardedFixture {
    TempDir dir;
    std::vector<float> a = random_values(12, 3), b = random_values(8, 4);

    void write_shards(const nlohmann::json& weight_map) {
        test::write_config(dir.path());
        write_safetensors(dir / "model-00001-of-00002.safetensors", {{"model.a", DType::f32, {3, 4}, a.data()}});
        write_safetensors(dir / "model-00002-of-00002.safetensors", {{"model.b", DType::f32, {2, 4}, b.data()}});
        test::write_bytes(dir / "model.safetensors.index.json",
                          nlohmann::json{{"metadata", {{"total_size", 80}}}, {"weight_map", weight_map}}.dump());
    }
};

const nlohmann::json kGoodWeightMap = {{"model.a", "model-00001-of-00002.safetensors"},
                                       {"model.b", "model-00002-of-00002.safetensors"}};

TEST(Checkpoint, LoadsShardsThroughTheIndex) {
    ShardedFixture fixture;
    fixture.write_shards(kGoodWeightMap);
    // A stray safetensors file beside the index must be ignored, not merged.
    write_safetensors(fixture.dir / "reference.safetensors", {{"model.a", DType::f32, {3, 4}, fixture.a.data()}});
    auto checkpoint = Checkpoint::open(fixture.dir.path());
    EXPECT_EQ(checkpoint->names(), (std::vector<std::string>{"model.a", "model.b"}));
    EXPECT_EQ(checkpoint->info("model.b").file.filename(), "model-00002-of-00002.safetensors");
    std::vector<float> a(12), b(8);
    checkpoint->read("model.a", {3, 4}, DType::f32, a.data());
    checkpoint->read("model.b", {2, 4}, DType::f32, b.data());
    EXPECT_EQ(a, fixture.a);
    EXPECT_EQ(b, fixture.b);
    EXPECT_NO_THROW(checkpoint->finish());
}

TEST(CheckpointErrors, IndexPointsAtMissingShard) {
    ShardedFixture fixture;
    nlohmann::json weight_map = kGoodWeightMap;
    weight_map["model.c"] = "model-00003-of-00003.safetensors";
    fixture.write_shards(weight_map);
    const std::string message = error_message([&] { Checkpoint::open(fixture.dir.path()); });
    EXPECT_CONTAINS(message, "model.safetensors.index.json");
    EXPECT_CONTAINS(message, "model.c");
    EXPECT_CONTAINS(message, "model-00003-of-00003.safetensors");
    EXPECT_CONTAINS(message, "does not exist");
}

TEST(CheckpointErrors, IndexListsTensorItsShardLacks) {
    ShardedFixture fixture;
    nlohmann::json weight_map = kGoodWeightMap;
    weight_map["model.ghost"] = "model-00002-of-00002.safetensors";
    fixture.write_shards(weight_map);
    const std::string message = error_message([&] { Checkpoint::open(fixture.dir.path()); });
    EXPECT_CONTAINS(message, "model.safetensors.index.json");
    EXPECT_CONTAINS(message, "model.ghost");
    EXPECT_CONTAINS(message, "model-00002-of-00002.safetensors, which does not contain it");
}

TEST(CheckpointErrors, ShardHoldsTensorTheIndexDoesNotList) {
    ShardedFixture fixture;
    fixture.write_shards(
        {{"model.a", "model-00001-of-00002.safetensors"}, {"model.b", "model-00001-of-00002.safetensors"}});
    // model.b is now mapped to shard 1, which lacks it; shard 2 is never opened. Put an unlisted
    // tensor into shard 1 instead to reach the "not listed" check.
    const std::vector<float> extra(2, 0.0f);
    write_safetensors(fixture.dir / "model-00001-of-00002.safetensors",
                      {{"model.a", DType::f32, {3, 4}, fixture.a.data()},
                       {"model.b", DType::f32, {2, 4}, fixture.b.data()},
                       {"model.unlisted", DType::f32, {2}, extra.data()}});
    const std::string message = error_message([&] { Checkpoint::open(fixture.dir.path()); });
    EXPECT_CONTAINS(message, "model-00001-of-00002.safetensors");
    EXPECT_CONTAINS(message, "model.unlisted is not listed in");
    EXPECT_CONTAINS(message, "model.safetensors.index.json");
}

TEST(CheckpointErrors, TensorPresentInTwoShards) {
    ShardedFixture fixture;
    fixture.write_shards(kGoodWeightMap);
    write_safetensors(
        fixture.dir / "model-00002-of-00002.safetensors",
        {{"model.a", DType::f32, {3, 4}, fixture.a.data()}, {"model.b", DType::f32, {2, 4}, fixture.b.data()}});
    const std::string message = error_message([&] { Checkpoint::open(fixture.dir.path()); });
    EXPECT_CONTAINS(message, "model.a");
    EXPECT_CONTAINS(message, "two shards");
    EXPECT_CONTAINS(message, "model-00001-of-00002.safetensors");
    EXPECT_CONTAINS(message, "model-00002-of-00002.safetensors");
}

TEST(CheckpointErrors, NoWeightFiles) {
    TempDir dir;
    test::write_config(dir.path());
    write_safetensors(dir / "model-00001-of-00001.safetensors", {});  // not looked for without an index
    const std::string message = error_message([&] { Checkpoint::open(dir.path()); });
    EXPECT_CONTAINS(message, dir.path().string());
    EXPECT_CONTAINS(message, "model.safetensors.index.json");
    EXPECT_CONTAINS(message, "model.safetensors");
}

// --- Strict-loading failures in a single file ------------------------------------------------------

TEST(CheckpointErrors, ReadOfAbsentTensor) {
    TempDir dir;
    const std::vector<float> x(4, 0.0f);
    write_single(dir, {{"model.norm.weight", DType::f32, {4}, x.data()}});
    auto checkpoint = Checkpoint::open(dir.path());
    std::vector<float> got(4);
    const std::string message =
        error_message([&] { checkpoint->read("model.layers.0.norm.weight", {4}, DType::f32, got.data()); });
    EXPECT_CONTAINS(message, "tensor model.layers.0.norm.weight not found");
    EXPECT_CONTAINS(message, dir.path().string());
    EXPECT_CONTAINS(message, "model.safetensors");
    EXPECT_CONTAINS(error_message([&] { checkpoint->info("nope"); }), "tensor nope not found");
}

TEST(CheckpointErrors, FinishListsUnexpectedTensors) {
    TempDir dir;
    const std::vector<float> x(2, 0.0f);
    write_single(dir, {{"model.used", DType::f32, {2}, x.data()},
                       {"model.layers.0.foo", DType::f32, {2}, x.data()},
                       {"model.layers.1.foo", DType::f32, {2}, x.data()},
                       {"model.layers.2.foo", DType::f32, {2}, x.data()}});
    auto checkpoint = Checkpoint::open(dir.path());
    std::vector<float> got(2);
    checkpoint->read("model.used", {2}, DType::f32, got.data());
    const std::string message = error_message([&] { checkpoint->finish(); });
    EXPECT_CONTAINS(message, "unexpected tensors in " + dir.path().string());
    EXPECT_CONTAINS(message, "model.layers.0.foo (model.safetensors)");
    EXPECT_CONTAINS(message, "model.layers.2.foo (model.safetensors)");
    EXPECT_CONTAINS(message, "(3 total");
    EXPECT_LACKS(message, "model.used");
}

TEST(CheckpointErrors, FinishListsOnlyTheFirstTenLeftovers) {
    TempDir dir;
    const std::vector<float> x(1, 0.0f);
    std::vector<std::string> names;
    for (int i = 0; i < 25; ++i) names.push_back(fmt::format("t{:02}", i));
    std::vector<SafetensorsEntry> entries;
    for (const std::string& name : names) entries.push_back({name, DType::f32, {1}, x.data()});
    write_single(dir, entries);
    const std::string message = error_message([&] { Checkpoint::open(dir.path())->finish(); });
    EXPECT_CONTAINS(message, "t09 (model.safetensors)");
    EXPECT_LACKS(message, "t10");
    EXPECT_CONTAINS(message, "(25 total");
}

TEST(CheckpointErrors, WrongShape) {
    TempDir dir;
    const std::vector<float> x(32, 0.0f);
    write_single(dir, {{"model.w", DType::f32, {8, 4}, x.data()}});
    auto checkpoint = Checkpoint::open(dir.path());
    std::vector<float> got(32);
    const std::string message = error_message([&] { checkpoint->read("model.w", {4, 8}, DType::f32, got.data()); });
    EXPECT_CONTAINS(message, "model.safetensors: tensor model.w: expected shape [4, 8], found [8, 4]");
}

TEST(CheckpointErrors, UnsupportedDtypeConversion) {
    TempDir dir;
    const std::vector<int64_t> x(3, 1);
    write_single(dir, {{"model.positions", DType::i64, {3}, x.data()}});
    auto checkpoint = Checkpoint::open(dir.path());
    std::vector<float> got(3);
    const std::string message =
        error_message([&] { checkpoint->read("model.positions", {3}, DType::f32, got.data()); });
    EXPECT_CONTAINS(message, "model.safetensors");
    EXPECT_CONTAINS(message, "model.positions");
    EXPECT_CONTAINS(message, "stored dtype i64 to f32");
}

TEST(CheckpointErrors, UnknownDtypeString) {
    TempDir dir;
    test::write_config(dir.path());
    test::write_raw_safetensors(dir / "model.safetensors",
                                R"({"model.w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", "x");
    const std::string message = error_message([&] { Checkpoint::open(dir.path()); });
    EXPECT_CONTAINS(message, "model.safetensors: tensor model.w: unknown dtype \"F4\"");
    EXPECT_CONTAINS(message, "BF16");  // lists what would have been accepted
}

TEST(CheckpointErrors, NegativeDimension) {
    TempDir dir;
    test::write_config(dir.path());
    test::write_raw_safetensors(dir / "model.safetensors",
                                R"({"model.w":{"dtype":"U8","shape":[2,-3],"data_offsets":[0,0]}})", "");
    const std::string message = error_message([&] { Checkpoint::open(dir.path()); });
    EXPECT_CONTAINS(message, "model.safetensors: tensor model.w: negative dimension in shape [2,-3]");
}

TEST(CheckpointErrors, TruncatedFile) {
    TempDir dir;
    const std::vector<float> x(16, 1.0f);
    write_single(dir, {{"model.w", DType::f32, {4, 4}, x.data()}});
    std::string bytes = test::read_bytes(dir / "model.safetensors");
    bytes.resize(bytes.size() - 10);
    test::write_bytes(dir / "model.safetensors", bytes);
    const std::string message = error_message([&] { Checkpoint::open(dir.path()); });
    EXPECT_CONTAINS(message, "model.safetensors: tensor model.w: data_offsets [0, 64]");
    EXPECT_CONTAINS(message, "data section has 54 bytes");
    EXPECT_CONTAINS(message, "truncated");

    test::write_bytes(dir / "model.safetensors", std::string("\x10\x00\x00", 3));
    const std::string tiny = error_message([&] { Checkpoint::open(dir.path()); });
    EXPECT_CONTAINS(tiny, "model.safetensors: truncated: 3 bytes");
}

TEST(CheckpointErrors, HeaderLengthPastEndOfFile) {
    TempDir dir;
    test::write_config(dir.path());
    test::write_raw_safetensors(dir / "model.safetensors", "{}", "", /*header_length=*/1000);
    const std::string message = error_message([&] { Checkpoint::open(dir.path()); });
    EXPECT_CONTAINS(message, "model.safetensors: header length 1000 runs past the end of the file (10 bytes");
}

TEST(CheckpointErrors, OverlappingOffsets) {
    TempDir dir;
    test::write_config(dir.path());
    test::write_raw_safetensors(dir / "model.safetensors",
                                R"({"model.a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                                R"("model.b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                                std::string(24, '\0'));
    const std::string message = error_message([&] { Checkpoint::open(dir.path()); });
    EXPECT_CONTAINS(message, "model.safetensors: tensors model.a [0, 16) and model.b [8, 24) overlap");
}

TEST(CheckpointErrors, OffsetsPastEndOfFile) {
    TempDir dir;
    test::write_config(dir.path());
    test::write_raw_safetensors(dir / "model.safetensors",
                                R"({"model.a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("model.b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                                std::string(8, '\0'));
    const std::string message = error_message([&] { Checkpoint::open(dir.path()); });
    EXPECT_CONTAINS(message, "model.safetensors: tensor model.b: data_offsets [8, 16] run past the end");
    EXPECT_CONTAINS(message, "data section has 8 bytes");
}

TEST(CheckpointErrors, ByteSizeMismatch) {
    TempDir dir;
    test::write_config(dir.path());
    test::write_raw_safetensors(dir / "model.safetensors",
                                R"({"model.w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})",
                                std::string(8, '\0'));
    const std::string message = error_message([&] { Checkpoint::open(dir.path()); });
    EXPECT_CONTAINS(message, "model.safetensors: tensor model.w: data_offsets [0, 8] hold 8 bytes");
    EXPECT_CONTAINS(message, "BF16 [2, 3] needs 12 bytes");
}

TEST(CheckpointErrors, HolesAndTrailingBytes) {
    TempDir dir;
    test::write_config(dir.path());
    test::write_raw_safetensors(dir / "model.safetensors",
                                R"({"model.w":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", std::string(8, '\0'));
    EXPECT_CONTAINS(error_message([&] { Checkpoint::open(dir.path()); }),
                    "model.safetensors: 4 unused bytes [0, 4) before tensor model.w");

    test::write_raw_safetensors(dir / "model.safetensors",
                                R"({"model.w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", std::string(6, '\0'));
    EXPECT_CONTAINS(error_message([&] { Checkpoint::open(dir.path()); }),
                    "model.safetensors: data section has 6 bytes but its tensors cover only 4");
}

TEST(CheckpointErrors, InvalidJsonHeader) {
    TempDir dir;
    test::write_config(dir.path());
    test::write_raw_safetensors(dir / "model.safetensors", R"({"model.w": {"dtype": "F32",)", "");
    const std::string message = error_message([&] { Checkpoint::open(dir.path()); });
    EXPECT_CONTAINS(message, "model.safetensors: invalid JSON in the 28-byte safetensors header");
}

TEST(CheckpointErrors, MalformedHeaderEntry) {
    TempDir dir;
    test::write_config(dir.path());
    test::write_raw_safetensors(dir / "model.safetensors", R"({"model.w":{"dtype":"F32","shape":[0]}})", "");
    const std::string message = error_message([&] { Checkpoint::open(dir.path()); });
    EXPECT_CONTAINS(message, "model.safetensors: tensor model.w: header entry lacks \"data_offsets\"");
}

TEST(CheckpointErrors, InvalidConfigJson) {
    TempDir dir;
    test::write_bytes(dir / "config.json", "{\n  \"hidden_size\": 8,\n  oops\n}");
    const std::string message = error_message([&] { Checkpoint::open(dir.path(), false); });
    EXPECT_CONTAINS(message, "config.json: invalid JSON");
    EXPECT_CONTAINS(message, "line 3");
}

TEST(CheckpointErrors, MissingDirectoryAndConfig) {
    TempDir dir;
    EXPECT_CONTAINS(error_message([&] { Checkpoint::open(dir / "absent"); }),
                    "absent: checkpoint directory does not exist");
    EXPECT_CONTAINS(error_message([&] { Checkpoint::open(dir.path()); }), "config.json: cannot open");
}

}  // namespace
}  // namespace xinfer
