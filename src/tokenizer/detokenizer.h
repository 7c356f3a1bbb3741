// Token ids → text, from a Hugging Face tokenizer.json with a byte-level BPE vocabulary (GPT-2
// style: Qwen2/Qwen3, MiMo). What stop strings and text output need; encoding text into ids is
// not here yet.
//
// Byte-level vocabularies spell every byte as one printable code point (bytes 33-126, 161-172
// and 174-255 as themselves, the other 68 as U+0100 + n in byte order), so a token's bytes are
// its code points mapped back. Added tokens (tokenizer.json "added_tokens") are literal text;
// special ones are left out of decoded text unless asked for, as transformers' decode(...,
// skip_special_tokens=True) does. A character can span tokens, so decoded bytes are UTF-8 only
// once a whole sequence is joined; to_valid_utf8() replaces what is left incomplete with U+FFFD.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace xinfer {

class Detokenizer {
public:
    // Reads a tokenizer.json. Throws naming the file (and the token) when it is not JSON, its
    // model has no vocabulary map, its decoder is not byte-level, or a vocabulary entry is not a
    // byte-level spelling.
    static Detokenizer load(const std::filesystem::path& tokenizer_json);
    // The same from a parsed tokenizer.json (`file` names it in errors).
    static Detokenizer from_json(const nlohmann::json& doc, const std::string& file);

    // The bytes token `id` stands for; empty for special tokens when skip_special, and for ids
    // the tokenizer does not define (models pad their vocabulary past the tokenizer's).
    const std::string& token_bytes(int32_t id, bool skip_special = true) const;
    // The bytes of a sequence, joined (may end inside a character: see to_valid_utf8).
    std::string decode(const std::vector<int32_t>& ids, bool skip_special = true) const;
    int64_t size() const { return int64_t(pieces_.size()); }

private:
    std::vector<std::string> pieces_;  // [id] bytes
    std::vector<bool> special_;        // [id]
};

// `bytes` with every invalid or incomplete UTF-8 sequence replaced by U+FFFD.
std::string to_valid_utf8(const std::string& bytes);
// `end`, moved back to the start of a UTF-8 sequence that bytes[.., end) would cut short (a
// character still waiting for its next token's bytes); `end` itself otherwise.
size_t whole_characters_end(const std::string& bytes, size_t end);

}  // namespace xinfer
