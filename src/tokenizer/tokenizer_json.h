// What the detokenizer and the BPE encoder share: reading a tokenizer.json, and the byte-level
// alphabet (GPT-2's table: bytes 33-126, 161-172 and 174-255 spell themselves, the other 68 are
// U+0100 onwards in byte order).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>

namespace xinfer {

// The parsed file; throws naming it when it cannot be read or is not JSON.
nlohmann::json read_tokenizer_json(const std::filesystem::path& path);

// Byte b's spelling in the byte-level alphabet (one code point, UTF-8 encoded).
const std::string& byte_level_spelling(uint8_t b);

}  // namespace xinfer
