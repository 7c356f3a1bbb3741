// Writes a byte-level BPE tokenizer.json for tests: ids 0-255 are the single bytes (spelled in
// GPT-2's byte → code point table), ids from 256 two printable ASCII bytes each, and the last id
// the special token <|endoftext|>. Shared by tests/unit and tests/spec.
#pragma once

#include "tokenizer/tokenizer_json.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace xinfer::test {

// Byte b in the byte-level alphabet (tokenizer/tokenizer_json.h; the detokenizer's unit test
// checks that table against GPT-2's spelled out).
inline std::string byte_level_char(int b) { return byte_level_spelling(uint8_t(b)); }

// The bytes id stands for in the tokenizer written below.
inline std::string test_token_bytes(int64_t id, int64_t vocab) {
    if (id == vocab - 1) return "<|endoftext|>";
    if (id < 256) return std::string(1, char(id));
    return {char(33 + id % 94), char(33 + (id / 94) % 94)};
}

inline std::filesystem::path write_byte_level_tokenizer(const std::filesystem::path& dir, int64_t vocab) {
    nlohmann::json v = nlohmann::json::object();
    for (int64_t id = 0; id < vocab - 1; ++id) {
        std::string spelled;
        for (char b : test_token_bytes(id, vocab)) spelled += byte_level_char(uint8_t(b));
        v[spelled] = id;
    }
    nlohmann::json doc = {
        {"version", "1.0"},
        {"added_tokens", {{{"id", vocab - 1}, {"content", "<|endoftext|>"}, {"special", true}}}},
        {"normalizer", nullptr},
        {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
        {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}}},
        {"model", {{"type", "BPE"}, {"vocab", v}, {"merges", nlohmann::json::array()}}},
    };
    std::filesystem::create_directories(dir);
    const std::filesystem::path path = dir / "tokenizer.json";
    std::ofstream(path) << doc.dump();
    return path;
}

}  // namespace xinfer::test
