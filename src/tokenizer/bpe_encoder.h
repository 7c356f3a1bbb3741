// Text → token ids for byte-level BPE tokenizers as Hugging Face tokenizers runs them
// (tokenizer.json of Qwen2/Qwen3 and MiMo):
//   1. added tokens (special or not) are cut out of the text first, matched literally, longest
//      first, and map to their ids;
//   2. each stretch between them is normalized (NFC, or nothing) and split by the pre-tokenizer:
//      the Split regex with "Isolated" behaviour (matches and the gaps between them are pieces),
//      or ByteLevel's own GPT-2 regex;
//   3. each piece's UTF-8 bytes are spelled in the byte-level alphabet and merged by BPE: the
//      adjacent pair with the lowest merge rank first, every occurrence, until none is left.
// No post-processor tokens are added (Qwen's and MiMo's add none).
//
// Unicode normalization and the \p{L}/\p{N} regexes come from ICU; a build without it (no
// libicu-dev) loads tokenizers but encode() says ICU is missing. What the encoder does not
// implement (other normalizers, pre-tokenizers or models, added tokens with lstrip/rstrip) is
// found at load and reported by encode(), so token-id requests still work with such a tokenizer.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace xinfer {

class BpeEncoder {
public:
    // Throws naming the file when it is not JSON or has no BPE vocabulary.
    static BpeEncoder load(const std::filesystem::path& tokenizer_json);
    // The same from a parsed tokenizer.json (`file` names it in errors).
    static BpeEncoder from_json(const nlohmann::json& doc, const std::string& file);
    ~BpeEncoder();
    BpeEncoder(BpeEncoder&&) noexcept;
    BpeEncoder& operator=(BpeEncoder&&) noexcept;

    // Throws with the reason when this tokenizer or this build cannot encode (see above), or a
    // merged symbol is not in the vocabulary.
    std::vector<int32_t> encode(const std::string& text) const;
    // Whether encode() can work; `why_not` says what is missing when it cannot.
    bool can_encode(std::string* why_not = nullptr) const;

private:
    BpeEncoder();
    std::vector<int32_t> encode_piece(const std::string& bytes) const;

    std::string file_;
    std::string unsupported_;  // why encode() cannot work, or empty
    bool nfc_ = false;
    std::string split_pattern_;  // the pre-tokenizer's regex (ICU syntax)
    std::unordered_map<std::string, int32_t> vocab_;      // byte-level spelling → id
    std::unordered_map<std::string, int32_t> merge_rank_;  // "left right" → rank
    bool ignore_merges_ = false;                           // a piece that is a whole token stays one
    std::vector<std::pair<std::string, int32_t>> added_;   // literal content → id, longest first
    struct Regex;
    std::unique_ptr<Regex> regex_;  // compiled split_pattern_ (ICU), when available
};

}  // namespace xinfer
