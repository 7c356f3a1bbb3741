// .npy float32 files and the safetensors writer's layout guarantees.
#include "loader/npy.h"
#include "loader/safetensors_writer.h"
#include "safetensors_test_writer.h"

#include <gtest/gtest.h>

#include <cstring>

namespace xinfer {
namespace {

using test::error_message;
using test::TempDir;

TEST(Npy, RoundTripsShapesAndData) {
    TempDir dir;
    const std::vector<std::vector<int64_t>> shapes = {{2, 3}, {5}, {}, {0, 4}, {2, 1, 3, 2}};
    for (const std::vector<int64_t>& shape : shapes) {
        size_t numel = 1;
        for (int64_t dim : shape) numel *= size_t(dim);
        std::vector<float> data(numel);
        for (size_t i = 0; i < numel; ++i) data[i] = float(i) * 0.5f - 1.0f;
        const auto path = dir / "a.npy";
        write_npy_f32(path, data.data(), shape);
        const NpyArray array = read_npy_f32(path);
        EXPECT_EQ(array.shape, shape);
        EXPECT_EQ(array.data, data);
        // NumPy's layout: the data starts at a multiple of 64 bytes.
        const std::string bytes = test::read_bytes(path);
        EXPECT_EQ((bytes.size() - numel * sizeof(float)) % 64, 0u);
    }
}

TEST(Npy, WritesTheHeaderNumpyExpects) {
    TempDir dir;
    const float data[5] = {1, 2, 3, 4, 5};
    write_npy_f32(dir / "v.npy", data, {5});
    const std::string bytes = test::read_bytes(dir / "v.npy");
    EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
    EXPECT_CONTAINS(bytes, "{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }");
    // 10-byte preamble + 58-byte dict + newline do not fit in 64 bytes, so the data starts at 128.
    ASSERT_EQ(bytes.size(), 128u + sizeof(data));
    EXPECT_EQ(bytes[127], '\n');
}

// A header as NumPy writes it, for hand-made variants.
std::string npy_file(const std::string& dict, const std::string& data) {
    std::string header = dict;
    header.append(63 - (10 + header.size()) % 64, ' ');
    header += '\n';
    return std::string("\x93NUMPY\x01\x00", 8) + char(header.size() & 0xff) + char(header.size() >> 8) + header + data;
}

TEST(NpyErrors, WrongDtypeOrderOrSize) {
    TempDir dir;
    const auto path = dir / "bad.npy";
    test::write_bytes(path, npy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", std::string(16, 0)));
    EXPECT_CONTAINS(error_message([&] { read_npy_f32(path); }),
                    "bad.npy: expected dtype '<f4' (little-endian float32), found '<f8'");

    test::write_bytes(path, npy_file("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", std::string(16, 0)));
    EXPECT_CONTAINS(error_message([&] { read_npy_f32(path); }),
                    "bad.npy: expected C order (fortran_order False), found True");

    test::write_bytes(path,
                      npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", std::string(20, 0)));
    EXPECT_CONTAINS(error_message([&] { read_npy_f32(path); }),
                    "bad.npy: shape (2, 3) needs 24 bytes of float32 data, found 20");

    test::write_bytes(path, "PK\x03\x04 not numpy");
    EXPECT_CONTAINS(error_message([&] { read_npy_f32(path); }), "bad.npy: not a .npy file");

    EXPECT_CONTAINS(error_message([&] { read_npy_f32(dir / "absent.npy"); }), "absent.npy: cannot open");
}

TEST(SafetensorsWriter, AlignsTensorsAndPadsTheHeader) {
    TempDir dir;
    const uint8_t bytes[3] = {1, 2, 3};
    const float floats[2] = {1.5f, -2.0f};
    const uint16_t halves[1] = {0x3c00};
    write_safetensors(
        dir / "t.safetensors",
        {{"a.bytes", DType::u8, {3}, bytes}, {"b.half", DType::f16, {1}, halves}, {"c.float", DType::f32, {2}, floats}},
        {{"format", "pt"}});
    const std::string file = test::read_bytes(dir / "t.safetensors");
    uint64_t header_length = 0;
    std::memcpy(&header_length, file.data(), 8);
    EXPECT_EQ(header_length % 8, 0u);
    const nlohmann::json header = nlohmann::json::parse(file.substr(8, header_length));
    EXPECT_EQ(header["__metadata__"]["format"], "pt");
    // Largest elements first: f32 at 0, f16 at 8, u8 at 10; no holes.
    EXPECT_EQ(header["c.float"]["data_offsets"], nlohmann::json({0, 8}));
    EXPECT_EQ(header["b.half"]["data_offsets"], nlohmann::json({8, 10}));
    EXPECT_EQ(header["a.bytes"]["data_offsets"], nlohmann::json({10, 13}));
    EXPECT_EQ(header["c.float"]["dtype"], "F32");
    EXPECT_EQ(file.size(), 8 + header_length + 13);
    EXPECT_EQ(std::memcmp(file.data() + 8 + header_length, floats, 8), 0);
}

TEST(SafetensorsWriter, RejectsBadEntries) {
    TempDir dir;
    const float x = 0;
    EXPECT_CONTAINS(
        error_message([&] {
            write_safetensors(dir / "t.safetensors", {{"w", DType::f32, {1}, &x}, {"w", DType::f32, {1}, &x}});
        }),
        "t.safetensors: tensor w given twice");
    EXPECT_CONTAINS(error_message([&] {
                        write_safetensors(dir / "t.safetensors", {{"w", DType::fp4_e2m1, {2}, &x}});
                    }),
                    "dtype fp4_e2m1 has no safetensors name");
    EXPECT_CONTAINS(error_message([&] {
                        write_safetensors(dir / "t.safetensors", {{"w", DType::f32, {1}, &x}}, {{"n", 1}});
                    }),
                    "t.safetensors: __metadata__ must be an object of strings");
}

}  // namespace
}  // namespace xinfer
