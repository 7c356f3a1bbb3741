#include "tokenizer/detokenizer.h"

#include "core/status.h"
#include "tokenizer/tokenizer_json.h"

#include <array>

namespace xinfer {
namespace {

using json = nlohmann::json;

// Decodes one UTF-8 code point at s[i], advancing i; -1 for a malformed sequence.
int32_t next_code_point(const std::string& s, size_t& i) {
    const auto byte = [&](size_t k) { return uint8_t(s[k]); };
    const uint8_t b0 = byte(i);
    int len = b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xe ? 3 : (b0 >> 3) == 0x1e ? 4 : 0;
    if (len == 0 || i + size_t(len) > s.size()) return ++i, -1;
    int32_t cp = len == 1 ? b0 : b0 & (0x7f >> len);
    for (int k = 1; k < len; ++k) {
        if ((byte(i + size_t(k)) & 0xc0) != 0x80) return ++i, -1;
        cp = (cp << 6) | (byte(i + size_t(k)) & 0x3f);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8.
    static constexpr int32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) return ++i, -1;
    i += size_t(len);
    return cp;
}

bool is_byte_level(const json& decoder) {
    if (!decoder.is_object()) return false;
    const std::string type = decoder.value("type", "");
    if (type == "ByteLevel") return true;
    if (type == "Sequence" && decoder.contains("decoders") && decoder["decoders"].is_array())
        for (const json& d : decoder["decoders"])
            if (is_byte_level(d)) return true;
    return false;
}

// The byte-level alphabet inverted: code point → byte, -1 where no byte is spelled so.
std::array<int, 512> byte_of_code_point() {
    std::array<int, 512> table;
    table.fill(-1);
    for (int b = 0; b < 256; ++b) {
        const std::string& spelled = byte_level_spelling(uint8_t(b));
        size_t i = 0;
        table[size_t(next_code_point(spelled, i))] = b;
    }
    return table;
}

}  // namespace

Detokenizer Detokenizer::load(const std::filesystem::path& tokenizer_json) {
    return from_json(read_tokenizer_json(tokenizer_json), tokenizer_json.string());
}

Detokenizer Detokenizer::from_json(const json& doc, const std::string& file) {
    if (!doc.is_object() || !doc.contains("model") || !doc["model"].is_object() || !doc["model"].contains("vocab") ||
        !doc["model"]["vocab"].is_object())
        fail("{}: expected a model with a \"vocab\" map of token → id (a BPE tokenizer)", file);
    const json decoder = doc.contains("decoder") ? doc["decoder"] : json();
    if (!is_byte_level(decoder))
        fail("{}: decoder {} is not supported: only byte-level BPE tokenizers (decoder type ByteLevel) are", file,
             decoder.is_null() ? std::string("null") : decoder.value("type", decoder.dump()));

    static const std::array<int, 512> byte_of = byte_of_code_point();
    Detokenizer d;
    const auto place = [&](int64_t id, const std::string& where) {
        if (id < 0 || id >= (int64_t(1) << 24)) fail("{}: {} has id {}, outside [0, 2^24)", file, where, id);
        if (id >= d.size()) {
            d.pieces_.resize(size_t(id) + 1);
            d.special_.resize(size_t(id) + 1, false);
        }
    };
    for (const auto& [token, id_json] : doc["model"]["vocab"].items()) {
        if (!id_json.is_number_integer()) fail("{}: vocabulary entry \"{}\" has a non-integer id", file, token);
        const int64_t id = id_json.get<int64_t>();
        place(id, "vocabulary entry \"" + token + "\"");
        std::string bytes;
        for (size_t i = 0; i < token.size();) {
            const int32_t cp = next_code_point(token, i);
            const int b = cp >= 0 && cp < 512 ? byte_of[size_t(cp)] : -1;
            if (b < 0) fail("{}: vocabulary entry \"{}\" (id {}) is not a byte-level spelling", file, token, id);
            bytes.push_back(char(b));
        }
        d.pieces_[size_t(id)] = std::move(bytes);
    }
    if (doc.contains("added_tokens") && doc["added_tokens"].is_array()) {
        for (const json& t : doc["added_tokens"]) {
            if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
                !t["content"].is_string())
                fail("{}: added token {} needs an integer \"id\" and a string \"content\"", file, t.dump());
            const int64_t id = t["id"].get<int64_t>();
            place(id, "added token " + t["content"].get<std::string>());
            d.pieces_[size_t(id)] = t["content"].get<std::string>();
            d.special_[size_t(id)] = t.value("special", false);
        }
    }
    return d;
}

const std::string& Detokenizer::token_bytes(int32_t id, bool skip_special) const {
    static const std::string empty;
    if (id < 0 || id >= size() || (skip_special && special_[size_t(id)])) return empty;
    return pieces_[size_t(id)];
}

std::string Detokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
    std::string text;
    for (int32_t id : ids) text += token_bytes(id, skip_special);
    return text;
}

size_t whole_characters_end(const std::string& bytes, size_t end) {
    // The last lead byte among the (at most 3) bytes before `end`, and the length it announces.
    for (size_t back = 1; back <= 3 && back <= end; ++back) {
        const uint8_t b = uint8_t(bytes[end - back]);
        if ((b & 0xc0) == 0x80) continue;  // a continuation byte: keep looking for the lead
        const size_t len = (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xe ? 3 : (b >> 3) == 0x1e ? 4 : 1;
        return len > back ? end - back : end;
    }
    return end;
}

std::string to_valid_utf8(const std::string& bytes) {
    std::string out;
    out.reserve(bytes.size());
    for (size_t i = 0; i < bytes.size();) {
        const size_t start = i;
        if (next_code_point(bytes, i) < 0) out += "\xEF\xBF\xBD";
        else out.append(bytes, start, i - start);
    }
    return out;
}

}  // namespace xinfer
