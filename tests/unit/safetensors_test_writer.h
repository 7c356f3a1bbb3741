// Helpers for tests that build tiny checkpoints on disk: a self-deleting temp directory, raw
// byte-level writers for malformed files, and a way to capture an expected error's message.
#pragma once

#include "core/dtype.h"
#include "core/status.h"
#include "loader/safetensors_writer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace xinfer::test {

// A fresh directory under the system temp dir, removed with its contents on destruction.
class TempDir {
public:
    TempDir() {
        std::string pattern = (std::filesystem::temp_directory_path() / "xinfer_test_XXXXXX").string();
        if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
        path_ = pattern;
    }
    ~TempDir() {
        std::error_code ignored;
        std::filesystem::remove_all(path_, ignored);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;

    const std::filesystem::path& path() const { return path_; }
    std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

private:
    std::filesystem::path path_;
};

inline void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), std::streamsize(bytes.size()));
    if (!out) throw std::runtime_error("cannot write " + path.string());
}

inline std::string read_bytes(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The 8-byte little-endian length prefix of a safetensors file.
inline std::string length_prefix(uint64_t length) {
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[size_t(i)] = char(uint8_t(length >> (8 * i)));
    return bytes;
}

// A safetensors file from raw header text and data bytes, for malformed-file tests. The length
// prefix is the header's true length unless `header_length` overrides it.
inline void write_raw_safetensors(const std::filesystem::path& path, const std::string& header, const std::string& data,
                                  std::optional<uint64_t> header_length = std::nullopt) {
    write_bytes(path, length_prefix(header_length.value_or(header.size())) + header + data);
}

// A minimal config.json; `extra` fields are merged in.
inline void write_config(const std::filesystem::path& dir, const nlohmann::json& extra = nlohmann::json::object()) {
    nlohmann::json config = {{"architectures", {"TestForCausalLM"}}, {"hidden_size", 8}};
    config.update(extra);
    write_bytes(dir / "config.json", config.dump(2));
}

// `values` stored as `dtype` (f32, bf16 or f16), as raw bytes ready for a SafetensorsEntry.
inline std::vector<uint8_t> encode(const std::vector<float>& values, DType dtype) {
    std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
    convert_from_f32(values.data(), dtype, bytes.data(), int64_t(values.size()));
    return bytes;
}

// The message of the xinfer::Error that `action` throws; a test failure if it throws nothing.
// XINFER_PRINT_ERRORS=1 prints each captured message, for reviewing their wording.
template <typename Action>
std::string error_message(Action&& action) {
    try {
        action();
    } catch (const Error& error) {
        if (std::getenv("XINFER_PRINT_ERRORS")) std::printf("ERROR: %s\n", error.what());
        return error.what();
    }
    ADD_FAILURE() << "expected an xinfer::Error, but nothing was thrown";
    return "";
}

// gtest predicate for EXPECT_CONTAINS: on failure it prints the whole message, which is what
// one needs to see when an error's wording drifts. (Plain gtest: the unit tests do not link gmock.)
inline ::testing::AssertionResult contains_text(const char* text_expr, const char* needle_expr, const std::string& text,
                                                const std::string& needle) {
    if (text.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << text_expr << " does not contain " << needle_expr << "\n  text:   \"" << text
                                         << "\"\n  needle: \"" << needle << "\"";
}

inline ::testing::AssertionResult lacks_text(const char* text_expr, const char* needle_expr, const std::string& text,
                                             const std::string& needle) {
    if (text.find(needle) == std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << text_expr << " unexpectedly contains " << needle_expr << "\n  text: \""
                                         << text << "\"";
}

}  // namespace xinfer::test

#define EXPECT_CONTAINS(text, needle) EXPECT_PRED_FORMAT2(::xinfer::test::contains_text, text, needle)
#define EXPECT_LACKS(text, needle) EXPECT_PRED_FORMAT2(::xinfer::test::lacks_text, text, needle)
